"""Pipeline bubbles of a served run, from the router's /metrics: each worker stage's busy and idle
seconds (its heartbeats) before and after the run give idle / (busy + idle) over the run. A server
without them (no stages, or not pdserve) gives none."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

HEARTBEAT_WAIT_S = 1.5  # a worker's heartbeat interval (1 s by default) and some
STAGE_METRICS = {"pdserve_stage_busy_seconds_total": "busy", "pdserve_stage_idle_seconds_total": "idle"}


def stage_seconds(text: str) -> dict[tuple[str, int], dict[str, float]]:
    """(worker, stage) -> {"busy": s, "idle": s} from a Prometheus text page."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = STAGE_METRICS.get(sample.name)
            if kind is not None:
                key = (sample.labels.get("worker", ""), int(sample.labels.get("stage", "0")))
                out.setdefault(key, {})[kind] = sample.value
    return out


def metrics_page(base_url: str) -> str:
    """A server's /metrics now ("" where it has none)."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=5)
    except httpx.HTTPError:
        return ""
    return r.text if r.status_code == 200 else ""


def bubble_fractions(before: dict, after: dict) -> dict[str, list[float]]:
    """worker -> each stage's idle / (busy + idle) between two scrapes."""
    out: dict[str, dict[int, float]] = {}
    for (worker, stage), now in after.items():
        then = before.get((worker, stage), {})
        busy = now.get("busy", 0.0) - then.get("busy", 0.0)
        idle = now.get("idle", 0.0) - then.get("idle", 0.0)
        if busy + idle > 0:
            out.setdefault(worker, {})[stage] = idle / (busy + idle)
    return {w: [round(stages[k], 4) for k in sorted(stages)] for w, stages in sorted(out.items())}
