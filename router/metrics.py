"""The router's Prometheus metrics, on a registry of its own (one per app, so tests can build many).

`pdserve_router_queue_depth` (requests still waiting for their first token) is the metric the
Kubernetes HPA scales prefill workers on. The `pdserve_handoff_*` metrics say what a disaggregated
request's first-to-second token gap cost, and where it went (the decode worker's HandoffTiming).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.protocol.messages import HandoffTiming

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
# A hand-off takes from under a millisecond (shared memory, a short prompt) to seconds (tcp, a long one).
_HANDOFF_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
_HANDOFF_BYTES_BUCKETS = tuple(float(4**k) for k in range(8, 17))  # 64 KiB .. 4 GiB
_PARTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_HANDOFF_PHASES = ("wait", "send", "verify", "load")  # HandoffTiming's fields, in the order they happen

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """Owns one CollectorRegistry; every instrument the router updates lives here."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "pdserve_router_tbt_seconds",
            "Time between consecutive tokens of one request",
            buckets=_TBT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pdserve_router_queue_time_seconds",
            "Arrival at the router until the request is handed to a worker",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "pdserve_router_running_requests",
            "Requests that have their first token and are still generating",
            registry=r,
        )
        self.waiting = Gauge(
            "pdserve_router_waiting_requests", "Requests waiting for their first token", registry=r
        )
        self.queue_depth = Gauge(
            "pdserve_router_queue_depth",
            "Requests waiting for their first token (HPA metric)",
            registry=r,
        )
        self.requests = Counter(
            "pdserve_router_requests_total",
            "Finished HTTP requests by status",
            ["status"],
            registry=r,
        )
        self.bad_messages = Counter(
            "pdserve_router_bad_messages_total",
            "Control-channel frames dropped as malformed",
            registry=r,
        )
        self.workers = Gauge("pdserve_router_workers", "Live workers by role", ["role"], registry=r)
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Requests re-dispatched to other workers (migrations and retries), by cause: a lost worker, "
            "a refused prefill, a failed KV transfer",
            ["cause"], registry=r,
        )
        self.kv_blocks_used = Gauge(
            "pdserve_kv_blocks_used", "KV blocks in use on a worker", ["worker", "role"], registry=r
        )
        self.kv_blocks_free = Gauge(
            "pdserve_kv_blocks_free", "Free KV blocks on a worker", ["worker", "role"], registry=r
        )
        self.kv_cache_resident = Gauge(
            "pdserve_kv_cache_resident",
            "1 once a worker's KV cache is faulted in, 0 while its first writes would still fault pages in",
            ["worker", "role"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdserve_kv_transfer_bytes",
            "KV bytes moved between workers",
            ["worker", "role", "direction"],
            registry=r,
        )
        self.kv_seconds = Counter(
            "pdserve_kv_transfer_seconds",
            "Seconds workers spent moving KV",
            ["worker", "role"],
            registry=r,
        )
        self.stage_busy = Counter(
            "pdserve_stage_busy_seconds",
            "Seconds a worker's pipeline stage computed micro-batches (from its heartbeats)",
            ["worker", "role", "stage"],
            registry=r,
        )
        self.stage_idle = Counter(
            "pdserve_stage_idle_seconds",
            "Seconds a worker's pipeline stage waited: bubbles, and no work (from its heartbeats)",
            ["worker", "role", "stage"],
            registry=r,
        )
        self.handoff_gap = Histogram(
            "pdserve_handoff_gap_seconds",
            "Disaggregated requests: the prefill worker's first token to the decode worker's first, as "
            "the router received them",
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self.handoff_phase = Histogram(
            "pdserve_handoff_phase_seconds",
            "A hand-off's phases as its decode worker measured them: wait (for the prefill to finish), "
            "send, verify, load",
            ["phase"], buckets=_HANDOFF_BUCKETS, registry=r,
        )
        self._phases = [(self.handoff_phase.labels(p), p) for p in _HANDOFF_PHASES]
        self.handoff_bytes = Histogram(
            "pdserve_handoff_bytes", "KV bytes one hand-off carried", buckets=_HANDOFF_BYTES_BUCKETS, registry=r
        )
        self.kv_stream_parts = Histogram(
            "pdserve_kv_stream_parts",
            "Messages one hand-off's KV came in (1: whole, after the prefill ended)",
            buckets=_PARTS_BUCKETS, registry=r,
        )
        self.worker_failures = Counter(
            "pdserve_router_worker_failures_total",
            "Workers taken out of rotation (missed heartbeats)",
            registry=r,
        )

    def request_started(self) -> None:
        self.waiting.inc()
        self.queue_depth.inc()

    def first_token(self) -> None:
        self.waiting.dec()
        self.queue_depth.dec()
        self.running.inc()

    def request_ended(self, had_first_token: bool) -> None:
        if had_first_token:
            self.running.dec()
        else:
            self.waiting.dec()
            self.queue_depth.dec()

    def handoff_done(self, prefill_token_at: float | None, now: float, timing: HandoffTiming | None) -> None:
        """The decode worker's first token of a disaggregated request arrived at `now`; the prefill
        worker's had at `prefill_token_at` (None: this one overtook it on the way, no gap to tell)."""
        if prefill_token_at is not None:
            self.handoff_gap.observe(now - prefill_token_at)
        if timing is not None:
            for child, phase in self._phases:
                child.observe(getattr(timing, phase))
            self.handoff_bytes.observe(timing.nbytes)
            self.kv_stream_parts.observe(timing.parts)

    def forget_worker(self, worker: str, role: str) -> None:
        for gauge in (self.kv_blocks_used, self.kv_blocks_free, self.kv_cache_resident):
            with contextlib.suppress(KeyError):  # never reported a heartbeat
                gauge.remove(worker, role)

    def render(self) -> bytes:
        return generate_latest(self.registry)
