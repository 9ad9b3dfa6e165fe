"""The KV transport interface, and the I/O thread every transport runs its sockets in.

Ownership: a sender or receiver owns one I/O thread, and that thread owns every zmq socket of
it (zmq sockets are not thread-safe). The engine thread only calls the non-blocking methods
below; they hand work to the I/O thread through a queue and a wake-up pipe, and read results
from queues the I/O thread fills. Nothing received is unpickled or executed: headers are
decoded strictly by `pdserve.protocol.messages.decode`, payloads are raw bytes.

Every KV frame and ack is MAC'd with the deployment secret (pdserve.protocol.auth): a sender or
receiver is given its `FrameAuth` (`auth=`); without one it runs unauthenticated, and a secured
peer refuses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from pdserve.protocol.messages import KVAck, KVPart, KVTransfer

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """A transfer that cannot be staged or opened (the reason goes into a NACK)."""


class TransportUnavailable(RuntimeError):
    """A transport that cannot run on this machine (e.g. CUDA IPC without a GPU)."""


@dataclass(slots=True)
class ReceivedKV:
    """One KV transfer as the decode engine sees it.

    `payload` is a zero-copy view (CPU, or CUDA for cuda_ipc) of the message's own blocks,
    [meta.first_block, num_blocks), valid until `release()` or the `ack` of its request; for shm /
    CUDA IPC also only until `meta.lease_deadline` (copy it into the cache, then check
    `within_lease()` before trusting the copy). A streamed transfer's earlier blocks came in
    `parts`, each (first block, view) and verified on arrival; `pieces()` lists them all. `ok`
    False: `payload` is None and `reason` says why (checksum, fingerprint, shape...); ack it with
    ok=False. `arrived_at` / `verified_at`: time.time() when the message came off the socket and
    when its checks were done.
    """

    meta: KVTransfer
    payload: torch.Tensor | None
    ok: bool
    reason: str = ""
    _on_release: Callable[[], None] | None = field(default=None, repr=False)
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    arrived_at: float = 0.0
    verified_at: float = 0.0
    stream: int = 0  # the receiver's number of the stream whose `parts` these are (0: none)

    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """Every block range of the transfer, in order: (first block, [L, 2, blocks, ...] view)."""
        if self.payload is None:
            return []
        return [*self.parts, (self.meta.first_block, self.payload)]

    def release(self) -> None:
        """Drop the views (idempotent); the transport may reuse their memory afterwards."""
        self.payload = None
        self.parts = []
        hook, self._on_release = self._on_release, None
        if hook is not None:
            hook()

    def within_lease(self, now: float | None = None) -> bool:
        deadline = self.meta.lease_deadline
        return deadline == 0.0 or (time.time() if now is None else now) < deadline


@dataclass(frozen=True, slots=True)
class PartArrived:
    """A streamed part verified on arrival (`KVReceiver.poll_parts`): blocks [first_block,
    first_block + view.shape[2]) of the `total_blocks` of stream number `stream` (unique per
    receiver). `view` is valid while the stream is open; the decode worker may copy it into
    blocks it set aside, and trust that copy only if the transfer that ends the stream says the
    same `stream` (ReceivedKV.stream): the sender holds the parts until that transfer's ack."""

    request_id: str
    stream: int
    first_block: int
    total_blocks: int
    view: torch.Tensor


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """Stream number `stream` was dropped without a transfer ending it (cancelled, idle, a part
    refused, replaced by a new stream): blocks set aside for it can go."""

    request_id: str
    stream: int


