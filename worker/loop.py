"""What every worker process shares: registration, probes, the engine loop, drain on SIGTERM.

The loop is `drain inputs -> step -> publish outputs -> save KV`; sockets live on their own
threads (RouterLinks' WorkerLink per router, the KV transport's I/O thread), so the loop only
touches queues and the engine's public methods. Every request belongs to the router that gave it
(worker/routes.py): its tokens go there, and only that router's Abort or Fence drops it. Subclasses (prefill_node/, decode_node/,
worker/colocated.py) say how work is accepted and what extra I/O to poll.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from abc import ABC, abstractmethod

from pdserve.config.engine import EngineConfig
from pdserve.config.log_limits import RateLimitedLog
from pdserve.config.router_address import parse_router_addresses
from pdserve.config.worker import WorkerOptions
from pdserve.engine.engine import Engine, EngineLoad, RequestOutput, RequestRejected
from pdserve.engine.pipeline import PipelineBroken
from pdserve.model.config import resolve_dtype
from pdserve.model.weights import LoadedModel
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    HandoffTiming,
    Heartbeat,
    ModelFingerprint,
    PrefillRequest,
    Register,
    RetryCause,
    TokenEvent,
    TokenEvents,
)
from pdserve.worker.handoff_metrics import HandoffMetrics
from pdserve.worker.health import HealthServer
from pdserve.worker.router_link import Fence
from pdserve.worker.router_links import RouterLinks
from pdserve.worker.stage_metrics import worker_metrics
from pdserve.worker.tracing import NO_SPANS, NoSpans, worker_spans

log = logging.getLogger(__name__)

ROUTES_SWEEP_SECONDS = 1.0  # how often the routes of finished requests are forgotten
IDLE_SLEEP_S = 0.0005  # a loop with nothing to run sleeps this long before polling again
# A loop with no request at all, once it has had none for IDLE_EMPTY_AFTER_S, sleeps longer: at
# 0.5 ms an idle worker would wake 2,000 times a second, 6-7% of a core each for the two workers
# of an idle `pdserve up` on 2 cores (their CPU time over 30 idle seconds). New work costs no wait:
# the router links and the KV receiver set `Worker.wake` when something lands, and the sleep ends
# there. What nothing wakes for (a held transfer's ack, a drain) is polled at the next turn, so
# requests that wait on something outside the loop keep the short sleep.
IDLE_EMPTY_SLEEP_S = 0.005
IDLE_EMPTY_AFTER_S = 0.05


def idle_sleep(empty_for: float | None) -> float:
    """How long an idle loop sleeps before polling again: `empty_for` is how long it has held no
    request at all (None: it holds requests, all waiting on something outside the loop)."""
    return IDLE_EMPTY_SLEEP_S if empty_for is not None and empty_for >= IDLE_EMPTY_AFTER_S else IDLE_SLEEP_S


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def model_fingerprint(engine_config: EngineConfig, loaded: LoadedModel) -> ModelFingerprint:
    """What must match between two workers for KV built by one to be valid on the other."""
    m = loaded.config
    return ModelFingerprint(
        model=loaded.name, architecture=m.architecture, num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=resolve_dtype(engine_config.dtype, engine_config.device),
        block_size=engine_config.block_size,
    )


def error_event(request_id: str, message: str, position: int = -1, retry: RetryCause = "") -> TokenEvent:
    return TokenEvent(request_id=request_id, token_ids=(), finish_reason="error", error=message, position=position,
                      retry=retry)


class Worker(ABC):
    role = "abstract"

    def __init__(self, options: WorkerOptions, engine: Engine, fingerprint: ModelFingerprint) -> None:
        self.options = options
        self.engine = engine
        self.worker_id = options.worker_id or default_worker_id(self.role)
        self.fingerprint = fingerprint
        self.host_id = options.host_id or socket.gethostname()
        self.advertise_host = options.advertise_host or options.host
        self._pending_events: list[TokenEvent] = []
        # A decode worker's loaded hand-offs: each rides the request's next token event.
        self.handoff_timings: dict[str, HandoffTiming] = {}
        self._log_failure = RateLimitedLog(log, logging.ERROR, per_seconds=10.0)
        self._stop = threading.Event()
        # Set by an I/O thread that queued something for the loop (work from a router, a decode
        # worker's KV): an idle loop waits on it rather than sleeping, so it picks either up as it
        # arrives.
        self.wake = threading.Event()
        self._draining = False
        self._last_tick = time.monotonic()
        self._load: EngineLoad = engine.load()
        timeline = engine.pipeline.timeline if engine.pipeline is not None else None
        self.handoff_metrics = HandoffMetrics(self.worker_id)  # observed by a worker that takes KV in
        self.health = HealthServer(options.host, options.health_port, self._live, self._ready, self.info,
                                   worker_metrics(timeline, self.worker_id, self.handoff_metrics))
        self.links = RouterLinks(parse_router_addresses(options.router_address), self._heartbeat,
                                 options.heartbeat_interval, auth=FrameAuth.from_secret(options.secret),
                                 resolve_interval=options.router_resolve_interval, on_ready=self.wake.set)
        self._started = False
        self._next_sweep = 0.0
        self.spans: NoSpans = NO_SPANS  # request spans (worker/tracing.py), set at start()

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

    def held_request_ids(self) -> set[str]:
        """Every request this worker may still emit an event for (the rest lose their route)."""
        return set(self.engine.request_ids())

    def after_step(self) -> None:
        """Runs after each engine step's events are published and its KV saved."""

    def kv_counters(self) -> tuple[int, int, float]:
        """Bytes of KV sent, bytes received, seconds spent sending (cumulative)."""
        return 0, 0, 0.0

    def abort(self, request_ids: tuple[str, ...]) -> None:
        self.engine.abort(request_ids)

    def close_io(self) -> None:
        """Close transports."""

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> Worker:
        self.spans = worker_spans(self.worker_id)  # after tracing's setup, before any work
        self.health.start()
        reg = Register(
            worker_id=self.worker_id, role=self.role, kv_address=self.kv_address(),  # type: ignore[arg-type]
            fingerprint=self.fingerprint, num_blocks=self._load.total_blocks,
            max_model_len=self.engine.max_model_len,
            kv_transports=self.options.kv_transports, host_id=self.host_id,
        )
        self.links.start(reg)
        self._started = True
        log.info("%s %s: health %s, kv %r, routers %s", self.role, self.worker_id, self.health.address,
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
        """The engine loop; returns after a drain or stop(). A dead pipeline stage closes the
        worker (its Goodbye has the router migrate its requests: none fails) and raises
        PipelineBroken."""
        try:
            self._loop()
        except PipelineBroken as exc:
            log.error("%s %s: %s; closing the worker (its requests migrate)", self.role, self.worker_id, exc)
            self.close()
            raise

    def _loop(self) -> None:
        assert self._started, "start() first"
        drain_deadline = None
        empty_since: float | None = None  # since when the loop has held no request at all
        while not self._stop.is_set():
            # A dead pipeline stage takes the worker down: the router migrates its requests, and
            # `pdserve up` (or Kubernetes) restarts the whole worker.
            self.engine.check()
            for work in self.links.poll():
                self._accept_safely(work)
            self._guarded("transport poll", self.poll_io)
            self._guarded("block reclaim", self.engine.reclaim)
            idle = not self.engine.has_unfinished()  # here: no request at all
            if idle and empty_since is None:
                empty_since = time.monotonic()
            if not idle:
                empty_since = None
                step_started = time.time_ns()
                try:
                    outputs = self.engine.step()
                except PipelineBroken:
                    raise
                except Exception:  # a bug must cost the requests in flight, not the worker
                    log.exception("%s %s: engine step failed; failing the running requests", self.role, self.worker_id)
                    self._fail_running("internal error in the engine step")
                    outputs = []
                self._publish(outputs)
                self.spans.stepped(step_started, outputs)  # before save_kv: the KV carries its span
                # The step's tokens leave before its KV is saved: a first token never waits on
                # its transfer.
                self._flush()
                self._guarded("KV save", self.engine.save_kv)
                self._guarded("post-step I/O", self.after_step)
                # Requests that wait on something outside this loop (KV still arriving, KV held
                # for a transfer) leave nothing to run: spinning would take the other worker's core.
                idle = not outputs and not self.engine.last_step_ran
            if idle:
                self.wake.wait(idle_sleep(None if empty_since is None else time.monotonic() - empty_since))
                self.wake.clear()  # what set it is polled next, at the top of the loop
            self._flush()
            self._tick()
            if self._draining:
                drain_deadline = drain_deadline or time.monotonic() + self.options.drain_timeout
                if not self.busy():
                    break
                if time.monotonic() > drain_deadline:  # the router moves what is left elsewhere
                    self._fail_all("worker shut down before the request finished", retry="stopped")
                    break
        self._flush()
        self.close()

    def close(self) -> None:
        self.spans.clear("worker stopped")
        self.close_io()
        self.links.close()
        self.health.close()
        self.engine.close()

    # --- internals -------------------------------------------------------------------------
    def _accept_safely(self, work) -> None:
        """One bad message costs its own request, never the worker or the other requests."""
        try:
            self._handle(work)
        except Exception as exc:
            rid = getattr(work, "request_id", None)
            self._log_failure("%s %s: %s failed on request %s: %r", self.role, self.worker_id,
                              type(work).__name__, rid, exc, key="accept")
            if rid is not None:
                with contextlib.suppress(Exception):
                    self.engine.abort([rid])
                self.emit(error_event(rid, "internal error accepting the request"))

    def _guarded(self, what: str, hook) -> None:
        """Run one of the loop's I/O hooks; a bug in it is logged (rate-limited), not fatal.
        The hooks isolate errors per request themselves; this is the last line."""
        try:
            hook()
        except Exception as exc:
            self._log_failure("%s %s: %s failed: %r", self.role, self.worker_id, what, exc, key=what)

    def fence(self, fence: Fence) -> None:
        """Drop one router's requests: that router is gone (or was replaced); the others' stay."""
        if fence.request_ids:
            log.warning("%s %s: fence of router %s (%s): aborting its %d requests: %s", self.role, self.worker_id,
                        fence.router, fence.reason, len(fence.request_ids), ",".join(fence.request_ids[:8]))
        else:  # e.g. a router's first epoch
            log.debug("%s %s: fence of router %s (%s): it held no requests", self.role, self.worker_id,
                      fence.router, fence.reason)
        self.abort(fence.request_ids)
        self.spans.aborted(fence.request_ids, f"fenced: {fence.reason}")

    def _handle(self, work) -> None:
        if isinstance(work, Fence):
            self.fence(work)
            return
        if isinstance(work, Abort):
            self.abort(work.request_ids)
            self.spans.aborted(work.request_ids)
            return
        # A refusal is this worker's (its limits, its state): the router may send the work elsewhere.
        if self._draining:
            self.emit(error_event(work.request_id, "worker is draining; retry", retry="refused"))
            return
        try:
            self.accept(work)
        except RequestRejected as exc:
            log.info("request %s rejected: %s", work.request_id, exc)
            self.emit(error_event(work.request_id, f"{exc.param}: {exc}", retry="refused"))
        except ValueError as exc:  # e.g. a duplicate request id
            log.warning("request %s rejected: %s", work.request_id, exc)
            self.emit(error_event(work.request_id, str(exc), retry="refused"))

    def emit(self, event: TokenEvent) -> None:
        self._pending_events.append(event)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            handoff = self.handoff_timings.pop(o.request_id, None) if self.handoff_timings else None
            if handoff is not None:
                self.handoff_metrics.observe(handoff)
            self.emit(TokenEvent(
                request_id=o.request_id, token_ids=tuple(o.new_token_ids),
                logprobs=tuple(o.logprobs) if o.logprobs else None,
                top_logprobs=tuple(o.top_logprobs) if o.top_logprobs else None,
                finish_reason=o.finish_reason, error=o.error,  # type: ignore[arg-type]
                num_prompt_tokens=o.num_prompt_tokens, num_cached_tokens=o.num_cached_tokens,
                position=o.position, retry=o.retry,  # type: ignore[arg-type]
                handoff=handoff,
            ))

    def _flush(self) -> None:
        if self._pending_events:
            self.links.send_events(TokenEvents(worker_id=self.worker_id, events=tuple(self._pending_events)))
            self._pending_events = []

    def _fail_running(self, message: str) -> None:
        ids = self.engine.request_ids(running_only=True)
        self.engine.abort(ids)
        self.spans.aborted(ids, message)
        for rid in ids:
            self.emit(error_event(rid, message))

    def _fail_all(self, message: str, retry: RetryCause = "") -> None:
        ids = self.engine.request_ids()
        self.engine.abort(ids)
        self.spans.aborted(ids, message)
        for rid in ids:
            self.emit(error_event(rid, message, retry=retry))

    def _tick(self) -> None:
        self._last_tick = now = time.monotonic()
        self._load = self.engine.load()
        if now >= self._next_sweep:  # after the turn's flush: no event of a dropped route is pending
            self._next_sweep = now + ROUTES_SWEEP_SECONDS
            self.links.retain(self.held_request_ids())

    def _heartbeat(self) -> Heartbeat:
        load = self._load
        sent, received, seconds = self.kv_counters()
        pipe = self.engine.pipeline
        busy, idle = (tuple(pipe.timeline.busy), tuple(pipe.timeline.idle())) if pipe is not None else ((), ())
        return Heartbeat(
            worker_id=self.worker_id, free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            queued_prefill_tokens=load.queued_prefill_tokens, running=load.running, waiting=load.waiting,
            draining=self._draining, kv_resident=load.kv_resident, kv_bytes_sent=sent, kv_bytes_received=received, kv_transfer_seconds=seconds,
            stage_busy_seconds=busy, stage_idle_seconds=idle,
        )

    def _live(self) -> bool:
        return time.monotonic() - self._last_tick < self.options.stuck_after

    def _ready(self) -> bool:
        return self._started and self.links.alive and self.links.registered and not self._draining

    def info(self) -> dict:
        c = self.engine.counters
        sent, received, _ = self.kv_counters()
        return {
            "worker_id": self.worker_id, "role": self.role, "steps": c.steps,
            "prefill_tokens": c.prefill_tokens, "decode_tokens": c.decode_tokens,
            "steps_with_prefill": c.steps_with_prefill, "preemptions": c.preemptions,
            **self.engine.cache_stats(), "running": self._load.running, "waiting": self._load.waiting,
            "kv_bytes_sent": sent, "kv_bytes_received": received, "routers": self.links.describe(),
            **({"pipeline": stages} if (stages := self.engine.stage_stats()) is not None else {}),
        }
