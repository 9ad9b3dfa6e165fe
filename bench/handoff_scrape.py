"""Where the hand-offs of a served run went, from the router's /metrics: the count and sum of the
hand-off gap (`pdserve_handoff_gap_seconds`) and of each phase (`pdserve_handoff_phase_seconds`)
before and after the run give each one's mean over the run's hand-offs.

Means, not medians read off the buckets, because means add up: the phases' means sum to the gap's
less the first decode step and the two workers' different ways to the router. A server without
these metrics (not pdserve) or without hand-offs (colocated) gives none.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# histogram -> its series in the split (the phase histogram: one per `phase` label)
SERIES = {"pdserve_handoff_gap_seconds": "gap", "pdserve_handoff_phase_seconds": "",
          "pdserve_handoff_bytes": "kv_bytes", "pdserve_kv_stream_parts": "parts"}
# series -> (summary key of its mean, scale of its unit)
MEANS = {"gap": ("mean_gap_ms", 1e3), "wait": ("mean_wait_ms", 1e3), "send": ("mean_send_ms", 1e3),
         "verify": ("mean_verify_ms", 1e3), "load": ("mean_load_ms", 1e3), "kv_bytes": ("mean_kv_bytes", 1.0),
         "parts": ("mean_parts", 1.0)}

Moments = dict[str, tuple[float, float]]  # series -> (count, sum)


def handoff_moments(text: str) -> Moments:
    """Each hand-off series' (count, sum) on a Prometheus text page (none where it has none)."""
    count: dict[str, float] = {}
    total: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        series = SERIES.get(family.name)
        if series is None:
            continue
        for sample in family.samples:
            key = series or sample.labels.get("phase", "")
            if sample.name.endswith("_count"):
                count[key] = sample.value
            elif sample.name.endswith("_sum"):
                total[key] = sample.value
    return {k: (n, total.get(k, 0.0)) for k, n in count.items()}


def handoff_split(before: Moments, after: Moments) -> dict[str, float]:
    """The means of the hand-offs between two scrapes (times in ms), and how many were timed:
    `handoffs` with a gap, `timed_handoffs` with phases. {} when there were none."""
    out: dict[str, float] = {}
    counts: dict[str, float] = {}
    for series, (key, scale) in MEANS.items():
        n_after, sum_after = after.get(series, (0.0, 0.0))
        n_before, sum_before = before.get(series, (0.0, 0.0))
        if n_after > n_before:
            counts[series] = n_after - n_before
            out[key] = (sum_after - sum_before) / counts[series] * scale
    if out:
        out["handoffs"] = int(counts.get("gap", 0))
        out["timed_handoffs"] = int(counts.get("wait", 0))
    return out
