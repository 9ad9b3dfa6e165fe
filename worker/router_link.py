"""The worker's end of the control channel: `WorkerLink`, a DEALER socket on its own thread.

The engine loop never touches the socket: it calls `poll()` for new work (non-blocking) and
`send_events()` for its tokens (queued; the I/O thread is woken through a socketpair so tokens
leave at once, not at the next poll tick). The I/O thread registers, heartbeats every
`heartbeat_interval`, and registers again whenever the router says it does not know us (it
restarted or timed us out). Frames that do not decode are dropped and counted, never executed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Goodbye,
    Heartbeat,
    Message,
    PrefillRequest,
    Register,
    RegisterAck,
    TokenEvents,
)

log = logging.getLogger(__name__)

Work = PrefillRequest | GenerateRequest | Abort
MAX_FRAME_BYTES = 256 * 1024 * 1024  # prompts can be long, but a control frame is never huge


class WorkerLink:
    """A worker's registration, heartbeats, inbox and outbox on the router's control socket.

    `heartbeat_fn` runs on the I/O thread: it must be thread-safe (read counters, no locks held
    for long). `poll()` and `send_events()` may be called from any one engine thread.
    """

    def __init__(
        self,
        router_address: str,
        register: Register,
        heartbeat_fn: Callable[[], Heartbeat],
        heartbeat_interval: float = 1.0,
    ) -> None:
        if not register.incarnation:
            register = msgspec.structs.replace(register, incarnation=secrets.token_hex(8))
        self.router_address = router_address
        self.register = register
        self.worker_id = register.worker_id
        self.heartbeat_fn = heartbeat_fn
        self.heartbeat_interval = heartbeat_interval
        self.bad_messages = 0
        self.refused_reason = ""
        self._inbox: collections.deque[Work] = collections.deque()
        self._outbox: collections.deque[Message] = collections.deque()
        self._registered = threading.Event()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._next_register = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"worker-link-{self.worker_id}", daemon=True
        )

    # --- engine-facing API ---------------------------------------------------------------

    def start(self) -> WorkerLink:
        self._thread.start()
        return self

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def poll(self) -> list[Work]:
        """Work the router sent since the last call, in order; never blocks."""
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def send_events(self, events: TokenEvents) -> None:
        """Queue one step's token events; the I/O thread sends them at once."""
        self._outbox.append(events)
        self._wake()

    def close(self, timeout: float = 1.0) -> None:
        """Say Goodbye (best effort within `timeout`) and stop the I/O thread."""
        if self._thread.is_alive():
            self._outbox.append(Goodbye(worker_id=self.worker_id))
            self._stop.set()
            self._wake()
            self._thread.join(timeout)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        # A full pipe means a wake-up is already pending; a closed one, that we are done.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # --- I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 1000)  # lets the Goodbye out on close
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(self.router_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._next_register = 0.0
        next_heartbeat = time.monotonic() + self.heartbeat_interval
        try:
            while True:
                now = time.monotonic()
                if not self._registered.is_set() and now >= self._next_register:
                    sock.send(encode(self.register))
                    self._next_register = now + self.heartbeat_interval
                if now >= next_heartbeat:
                    self._send_heartbeat(sock)
                    next_heartbeat = now + self.heartbeat_interval
                self._flush(sock)
                if self._stop.is_set():
                    return
                due = (
                    next_heartbeat
                    if self._registered.is_set()
                    else min(next_heartbeat, self._next_register)
                )
                ready = dict(poller.poll(int(max(0.0, due - time.monotonic()) * 1000) + 1))
                if self._wake_r.fileno() in ready:
                    self._drain_wake()
                if sock in ready:
                    self._receive(sock)
        except Exception:
            log.exception("worker %s: control link failed", self.worker_id)
        finally:
            sock.close()

    def _send_heartbeat(self, sock: zmq.Socket) -> None:
        try:
            hb = self.heartbeat_fn()
        except Exception:
            log.exception("worker %s: heartbeat_fn failed; heartbeat skipped", self.worker_id)
            return
        sock.send(encode(hb))

    def _flush(self, sock: zmq.Socket) -> None:
        while self._outbox:
            sock.send(encode(self._outbox.popleft()))

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                self._bad(f"expected 1 frame, got {len(frames)}")
                continue
            try:
                msg = decode(frames[0])
            except ProtocolError as exc:
                self._bad(str(exc))
                continue
            if isinstance(msg, PrefillRequest | GenerateRequest | Abort):
                self._inbox.append(msg)
            elif isinstance(msg, RegisterAck):
                self._on_ack(msg, sock)
            else:
                self._bad(f"{type(msg).__name__} is not a router-to-worker message")

    def _on_ack(self, ack: RegisterAck, sock: zmq.Socket) -> None:
        if ack.accepted:
            self.refused_reason = ""
            if not self._registered.is_set():
                log.info(
                    "worker %s registered with the router at %s",
                    self.worker_id,
                    self.router_address,
                )
            self._registered.set()
        elif ack.reason == "unknown worker":
            log.warning(
                "worker %s: the router does not know us (restarted?); registering again",
                self.worker_id,
            )
            self._registered.clear()
            sock.send(encode(self.register))
        else:
            self.refused_reason = ack.reason
            self._registered.clear()
            self._next_register = float("inf")  # retrying the same Register would be refused again
            log.error("worker %s: the router refused registration: %s", self.worker_id, ack.reason)

    def _bad(self, why: str) -> None:
        self.bad_messages += 1
        log.warning("worker %s: control frame from the router dropped: %s", self.worker_id, why)
