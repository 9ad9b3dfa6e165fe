"""A worker's /metrics: the pipeline stages' counters, as Prometheus reads them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.stage_timeline import Interval, StageTimeline
from pdserve.worker.stage_metrics import worker_metrics


def samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_stage_metrics_read_the_timeline_at_each_scrape():
    now = [4.0]
    t = StageTimeline(2, since=0.0, clock=lambda: now[0])
    t.record(Interval(0, 1, 0.0, 1.0))
    t.record(Interval(1, 1, 1.0, 3.0))
    scrape = worker_metrics(t, "decode-0")
    got = samples(scrape())
    labels = lambda stage, **kw: tuple(sorted({"worker": "decode-0", "stage": str(stage), **kw}.items()))  # noqa: E731
    assert got[("pdserve_stage_busy_seconds_total", labels(1))] == 2.0
    assert got[("pdserve_stage_idle_seconds_total", labels(0))] == 3.0
    assert got[("pdserve_stage_bubble_fraction", labels(1, window="life"))] == 0.5
    now[0] = 8.0  # idle time grows between scrapes
    assert samples(scrape())[("pdserve_stage_idle_seconds_total", labels(1))] == 6.0


def test_no_stages_no_stage_metrics():
    assert b"pdserve_stage" not in worker_metrics(None, "w")()
