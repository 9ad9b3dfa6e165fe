"""A worker's Prometheus metrics (its health port's /metrics): the pipeline stages' busy and idle
seconds and bubble fractions, read from the engine's StageTimeline at each scrape, and the KV
hand-offs it took in (worker/handoff_metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.stage_timeline import RECENT_SECONDS, StageTimeline
from pdserve.worker.handoff_metrics import HandoffMetrics


class StageCollector(Collector):
    def __init__(self, timeline: StageTimeline, worker_id: str) -> None:
        self.timeline = timeline
        self.worker_id = worker_id

    def collect(self) -> Iterator[Metric]:
        t = self.timeline
        now = t.clock()
        busy = CounterMetricFamily("pdserve_stage_busy_seconds", "seconds a pipeline stage computed micro-batches",
                                   labels=["worker", "stage"])
        idle = CounterMetricFamily("pdserve_stage_idle_seconds", "seconds a pipeline stage waited (bubbles and "
                                   "no work)", labels=["worker", "stage"])
        bubbles = GaugeMetricFamily("pdserve_stage_bubble_fraction", "idle / wall of a pipeline stage, over the "
                                    "worker's life and over the last minute", labels=["worker", "stage", "window"])
        life, recent = t.bubble_fraction(now), t.bubble_fraction(now, RECENT_SECONDS)
        for stage, (b, i) in enumerate(zip(list(t.busy), t.idle(now), strict=True)):
            labels = [self.worker_id, str(stage)]
            busy.add_metric(labels, b)
            idle.add_metric(labels, i)
            bubbles.add_metric([*labels, "life"], life[stage])
            bubbles.add_metric([*labels, "1m"], recent[stage])
        yield from (busy, idle, bubbles)


def worker_metrics(timeline: StageTimeline | None, worker_id: str,
                   handoffs: HandoffMetrics | None = None) -> Callable[[], bytes]:
    """What /metrics answers: the stages' metrics (none without stages) and the hand-offs'."""
    registry = CollectorRegistry()
    if timeline is not None:
        registry.register(StageCollector(timeline, worker_id))
    if handoffs is not None:
        registry.register(handoffs)
    return lambda: generate_latest(registry)
