"""The router's end of the control channel: one zmq ROUTER socket on its own I/O thread.

Workers connect a DEALER whose identity is their worker_id. Every frame is authenticated
(pdserve.protocol.auth; HMAC-SHA256 with replay protection) and then one msgpack message
(pdserve.protocol.messages); anything else is refused, counted, and logged rate-limited, never
executed. The I/O thread owns the socket: it stamps each frame's arrival time as soon as it is
read, verifies and decodes it, and hands the message to the event loop; the loop's `send` only
queues (bounded). Liveness is judged from arrival times, so a blocked event loop does not by
itself expire workers whose heartbeats arrived. `_reap_loop` (on the event loop) expires the
silent ones.

A worker's death is noticed at once where the kernel closes its connection (kill -9, a crash,
OOM): a socket monitor reports the disconnect of the file descriptor the worker's frames came
from, and the worker is lost then and there, not a heartbeat timeout later. Heartbeats remain the
judge for what closes no connection (a wedged process, a partitioned host).

Fencing: `epoch` is random per router start. RegisterAck, HeartbeatAck and every piece of work
carry it; a worker that sees a new epoch drops everything an older router gave it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import msgspec
import zmq
from prometheus_client import Counter
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from pdserve.config.log_limits import RateLimitedLog
from pdserve.protocol.auth import (
    CONTROL_TO_ROUTER,
    CONTROL_TO_WORKER,
    HANDSHAKE_FAILED,
    ZAP_ENDPOINT,
    AuthError,
    FrameAuth,
    curve_secrets,
    zap_reply,
)
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
    TokenEvents,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Registry, WorkerState
from pdserve.router.requests import RequestTracker

log = logging.getLogger(__name__)

UNKNOWN_WORKER = "unknown worker"
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a control frame is small; a bigger one is an attack or a bug
MAX_OUTBOX = 65536  # frames queued for workers before `send` drops (and counts) them
MAX_INBOX = 65536  # messages read but not yet handled by the event loop
_BATCH = 256  # frames read per wake-up before the outbox gets a turn
HANDSHAKE_IVL_MS = 5000  # a connection that has not proved the secret by then is dropped
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_log_bad = RateLimitedLog(log, logging.WARNING, per_seconds=10.0)


class ControlServer:
    """Feeds the registry and the request tracker from worker messages; sends work and aborts."""

    def __init__(
        self,
        address: str,
        registry: Registry,
        tracker: RequestTracker,
        metrics: RouterMetrics,
        heartbeat_timeout: float = 3.0,
        *,
        on_lost: Callable[[WorkerState, str], int],
        auth: FrameAuth | None = None,
        model_name: str | None = None,
    ) -> None:
        self.address = address
        self.registry = registry
        self.tracker = tracker
        self.metrics = metrics
        self.heartbeat_timeout = heartbeat_timeout
        self.auth = auth or FrameAuth(None)
        self.model_name = model_name
        self.epoch = secrets.token_hex(8)
        self.rejected = Counter(
            "pdserve_control_rejected",
            "Control frames refused before decoding: no or bad MAC, replay, stale timestamp",
            ["reason"],
            registry=metrics.registry,
        )
        self.outbox_dropped = 0
        self.inbox_dropped = 0
        self.bound_address = ""
        self.alive = False
        self.on_lost = on_lost  # what a lost worker's requests come to (migrated or failed)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._zap: zmq.Socket | None = None
        self._client_key = b""  # the deployment's CURVE client key, raw (what ZAP reports)
        self._out: queue.Queue[tuple[bytes, bytes]] = queue.Queue(MAX_OUTBOX)
        self._arrived: dict[str, float] = {}  # worker_id -> monotonic arrival of its last frame
        # The connection (file descriptor) each worker's latest verified frame came on (I/O thread).
        self._fd_of: dict[str, int] = {}
        self._worker_on: dict[int, str] = {}
        self.disconnects = 0
        self._inbox_len = 0  # messages handed to the event loop and not yet handled
        self._inbox_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task] = []

    def configure(self, *, auth: FrameAuth, model_name: str | None) -> None:
        """The deployment secret's authenticator and the router's model (before `start`)."""
        assert not self.alive, "configure() before start()"
        self.auth, self.model_name = auth, model_name

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # A worker that connects again under its identity takes it over from the old connection;
        # with a secret, every connection has proved it (below), so no stranger can hold one.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.auth.secure:
            self._secure(sock)
        sock.bind(self.address)
        self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self.alive = True
        # The socket moves to the I/O thread (thread start is the memory barrier zmq asks for).
        self._thread = threading.Thread(target=self._io, name="control-io", daemon=True)
        self._thread.start()
        self._tasks = [asyncio.create_task(self._reap_loop(), name="control-reap")]
        if not self.auth.secure:
            log.warning("control channel on %s is NOT authenticated (--insecure)", self.bound_address)
        log.info("control channel listening on %s (epoch %s)", self.bound_address, self.epoch)

    def _secure(self, sock: zmq.Socket) -> None:
        """CURVE with the deployment's keys, clients admitted by ZAP only with the deployment's key:
        no frame of a peer without the secret is accepted, not even buffered beyond its first
        (kvtransfer/transport/handshake.py is the same for the KV plane; docs/security.md)."""
        assert self._ctx is not None and self.auth.key is not None
        keys = curve_secrets(self.auth.key)
        self._client_key = z85.decode(zmq.curve_public(z85.encode(keys.client)))
        self._zap = zap = self._ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)  # before the ROUTER binds: without it libzmq admits anyone
        sock.curve_server = True
        sock.curve_secretkey = z85.encode(keys.server)
        sock.handshake_ivl = HANDSHAKE_IVL_MS

    async def stop(self) -> None:
        self.alive = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._stop.set()
        self._wake()
        if self._thread is not None:
            # Aborts queued during shutdown still go out: the thread flushes before it closes.
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._thread is not None and self._thread.is_alive():
            log.error("control channel I/O thread did not stop; leaving its socket open")
        elif self._ctx is not None:
            self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # --- outgoing (event loop) ------------------------------------------------------------

    def send(self, worker_id: str, msg: Message) -> None:
        """Queue one message for a worker; never blocks (a full queue drops it, counted)."""
        if isinstance(msg, PrefillRequest | GenerateRequest | Abort) and msg.epoch != self.epoch:
            msg = msgspec.structs.replace(msg, epoch=self.epoch)
        try:
            self._out.put_nowait((worker_id.encode(), encode(msg)))
        except queue.Full:
            self.outbox_dropped += 1
            _log_bad("control outbox full (%d frames): %s to %s dropped", MAX_OUTBOX,
                     type(msg).__name__, worker_id, key="outbox-full")
            return
        self._wake()

    def abort(self, worker_ids: Sequence[str], request_ids: Sequence[str]) -> None:
        for wid in dict.fromkeys(worker_ids):
            log.info("abort %s -> worker %s", ",".join(request_ids), wid)
            self.send(wid, Abort(request_ids=tuple(request_ids)))

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # --- the I/O thread -------------------------------------------------------------------

    def _io(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        poller.register(monitor, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._wake_r.fileno() in ready:
                    with contextlib.suppress(BlockingIOError, OSError):
                        while self._wake_r.recv(4096):
                            pass
                if sock in ready:
                    self._read(sock)
                if monitor in ready:
                    self._on_monitor(monitor)
                if self._zap is not None and self._zap in ready:
                    self._answer_zap(self._zap)
                self._flush(sock)
            self._flush(sock)
        except Exception:
            self.alive = False
            log.exception("control channel I/O thread failed")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=200)
            if self._zap is not None:
                self._zap.close(linger=0)

    def _read(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            arrival = time.monotonic()  # before any verification or handling
            try:
                self._receive([p.bytes for p in parts], arrival, _source_fd(parts[0]))
            except Exception:  # a bug must not kill the channel
                self.metrics.bad_messages.inc()
                log.exception("control frame handling failed")

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """Connections that closed: a worker whose latest frame came on one is gone."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & _HANDSHAKE_FAILED:
                self.rejected.labels(HANDSHAKE_FAILED).inc()
                _log_bad("control connection refused: it did not prove the deployment secret",
                         key="auth-handshake")
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(event["value"])
            worker_id = self._worker_on.pop(fd, None)
            if worker_id is None or self._fd_of.get(worker_id) != fd:
                continue  # not a worker's connection, or it already reconnected on another
            del self._fd_of[worker_id]
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._on_disconnect, worker_id)

    def _answer_zap(self, zap: zmq.Socket) -> None:
        while True:
            try:
                request = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            zap.send_multipart(zap_reply(request, self._client_key))

    def _flush(self, sock: zmq.Socket) -> None:
        while True:
            try:
                ident, frame = self._out.get_nowait()
            except queue.Empty:
                return
            try:
                sock.send_multipart([ident, *self.auth.seal(CONTROL_TO_WORKER, [frame])], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # ROUTER without MANDATORY only fails on shutdown / HWM
                _log_bad("control send to %r failed: %s", ident[:64], exc, key="send-failed")

    def _receive(self, frames: list[bytes], arrival: float, fd: int | None = None) -> None:
        """Verify and decode one frame on the I/O thread; hand a valid message to the loop."""
        ident = frames[0]
        try:
            msg = open_message(self.auth, CONTROL_TO_ROUTER, frames[1:])
        except AuthError as exc:
            self.rejected.labels(exc.reason).inc()
            _log_bad("control frame from %r refused: %s", ident[:64], exc, key=f"auth-{exc.reason}")
            return
        except ProtocolError as exc:
            return self._bad(ident, str(exc))
        if not isinstance(msg, Register | Heartbeat | TokenEvents | Goodbye):
            return self._bad(ident, f"{type(msg).__name__} is not a worker-to-router message")
        if msg.worker_id.encode() != ident:
            return self._bad(ident, f"worker_id {msg.worker_id!r} does not match the connection identity")
        if not isinstance(msg, Register) and not _for_epoch(msg, self.epoch):
            # No liveness from it: the event loop decides what it is (_other_epoch).
            self._hand_over(msg, arrival)
            return
        self._arrived[msg.worker_id] = arrival
        if fd is not None and self._fd_of.get(msg.worker_id) != fd:
            self._fd_of[msg.worker_id] = fd
            self._worker_on[fd] = msg.worker_id
        self._hand_over(msg, arrival)

    def _hand_over(self, msg: Register | Heartbeat | TokenEvents | Goodbye, arrival: float) -> None:
        """Queue a verified message for the event loop (bounded: a full inbox drops it, counted)."""
        with self._inbox_lock:
            if self._inbox_len >= MAX_INBOX:
                self.inbox_dropped += 1
                _log_bad("control inbox full: %s from %s dropped", type(msg).__name__, msg.worker_id,
                         key="inbox-full")
                return
            self._inbox_len += 1
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us: shutting down
            loop.call_soon_threadsafe(self._dispatch, msg, arrival)

    def _bad(self, ident: bytes, why: str) -> None:
        self.metrics.bad_messages.inc()
        _log_bad("control frame from %r dropped: %s", ident[:64], why, key="bad-frame")

    # --- handling (event loop) ------------------------------------------------------------

    def _dispatch(self, msg: Register | Heartbeat | TokenEvents | Goodbye, arrival: float) -> None:
        with self._inbox_lock:
            self._inbox_len -= 1
        try:
            if not isinstance(msg, Register) and not _for_epoch(msg, self.epoch):
                self._other_epoch(msg)
            elif isinstance(msg, Register):
                self._on_register(msg, arrival)
            elif isinstance(msg, Heartbeat):
                self._on_heartbeat(msg, arrival)
            elif isinstance(msg, TokenEvents):
                self._on_tokens(msg, arrival)
            else:
                w = self.registry.remove(msg.worker_id)
                if w is not None:
                    log.info("worker %s (%s) said goodbye", w.worker_id, w.role)
                    self._lost(w, f"worker {w.worker_id} left")
        except Exception:  # a handler bug must not kill the channel
            self.metrics.bad_messages.inc()
            log.exception("control message handling failed")

    def _other_epoch(self, msg: Heartbeat | TokenEvents | Goodbye) -> None:
        """A frame for another router (or this router's previous start). From a worker registered
        here it is a replay: dropped. Otherwise the worker registered with our predecessor: asked
        to register again, which tells it our epoch (its fence follows)."""
        if msg.worker_id in self.registry.workers or isinstance(msg, Goodbye):
            self.metrics.bad_messages.inc()
            _log_bad("%s from %s names router epoch %r, ours is %s: dropped", type(msg).__name__,
                     msg.worker_id, msg.epoch, self.epoch, key="other-epoch")
            return
        self._refuse(msg.worker_id, UNKNOWN_WORKER)

    def _refuse(self, worker_id: str, reason: str) -> None:
        self.send(worker_id, RegisterAck(worker_id=worker_id, accepted=False, reason=reason, epoch=self.epoch))

    def _on_register(self, msg: Register, now: float) -> None:
        reason: str | None = None
        if self.model_name is not None and msg.fingerprint.model != self.model_name:
            reason = f"model mismatch: the worker runs {msg.fingerprint.model!r}, the router serves {self.model_name!r}"
        old = None
        if reason is None:
            reason, old = self.registry.register(msg, now)
        if reason is not None:
            _log_bad("worker %s refused: %s", msg.worker_id, reason, key=f"refused-{msg.worker_id}")
            self._refuse(msg.worker_id, reason)
            return
        # The ack (with our epoch) goes first: work re-dispatched from the old incarnation may go
        # to the new one, which must know the epoch before it takes that work.
        self.send(msg.worker_id, RegisterAck(worker_id=msg.worker_id, accepted=True, epoch=self.epoch))
        if old is not None:
            self._lost(old, f"worker {msg.worker_id} registered again (restarted)", forget=False)
        log.info(
            "worker %s registered: role %s, %d blocks, max_model_len %d, host %r, transports %s",
            msg.worker_id,
            msg.role,
            msg.num_blocks,
            msg.max_model_len,
            msg.host_id,
            ",".join(msg.kv_transports),
        )
        self._count_workers()

    def _on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        prev = self.registry.workers.get(msg.worker_id)
        prev_hb = prev.last_heartbeat if prev is not None else None
        w = self.registry.heartbeat(msg, now)
        if w is None:
            # The router restarted or timed the worker out: ask it to register again.
            self._refuse(msg.worker_id, UNKNOWN_WORKER)
            return
        self.send(msg.worker_id, HeartbeatAck(worker_id=msg.worker_id, epoch=self.epoch))
        m, labels = self.metrics, (w.worker_id, w.role)
        m.kv_blocks_free.labels(*labels).set(msg.free_blocks)
        m.kv_blocks_used.labels(*labels).set(msg.total_blocks - msg.free_blocks)
        m.kv_cache_resident.labels(*labels).set(1 if msg.kv_resident else 0)
        for field, direction in (("kv_bytes_sent", "sent"), ("kv_bytes_received", "received")):
            m.kv_bytes.labels(*labels, direction).inc(_delta(prev_hb, msg, field))
        m.kv_seconds.labels(*labels).inc(_delta(prev_hb, msg, "kv_transfer_seconds"))
        for field, counter in (("stage_busy_seconds", m.stage_busy), ("stage_idle_seconds", m.stage_idle)):
            old = getattr(prev_hb, field, ()) if prev_hb is not None else ()
            for stage, new in enumerate(getattr(msg, field)):
                before = old[stage] if stage < len(old) else 0.0
                counter.labels(*labels, str(stage)).inc(max(0.0, new - before if new >= before else new))

    def _on_tokens(self, msg: TokenEvents, now: float) -> None:
        if not self.registry.touch(msg.worker_id, now):
            self._refuse(msg.worker_id, UNKNOWN_WORKER)
        stray = []
        for ev in msg.events:
            if not self.tracker.deliver(msg.worker_id, ev, now) and ev.finish_reason is None:
                stray.append(ev.request_id)
        if stray:
            # Work this router never gave that worker (a transfer replayed into it, a request this
            # router forgot): stopped there, not only ignored here. Aborts are idempotent.
            _log_bad("worker %s runs %d requests this router did not give it (%s): aborted", msg.worker_id,
                     len(stray), ",".join(stray[:4]), key="stray-tokens")
            self.send(msg.worker_id, Abort(request_ids=tuple(dict.fromkeys(stray))))

    # --- liveness ------------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        period = max(0.02, min(0.25, self.heartbeat_timeout / 4))
        while True:
            await asyncio.sleep(period)
            dead = self.registry.expire(time.monotonic(), self.heartbeat_timeout, self._arrived)
            for w in dead:
                self._arrived.pop(w.worker_id, None)
                self.metrics.worker_failures.inc()
                log.error(
                    "worker %s (%s) missed heartbeats for %.1f s: out of rotation",
                    w.worker_id,
                    w.role,
                    self.heartbeat_timeout,
                )
                self._lost(w, f"worker {w.worker_id} ({w.role}) stopped responding")

    def _on_disconnect(self, worker_id: str) -> None:
        w = self.registry.remove(worker_id)
        if w is None:
            return  # it said goodbye, or had already expired
        self.disconnects += 1
        self._arrived.pop(worker_id, None)
        self.metrics.worker_failures.inc()
        log.error("worker %s (%s) disconnected: out of rotation", w.worker_id, w.role)
        self._lost(w, f"worker {w.worker_id} ({w.role}) disconnected")

    def _lost(self, w: WorkerState, message: str, forget: bool = True) -> None:
        n = self.on_lost(w, message)
        if n:
            log.warning("%s: failed %d in-flight requests", message, n)
        if forget:
            self.metrics.forget_worker(w.worker_id, w.role)
        self._count_workers()

    def _count_workers(self) -> None:
        counts: dict[str, int] = defaultdict(int)
        for w in self.registry.workers.values():
            counts[w.role] += 1
        for role in ("prefill", "decode", "colocated"):
            self.metrics.workers.labels(role).set(counts[role])


def _for_epoch(msg: Message, epoch: str) -> bool:
    """Whether a worker's frame is for the router of `epoch` ("" : sent before it knew one)."""
    other = getattr(msg, "epoch", "")
    return not other or other == epoch


def _source_fd(frame: zmq.Frame) -> int | None:
    """The file descriptor of the connection a frame came on (None where libzmq cannot say)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def _delta(prev: Heartbeat | None, cur: Heartbeat, field: str) -> float:
    """Increase of a cumulative heartbeat counter; a drop means the worker restarted."""
    new = getattr(cur, field)
    old = getattr(prev, field) if prev is not None else 0
    return new - old if new >= old else new
