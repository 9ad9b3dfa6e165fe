"""What every worker process shares: registration, probes, the engine loop, drain on SIGTERM.

The loop is `drain inputs -> step -> publish outputs`; sockets live on their own threads
(WorkerLink for the router, the KV transport's I/O thread), so the loop only touches queues.
Subclasses (prefill_node, decode_node) say how work is accepted and what extra I/O to poll.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.engine import Engine, RequestOutput, RequestRejected
from engine.health import HealthServer
from kvtransfer.control import WorkerLink
from kvtransfer.protocol import (
    Abort,
    GenerateRequest,
    Heartbeat,
    ModelFingerprint,
    PrefillRequest,
    Register,
    TokenEvent,
    TokenEvents,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    router_address: str = "tcp://127.0.0.1:5550"
    host: str = "127.0.0.1"  # every socket of the worker binds here
    advertise_host: str | None = None  # what others dial; defaults to host
    kv_port: int = 0
    health_port: int = 0
    kv_transports: tuple[str, ...] = ("tcp",)
    host_id: str = ""
    worker_id: str | None = None
    drain_timeout: float = 20.0
    heartbeat_interval: float = 1.0
    stuck_after: float = 60.0  # seconds without a loop tick before /health fails
    kv_lease: float = 5.0


def error_event(request_id: str, message: str, position: int = -1) -> TokenEvent:
    return TokenEvent(request_id=request_id, token_ids=(), finish_reason="error", error=message, position=position)


class Worker(ABC):
    role = "abstract"

    def __init__(self, options: WorkerOptions, engine: Engine) -> None:
        self.options = options
        self.engine = engine
        self.worker_id = options.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        m = engine.model_config
        self.fingerprint = ModelFingerprint(
            model=engine.model_name, architecture=m.architecture, num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=engine.config.dtype,
            block_size=engine.config.block_size,
        )
        self.host_id = options.host_id or socket.gethostname()
        self.advertise_host = options.advertise_host or options.host
        self.kv_bytes_sent = 0
        self.kv_bytes_received = 0
        self.kv_transfer_seconds = 0.0
        self._pending_events: list[TokenEvent] = []
        self._stop = threading.Event()
        self._draining = False
        self._last_tick = time.monotonic()
        self._load = (engine.pool.num_available, 0, 0, 0)
        self.health = HealthServer(options.host, options.health_port, self._live, self._ready, self.info)
        self.link: WorkerLink | None = None

    # --- subclass hooks --------------------------------------------------------------------
    @abstractmethod
    def kv_address(self) -> str:
        """Where this worker's KV channel listens ('' for none)."""

    @abstractmethod
    def accept(self, work: PrefillRequest | GenerateRequest) -> None:
        """Take new work from the router; raise RequestRejected for bad input."""

    def poll_io(self) -> None:
        """Non-blocking transport work once per loop turn."""

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def after_step(self) -> None:
        """Runs after each engine step's events are published."""

    def abort(self, request_ids: tuple[str, ...]) -> None:
        self.engine.abort(request_ids)

    def close_io(self) -> None:
        """Close transports."""

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> Worker:
        self.health.start()
        reg = Register(
            worker_id=self.worker_id, role=self.role, kv_address=self.kv_address(),  # type: ignore[arg-type]
            health_address=self.health.address, fingerprint=self.fingerprint,
            num_blocks=self.engine.pool.num_blocks, max_model_len=self.engine.max_model_len,
            kv_transports=self.options.kv_transports, host_id=self.host_id,
        )
        self.link = WorkerLink(self.options.router_address, reg, self._heartbeat, self.options.heartbeat_interval).start()
        log.info("%s %s: health %s, kv %r, router %s", self.role, self.worker_id, self.health.address,
                 self.kv_address(), self.options.router_address)
        return self

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.drain())
        signal.signal(signal.SIGINT, lambda *_: self.drain())

    def drain(self) -> None:
        """Stop taking work, finish what is in flight (up to drain_timeout), then exit the loop."""
        if not self._draining:
            log.info("%s %s: draining", self.role, self.worker_id)
        self._draining = True

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """The engine loop; returns after a drain or stop()."""
        assert self.link is not None, "start() first"
        drain_deadline = None
        while not self._stop.is_set():
            for work in self.link.poll():
                self._handle(work)
            self.poll_io()
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception:  # a bug must cost the requests in flight, not the worker
                    log.exception("%s %s: engine step failed; failing the running requests", self.role, self.worker_id)
                    self._fail_running("internal error in the engine step")
                    outputs = []
                self._publish(outputs)
                self.after_step()
            else:
                time.sleep(0.0005)
            self._flush()
            self._tick()
            if self._draining:
                drain_deadline = drain_deadline or time.monotonic() + self.options.drain_timeout
                if not self.busy():
                    break
                if time.monotonic() > drain_deadline:
                    self._fail_all("worker shut down before the request finished")
                    break
        self._flush()
        self.close()

    def close(self) -> None:
        self.close_io()
        if self.link is not None:
            self.link.close()
        self.health.close()

    # --- internals -------------------------------------------------------------------------
    def _handle(self, work) -> None:
        if isinstance(work, Abort):
            self.abort(work.request_ids)
            return
        if self._draining:
            self.emit(error_event(work.request_id, "worker is draining; retry"))
            return
        try:
            self.accept(work)
        except RequestRejected as exc:
            log.info("request %s rejected: %s", work.request_id, exc)
            self.emit(error_event(work.request_id, f"{exc.param}: {exc}"))
        except ValueError as exc:  # e.g. a duplicate request id
            log.warning("request %s rejected: %s", work.request_id, exc)
            self.emit(error_event(work.request_id, str(exc)))

    def emit(self, event: TokenEvent) -> None:
        self._pending_events.append(event)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self.emit(TokenEvent(
                request_id=o.request_id, token_ids=tuple(o.new_token_ids),
                logprobs=tuple(o.logprobs) if o.logprobs else None,
                top_logprobs=tuple(o.top_logprobs) if o.top_logprobs else None,
                finish_reason=o.finish_reason, error=o.error,  # type: ignore[arg-type]
                num_prompt_tokens=o.num_prompt_tokens, num_cached_tokens=o.num_cached_tokens,
                position=o.position,
            ))

    def _flush(self) -> None:
        if self._pending_events and self.link is not None:
            self.link.send_events(TokenEvents(worker_id=self.worker_id, events=tuple(self._pending_events)))
            self._pending_events = []

    def _fail_running(self, message: str) -> None:
        ids = [r.request_id for r in self.engine.scheduler.running]
        self.engine.abort(ids)
        for rid in ids:
            self.emit(error_event(rid, message))

    def _fail_all(self, message: str) -> None:
        ids = list(self.engine.scheduler.requests)
        self.engine.abort(ids)
        for rid in ids:
            self.emit(error_event(rid, message))

    def _tick(self) -> None:
        self._last_tick = time.monotonic()
        s = self.engine.scheduler
        self._load = (self.engine.pool.num_available, s.num_waiting_tokens, len(s.running), len(s.waiting))

    def _heartbeat(self) -> Heartbeat:
        free, queued, running, waiting = self._load
        return Heartbeat(
            worker_id=self.worker_id, free_blocks=free, total_blocks=self.engine.pool.num_blocks,
            queued_prefill_tokens=queued, running=running, waiting=waiting, draining=self._draining,
            kv_bytes_sent=self.kv_bytes_sent, kv_bytes_received=self.kv_bytes_received,
            kv_transfer_seconds=self.kv_transfer_seconds,
        )

    def _live(self) -> bool:
        return time.monotonic() - self._last_tick < self.options.stuck_after

    def _ready(self) -> bool:
        return self.link is not None and self.link.registered and not self._draining

    def info(self) -> dict:
        c = self.engine.counters
        return {
            "worker_id": self.worker_id, "role": self.role, "steps": c.steps,
            "prefill_tokens": c.prefill_tokens, "decode_tokens": c.decode_tokens,
            "steps_with_prefill": c.steps_with_prefill, "preemptions": c.preemptions,
            "free_blocks": self.engine.pool.num_free, "cached_blocks": self.engine.pool.num_cached,
            "used_blocks": self.engine.pool.num_used, "total_blocks": self.engine.pool.num_blocks,
            "running": self._load[2], "waiting": self._load[3],
            "kv_bytes_sent": self.kv_bytes_sent, "kv_bytes_received": self.kv_bytes_received,
        }
