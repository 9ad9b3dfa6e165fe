"""The KV hand-offs a worker took in, on its health port's /metrics: each one's phases as the
decode worker measured them (HandoffTiming), its bytes and the parts its KV came in. The router's
/metrics has the same over every decode worker, with the first-to-second token gap beside them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pdserve.protocol.messages import HandoffTiming

# As the router's (router/metrics.py): under a millisecond (shared memory, a short prompt) to seconds.
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
BYTES_BUCKETS = tuple(float(4**k) for k in range(8, 17))  # 64 KiB .. 4 GiB
PARTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PHASES = ("wait", "send", "verify", "load")  # HandoffTiming's fields, in the order they happen


class HandoffMetrics(Collector):
    """One worker's hand-off histograms. `observe` runs on the engine loop, `collect` on the
    health server's thread (prometheus_client's instruments are thread-safe). A worker that never
    observes a hand-off exports the families without samples."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.phase = Histogram("pdserve_handoff_phase_seconds", "A hand-off's phases: wait (for the prefill "
                               "to finish), send, verify, load", ["worker", "phase"], buckets=BUCKETS,
                               registry=None)
        self.nbytes = Histogram("pdserve_handoff_bytes", "KV bytes one hand-off carried", ["worker"],
                                buckets=BYTES_BUCKETS, registry=None)
        self.parts = Histogram("pdserve_kv_stream_parts", "Messages one hand-off's KV came in (1: whole, after "
                               "the prefill ended)", ["worker"], buckets=PARTS_BUCKETS, registry=None)

    def observe(self, timing: HandoffTiming) -> None:
        """Record one hand-off: call it once per request, when its first token leaves."""
        for phase in PHASES:
            self.phase.labels(self.worker_id, phase).observe(getattr(timing, phase))
        self.nbytes.labels(self.worker_id).observe(timing.nbytes)
        self.parts.labels(self.worker_id).observe(timing.parts)

    def collect(self) -> Iterator[Metric]:
        for histogram in (self.phase, self.nbytes, self.parts):
            yield from histogram.collect()
