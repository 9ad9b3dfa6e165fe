"""The worker's end of the control channel: `WorkerLink`, a DEALER socket on its own thread.

The engine loop never touches the socket: it calls `poll()` for new work (non-blocking) and
`send_events()` for its tokens (queued; the I/O thread is woken through a socketpair so tokens
leave at once, not at the next poll tick). The I/O thread registers, heartbeats every
`heartbeat_interval`, and registers again whenever the router says it does not know us (it
restarted or timed us out). Every frame is authenticated (pdserve.protocol.auth); frames that do
not verify or decode are dropped and counted, never executed. Inbox and outbox are bounded.

Fencing: the router's epoch comes with its RegisterAck. When a router with another epoch
answers, or the router is silent for `ROUTER_LOST_HEARTBEATS` heartbeat intervals, `poll()`
yields a `Fence` before any work of the new router: the worker drops everything it holds.
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
from dataclasses import dataclass

import msgspec
import zmq

from pdserve.config.log_limits import RateLimitedLog
from pdserve.kvtransfer.transport.handshake import secure_client
from pdserve.protocol.auth import CONTROL_TO_ROUTER, CONTROL_TO_WORKER, AuthError, FrameAuth
from pdserve.protocol.codec import ProtocolError, encode, open_message
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Goodbye,
    Heartbeat,
    HeartbeatAck,
    Message,
    PrefillRequest,
    Register,
    RegisterAck,
    TokenEvent,
    TokenEvents,
)

log = logging.getLogger(__name__)
_log_bad = RateLimitedLog(log, logging.WARNING, per_seconds=10.0)

MAX_FRAME_BYTES = 256 * 1024 * 1024  # prompts can be long, but a control frame is never huge
MAX_INBOX = 4096  # work items not yet polled by the engine loop
MAX_OUTBOX = 4096  # token batches not yet sent
ROUTER_LOST_HEARTBEATS = 3  # silent heartbeat intervals before the router counts as lost


@dataclass(frozen=True, slots=True)
class Fence:
    """Drop the requests of a router that is gone (`epoch` is its new one, or '').

    A WorkerLink serves one router, so its Fence means all of that router's requests; RouterLinks
    (worker/router_links.py) names the router and exactly its `request_ids` before the worker
    sees it."""

    reason: str
    epoch: str
    router: str = ""
    request_ids: tuple[str, ...] = ()


Work = PrefillRequest | GenerateRequest | Abort | Fence


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
        *,
        auth: FrameAuth | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        if not register.incarnation:
            register = msgspec.structs.replace(register, incarnation=secrets.token_hex(8))
        self.router_address = router_address
        self.register = register
        self.worker_id = register.worker_id
        self.heartbeat_fn = heartbeat_fn
        self.heartbeat_interval = heartbeat_interval
        self.auth = auth or FrameAuth(None)
        # Called on the I/O thread after something lands in the inbox: the engine loop's wake-up,
        # so an idle loop takes new work as it arrives rather than at its next poll.
        self._on_ready = on_ready or (lambda: None)
        self.bad_messages = 0
        self.rejected = 0  # frames that failed authentication
        self.inbox_dropped = 0
        self.outbox_dropped = 0
        self.fences = 0
        self.refused_reason = ""
        self.epoch = ""  # the epoch of the router we are registered with ('' before / after loss)
        self._inbox: collections.deque[Work] = collections.deque()
        self._outbox: collections.deque[Message] = collections.deque()
        self._registered = threading.Event()
        self._stop = threading.Event()
        self._failed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._next_register = 0.0
        self._last_heard = 0.0
        self._router_answers_heartbeats = False
        self._unanswered = 0  # heartbeats sent since the router last said anything
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

    @property
    def alive(self) -> bool:
        """False once the I/O thread died (or was closed): nothing reaches the router any more."""
        return self._thread.is_alive() and not self._failed

    def poll(self) -> list[Work]:
        """Work the router sent since the last call, in order; never blocks."""
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def send_events(self, events: TokenEvents) -> bool:
        """Queue one step's token events; the I/O thread sends them at once. False: dropped."""
        if len(self._outbox) >= MAX_OUTBOX:
            self.outbox_dropped += 1
            _log_bad("worker %s: outbox full (%d batches); token events dropped", self.worker_id, MAX_OUTBOX)
            return False
        self._outbox.append(events)
        self._wake()
        return True

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
        sock.setsockopt(zmq.IPV6, 1)  # a dns:// router address may resolve to IPv6 ones
        secure_client(sock, self.auth)  # the router proves the secret before it hears anything
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
                    self._send(sock, self.register)
                    self._next_register = now + self.heartbeat_interval
                if now >= next_heartbeat:
                    self._check_router(now)
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
            self._failed = True
            log.exception("worker %s: control link to the router at %s failed", self.worker_id, self.router_address)
        finally:
            sock.close()

    def _send(self, sock: zmq.Socket, msg: Message) -> None:
        if self.epoch and isinstance(msg, Heartbeat | TokenEvents | Goodbye) and msg.epoch != self.epoch:
            msg = msgspec.structs.replace(msg, epoch=self.epoch)  # for this router only
        sock.send_multipart(self.auth.seal(CONTROL_TO_ROUTER, [encode(msg)]))

    def _send_heartbeat(self, sock: zmq.Socket) -> None:
        try:
            hb = self.heartbeat_fn()
        except Exception:
            log.exception("worker %s: heartbeat_fn failed; heartbeat skipped", self.worker_id)
            return
        self._send(sock, hb)
        self._unanswered += 1

    def _flush(self, sock: zmq.Socket) -> None:
        while self._outbox:
            self._send(sock, self._outbox.popleft())

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _check_router(self, now: float) -> None:
        """Fence when the router said nothing for ROUTER_LOST_HEARTBEATS heartbeat intervals.

        Counted in heartbeats we sent, not in seconds: a worker too wedged to heartbeat does not
        blame its router for the silence.
        """
        if not (self._registered.is_set() and self._router_answers_heartbeats):
            return
        silent = now - self._last_heard
        # At the heartbeat due N intervals after the last answer, N-1 heartbeats went unanswered.
        if self._unanswered >= ROUTER_LOST_HEARTBEATS - 1 and silent >= 0.95 * ROUTER_LOST_HEARTBEATS * self.heartbeat_interval:
            log.error("worker %s: the router at %s answered none of %d heartbeats (%.1f s); dropping its "
                      "work and registering again", self.worker_id, self.router_address, self._unanswered, silent)
            self._fence(f"lost the router at {self.router_address} (silent for {silent:.1f} s)", "", lost_work=True)
            self._router_answers_heartbeats = False
            self._registered.clear()
            self._next_register = now

    def _fence(self, reason: str, epoch: str, lost_work: bool) -> None:
        self.epoch = epoch
        if lost_work:
            self.fences += 1
            # A fenced worker lost its requests, as a restarted one does: a new incarnation tells
            # a router that still lists us to fail what it had given us.
            self.register = msgspec.structs.replace(self.register, incarnation=secrets.token_hex(8))
            self._inbox.clear()  # work nobody polled yet belongs to the old router too
        self._inbox.append(Fence(reason, epoch))
        self._on_ready()

    def _on_epoch(self, epoch: str) -> None:
        """Every router frame that names an epoch: a new one fences (and re-registers)."""
        if not epoch:  # a router (or test double) without epochs
            return
        self._router_answers_heartbeats = True
        if epoch == self.epoch:
            return
        old = self.epoch
        if old:
            log.warning("worker %s: the epoch of the router at %s changed (%s -> %s): it restarted",
                        self.worker_id, self.router_address, old, epoch)
            self._registered.clear()
            self._next_register = 0.0
        # The first epoch (or the first after a loss) also goes through the inbox: the engine
        # loop takes its epoch from there, in order with the work.
        self._fence(f"the router at {self.router_address} restarted (epoch {old} -> {epoch})" if old
                    else f"router {self.router_address} epoch {epoch}",
                    epoch, lost_work=bool(old))

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = open_message(self.auth, CONTROL_TO_WORKER, frames)
            except AuthError as exc:
                self.rejected += 1
                _log_bad("worker %s: control frame refused: %s", self.worker_id, exc, key=f"auth-{exc.reason}")
                continue
            except ProtocolError as exc:
                self._bad(str(exc))
                continue
            self._last_heard = time.monotonic()
            self._unanswered = 0
            if isinstance(msg, PrefillRequest | GenerateRequest | Abort):
                self._on_work(msg, sock)
            elif isinstance(msg, RegisterAck):
                self._on_ack(msg, sock)
            elif isinstance(msg, HeartbeatAck):
                self._on_epoch(msg.epoch)
            else:
                self._bad(f"{type(msg).__name__} is not a router-to-worker message")

    def _on_work(self, msg: PrefillRequest | GenerateRequest | Abort, sock: zmq.Socket) -> None:
        epoch = getattr(msg, "epoch", "")
        if epoch and not self.epoch:  # work before any ack: take the router's epoch first
            self._on_epoch(epoch)
        if epoch and self.epoch and epoch != self.epoch:
            self._bad(f"work of router epoch {epoch}, ours is {self.epoch}")
            return
        if len(self._inbox) >= MAX_INBOX and not isinstance(msg, Abort):
            self.inbox_dropped += 1
            _log_bad("worker %s: inbox full (%d); request %s from the router at %s refused", self.worker_id,
                     MAX_INBOX, msg.request_id, self.router_address)
            error = TokenEvent(request_id=msg.request_id, token_ids=(), finish_reason="error",
                               error="worker overloaded (inbox full); retry", retry="refused")
            self._send(sock, TokenEvents(worker_id=self.worker_id, events=(error,)))
            return
        self._inbox.append(msg)
        self._on_ready()

    def _on_ack(self, ack: RegisterAck, sock: zmq.Socket) -> None:
        self._on_epoch(ack.epoch)
        if ack.accepted:
            self.refused_reason = ""
            if not self._registered.is_set():
                log.info(
                    "worker %s registered with the router at %s (epoch %s)",
                    self.worker_id,
                    self.router_address,
                    ack.epoch or "-",
                )
            self._last_heard = time.monotonic()
            self._registered.set()
        elif ack.reason == "unknown worker":
            # The router answers every frame of a worker it does not know (each batch of tokens
            # queued while it was down): register once, and let the retry timer repeat it.
            if self._registered.is_set():
                # Same epoch, yet it forgot us: it timed us out or saw our connection close, and
                # has moved (or failed) what it gave us. Drop that work, as a restarted worker
                # would have, instead of computing tokens nobody reads.
                log.warning(
                    "worker %s: the router at %s no longer knows us (it timed us out or saw the "
                    "connection drop); dropping its work and registering again", self.worker_id, self.router_address,
                )
                self._fence("the router forgot us", self.epoch, lost_work=True)
                self._registered.clear()
                self._send(sock, self.register)
                self._next_register = time.monotonic() + self.heartbeat_interval
        else:
            self.refused_reason = ack.reason
            self._registered.clear()
            self._next_register = float("inf")  # retrying the same Register would be refused again
            log.error("worker %s: the router at %s refused registration: %s", self.worker_id, self.router_address,
                      ack.reason)

    def _bad(self, why: str) -> None:
        self.bad_messages += 1
        _log_bad("worker %s: control frame from the router at %s dropped: %s", self.worker_id, self.router_address,
                 why, key="bad")
