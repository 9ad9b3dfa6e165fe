"""The router's end of the control channel: one zmq ROUTER socket served by asyncio tasks.

Workers connect a DEALER whose identity is their worker_id. Every frame is one msgpack
message (pdserve.protocol.messages); anything else is dropped, counted, and logged, never executed.
Three tasks share the router's event loop, none of them ever blocks it: `_recv_loop` (frames
in), `_send_loop` (frames out, fed by the non-blocking `send`), `_reap_loop` (heartbeat timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import zmq
import zmq.asyncio

from pdserve.protocol.codec import ProtocolError, decode, encode
from pdserve.protocol.messages import (
    Abort,
    Goodbye,
    Heartbeat,
    Message,
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


class ControlServer:
    """Feeds the registry and the request tracker from worker messages; sends work and aborts."""

    def __init__(
        self,
        address: str,
        registry: Registry,
        tracker: RequestTracker,
        metrics: RouterMetrics,
        heartbeat_timeout: float = 3.0,
    ) -> None:
        self.address = address
        self.registry = registry
        self.tracker = tracker
        self.metrics = metrics
        self.heartbeat_timeout = heartbeat_timeout
        self.bound_address = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._out: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.alive = False

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.bind(self.address)
        self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self.alive = True
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="control-recv"),
            asyncio.create_task(self._send_loop(), name="control-send"),
            asyncio.create_task(self._reap_loop(), name="control-reap"),
        ]
        log.info("control channel listening on %s", self.bound_address)

    async def stop(self) -> None:
        self.alive = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._sock is not None:
            # Aborts queued during shutdown still go out (ROUTER never blocks on send).
            sync: zmq.Socket = zmq.Socket.shadow(self._sock.underlying)
            while not self._out.empty():
                ident, frame = self._out.get_nowait()
                with contextlib.suppress(zmq.ZMQError):
                    sync.send_multipart([ident, frame], flags=zmq.NOBLOCK)
            self._sock.close(linger=200)
        if self._ctx is not None:
            self._ctx.term()

    # --- outgoing ------------------------------------------------------------------------

    def send(self, worker_id: str, msg: Message) -> None:
        """Queue one message for a worker; never blocks (a gone worker's messages are dropped)."""
        self._out.put_nowait((worker_id.encode(), encode(msg)))

    def abort(self, worker_ids: Sequence[str], request_ids: Sequence[str]) -> None:
        for wid in dict.fromkeys(worker_ids):
            log.info("abort %s -> worker %s", ",".join(request_ids), wid)
            self.send(wid, Abort(request_ids=tuple(request_ids)))

    async def _send_loop(self) -> None:
        assert self._sock is not None
        while True:
            ident, frame = await self._out.get()
            try:
                await self._sock.send_multipart([ident, frame])
            except zmq.ZMQError as exc:  # ROUTER without MANDATORY only fails on shutdown
                log.warning("control send to %r failed: %s", ident, exc)

    # --- incoming ------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=True)
            except zmq.ZMQError as exc:
                log.warning("control receive failed: %s", exc)
                await asyncio.sleep(0.01)
                continue
            try:
                self._handle(frames)
            except Exception:  # a handler bug must not kill the channel
                self.metrics.bad_messages.inc()
                log.exception("control message handling failed")

    def _bad(self, ident: bytes, why: str) -> None:
        self.metrics.bad_messages.inc()
        log.warning("control frame from %r dropped: %s", ident[:64], why)

    def _handle(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if len(frames) != 2:
            return self._bad(ident, f"expected 1 message frame, got {len(frames) - 1}")
        try:
            msg = decode(frames[1])
        except ProtocolError as exc:
            return self._bad(ident, str(exc))
        worker_id = getattr(msg, "worker_id", None)
        if not isinstance(msg, Register | Heartbeat | TokenEvents | Goodbye):
            return self._bad(ident, f"{type(msg).__name__} is not a worker-to-router message")
        if worker_id is None or worker_id.encode() != ident:
            return self._bad(
                ident, f"worker_id {worker_id!r} does not match the connection identity"
            )
        now = time.monotonic()
        if isinstance(msg, Register):
            self._on_register(msg, now)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg, now)
        elif isinstance(msg, TokenEvents):
            self._on_tokens(msg, now)
        else:
            w = self.registry.remove(msg.worker_id)
            if w is not None:
                log.info("worker %s (%s) said goodbye", w.worker_id, w.role)
                self._lost(w, f"worker {w.worker_id} left")

    def _on_register(self, msg: Register, now: float) -> None:
        reason, old = self.registry.register(msg, now)
        if reason is not None:
            log.warning("worker %s refused: %s", msg.worker_id, reason)
            self.send(
                msg.worker_id, RegisterAck(worker_id=msg.worker_id, accepted=False, reason=reason)
            )
            return
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
        self.send(msg.worker_id, RegisterAck(worker_id=msg.worker_id, accepted=True))

    def _on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        prev = self.registry.workers.get(msg.worker_id)
        prev_hb = prev.last_heartbeat if prev is not None else None
        w = self.registry.heartbeat(msg, now)
        if w is None:
            # The router restarted or timed the worker out: ask it to register again.
            self.send(
                msg.worker_id,
                RegisterAck(worker_id=msg.worker_id, accepted=False, reason=UNKNOWN_WORKER),
            )
            return
        m, labels = self.metrics, (w.worker_id, w.role)
        m.kv_blocks_free.labels(*labels).set(msg.free_blocks)
        m.kv_blocks_used.labels(*labels).set(msg.total_blocks - msg.free_blocks)
        for field, direction in (("kv_bytes_sent", "sent"), ("kv_bytes_received", "received")):
            m.kv_bytes.labels(*labels, direction).inc(_delta(prev_hb, msg, field))
        m.kv_seconds.labels(*labels).inc(_delta(prev_hb, msg, "kv_transfer_seconds"))

    def _on_tokens(self, msg: TokenEvents, now: float) -> None:
        if not self.registry.touch(msg.worker_id, now):
            self.send(
                msg.worker_id,
                RegisterAck(worker_id=msg.worker_id, accepted=False, reason=UNKNOWN_WORKER),
            )
        for ev in msg.events:
            if not self.tracker.deliver(msg.worker_id, ev):
                log.debug(
                    "event for unknown request %s from %s dropped", ev.request_id, msg.worker_id
                )

    # --- liveness ------------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        period = max(0.02, min(0.25, self.heartbeat_timeout / 4))
        while True:
            await asyncio.sleep(period)
            for w in self.registry.expire(time.monotonic(), self.heartbeat_timeout):
                self.metrics.worker_failures.inc()
                log.error(
                    "worker %s (%s) missed heartbeats for %.1f s: out of rotation",
                    w.worker_id,
                    w.role,
                    self.heartbeat_timeout,
                )
                self._lost(w, f"worker {w.worker_id} ({w.role}) stopped responding")

    def _lost(self, w: WorkerState, message: str, forget: bool = True) -> None:
        n = self.tracker.fail_worker(w.worker_id, message)
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


def _delta(prev: Heartbeat | None, cur: Heartbeat, field: str) -> float:
    """Increase of a cumulative heartbeat counter; a drop means the worker restarted."""
    new = getattr(cur, field)
    old = getattr(prev, field) if prev is not None else 0
    return new - old if new >= old else new
