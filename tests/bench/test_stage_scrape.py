"""Bubble fractions of a served run from the router's stage counters before and after it."""

from __future__ import annotations

from pdserve.bench.report import format_summary
from pdserve.bench.stage_scrape import bubble_fractions, stage_seconds

PAGE = """# TYPE pdserve_stage_busy_seconds counter
pdserve_stage_busy_seconds_total{{role="decode",stage="0",worker="decode-0"}} {b0}
pdserve_stage_busy_seconds_total{{role="decode",stage="1",worker="decode-0"}} {b1}
# TYPE pdserve_stage_idle_seconds counter
pdserve_stage_idle_seconds_total{{role="decode",stage="0",worker="decode-0"}} {i0}
pdserve_stage_idle_seconds_total{{role="decode",stage="1",worker="decode-0"}} {i1}
# TYPE pdserve_requests_total counter
pdserve_requests_total 3.0
"""


def test_bubbles_over_the_run_from_two_scrapes():
    before = stage_seconds(PAGE.format(b0=1.0, b1=2.0, i0=9.0, i1=8.0))
    after = stage_seconds(PAGE.format(b0=7.0, b1=5.0, i0=11.0, i1=13.0))  # 8 s of run: 6+2 and 3+5
    assert before[("decode-0", 1)] == {"busy": 2.0, "idle": 8.0}
    assert bubble_fractions(before, after) == {"decode-0": [0.25, 0.625]}
    assert bubble_fractions({}, {}) == {}


def test_the_summary_shows_them():
    summary = {k: 0 for k in ("completed", "failed", "num_warmup", "duration", "total_input_tokens",
                              "total_output_tokens", "request_throughput", "output_throughput",
                              "total_token_throughput")}
    for key in ("ttft", "ttft_intended", "tpot", "tbt", "itl", "e2el", "send_lag"):
        summary |= {f"{stat}_{key}_ms": 1.0 for stat in ("mean", "median", "p90", "p99", "max")}
    summary["bubble_fraction"] = {"decode-0": [0.25, 0.625]}
    assert "decode-0:" in format_summary(summary) and "0.25 / 0.62" in format_summary(summary)