class KVSender(ABC):
    """Prefill side. Every `send` yields exactly one KVAck from `poll_acks`: the decode worker's,
    or a local ok=False one (lease expired, send queue full, payload could not be staged).
    The payload tensor must not be modified after `send` (pass a fresh `gather_blocks` result).
    """

    kind: str

    @abstractmethod
    def send(self, address: str, meta: KVTransfer, payload: torch.Tensor) -> bool:
        """Queue `payload` for the decode worker listening at `address`; returns at once, False
        when it refused the send there and then (its NACK is already in `poll_acks`).
        The sender fills in meta.tensor (with its checksum), .transport, .location, .lease_deadline."""

    @abstractmethod
    def send_part(self, address: str, part: KVPart, payload: torch.Tensor) -> bool:
        """Queue one streamed part of a request's KV (no ack of its own): the request's
        `send` with `meta.parts` equal to the parts sent ends the stream, and its ack (or lease
        expiry) frees them all. A part that cannot be staged breaks the stream: that `send`
        then fails with a local NACK."""

    @abstractmethod
    def cancel_stream(self, request_id: str) -> None:
        """Tell the receiver to drop the parts of a stream that will not end in a `send` (the
        request ended at its first token, or was aborted); free them here after the lease."""

    @abstractmethod
    def poll_acks(self, timeout: float = 0.0) -> list[KVAck]:
        """Acks that arrived since the last call; waits up to `timeout` s for the first one."""

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(ABC):
    """Decode side, bound to `address`. Every ReceivedKV from `poll` must be acked exactly once."""

    kind: str
    address: str

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> list[ReceivedKV]:
        """Transfers that arrived (verified or refused); waits up to `timeout` s for the first."""

    @abstractmethod
    def ack(self, request_id: str, ok: bool, reason: str = "") -> None:
        """Release the request's payload and send its KVAck to the prefill worker; non-blocking."""

    @abstractmethod
    def drop_stream(self, request_id: str) -> None:
        """Drop the parts of the request's stream that has not ended yet (the request was aborted
        or sent elsewhere); non-blocking. A transfer that ends it later is NACKed."""

    def poll_parts(self) -> list[PartArrived | StreamEnded]:
        """Streamed parts verified, and streams dropped, since the last call (in order); never
        blocks. Advisory: a full queue drops events, and `poll` still hands out every part."""
        return []

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drain(q: queue.Queue, timeout: float) -> list:
    """Everything in `q`, waiting up to `timeout` s for the first item when it is empty."""
    items = []
    try:
        items.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
        while True:
            items.append(q.get_nowait())
    except queue.Empty:
        pass
    return items


class IOLoop:
    """A thread that owns zmq sockets: runs their handlers, queued commands and a timer tick.

    `call_soon(fn)` runs `fn()` on the thread (from any thread). Handlers never kill the loop:
    an exception is logged and counted in `counters["handler_errors"]`.
    """

    def __init__(self, name: str, tick: Callable[[float], float | None] | None = None) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.counters: Counter[str] = Counter()
        self._poller = zmq.Poller()
        self._handlers: dict[zmq.Socket, Callable[[zmq.Socket], None]] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._tick = tick  # returns seconds until it wants to run again (None: whenever)
        self._stopping = False  # read and written by the loop thread only
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add_socket(self, sock: zmq.Socket, handler: Callable[[zmq.Socket], None]) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        self._handlers.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake already
            os.write(self._wake_w, b"\0")

    def call(self, fn: Callable[[], object], timeout: float = 10.0) -> object:
        """Run `fn` on the loop and return its result (or raise its exception) here."""
        done = threading.Event()
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            done.set()

        self.call_soon(run)
        if not done.wait(timeout):
            raise TimeoutError(f"I/O thread {self._thread.name} did not answer within {timeout}s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")

    def stop(self, finalize: Callable[[], None] | None = None, timeout: float = 5.0) -> None:
        """Run `finalize` on the loop, close every socket and join the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True

        def halt() -> None:
            if finalize is not None:
                finalize()
            self._stopping = True

        self.call_soon(halt)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("I/O thread %s did not stop within %ss", self._thread.name, timeout)
            return
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.ctx.term()

    def _run(self) -> None:
        wait_s: float | None = None
        while not self._stopping:
            timeout_ms = None if wait_s is None else max(0, int(wait_s * 1000))
            try:
                events = dict(self._poller.poll(timeout_ms))
            except zmq.ZMQError as exc:  # only on a broken context; nothing sensible left to do
                log.exception("I/O thread %s: poll failed: %s", self._thread.name, exc)
                break
            if events.pop(self._wake_r, None):
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            while not self._commands.empty() and not self._stopping:
                self._guarded(self._commands.get_nowait())
            for sock in events:
                handler = self._handlers.get(sock)
                if handler is not None:
                    self._guarded(handler, sock)
            if self._tick is not None:
                wait = self._guarded(self._tick, time.monotonic())
                wait_s = wait if isinstance(wait, float | int) else None
        for sock in list(self._handlers):
            sock.close(linger=0)
        self._handlers.clear()

    def _guarded(self, fn: Callable[..., object], *args: object) -> object:
        try:
            return fn(*args)
        except Exception:
            self.counters["handler_errors"] += 1
            log.exception("I/O thread %s: handler failed (kept running)", self._thread.name)
            return None
