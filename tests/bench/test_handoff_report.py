"""`pdserve bench` and the hand-off: the client's first-to-second token interval beside TTFT and
TBT, and the router's split of the hand-off (means over the run, from its /metrics)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench.cli import main
from pdserve.bench.handoff_scrape import handoff_moments, handoff_split
from pdserve.bench.metrics import SLO, RequestRecord, RunInfo, first_to_second_s, summarize
from pdserve.bench.report import format_summary
from pdserve.protocol.messages import HandoffTiming
from pdserve.router.metrics import RouterMetrics
from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)


def record(chunk_times: list[float], chunk_tokens: list[int] | None = None) -> RequestRecord:
    tokens = chunk_tokens or [1] * len(chunk_times)
    return RequestRecord(request_id="r", sent_s=0.0, end_s=chunk_times[-1], chunk_times=chunk_times,
                         chunk_tokens=tokens, output_tokens=sum(tokens), success=True)


def test_first_to_second_is_when_the_second_token_came_after_the_first():
    assert first_to_second_s([0.1, 0.15, 0.3], [1, 1, 1]) == pytest.approx(0.05)
    assert first_to_second_s([0.1, 0.3], [1, 3]) == pytest.approx(0.2)  # unsplit: token 2 came at 0.3
    assert first_to_second_s([0.1, 0.2], [2, 1]) == 0.0  # the first chunk carried both
    assert first_to_second_s([0.1], [1]) is None


def test_the_summary_has_its_percentiles_beside_ttft_and_tbt():
    gaps_ms = [10.0, 20.0, 30.0, 40.0, 100.0]
    records = [record([0.5, 0.5 + g / 1e3, 0.5 + g / 1e3 + 0.01]) for g in gaps_ms]
    s = summarize(records, RunInfo(duration_s=1.0), SLO())
    assert s["median_first_to_second_ms"] == pytest.approx(30.0)
    assert s["p50_first_to_second_ms"] == pytest.approx(30.0)
    assert s["p99_first_to_second_ms"] == pytest.approx(float(np.percentile(gaps_ms, 99)))  # 97.6
    assert s["median_ttft_ms"] == pytest.approx(500.0)
    table = format_summary(s)
    assert table.index("TBT (ms)") < table.index("P99 1st->2nd (ms):") < table.index("ITL (ms)")


def hand_off(m: RouterMetrics, gap: float, timing: HandoffTiming) -> None:
    m.handoff_done(100.0, 100.0 + gap, timing)


def test_the_split_is_each_phases_mean_over_the_run_only():
    m = RouterMetrics()
    hand_off(m, 5.0, HandoffTiming(wait=1.0, send=1.0, verify=1.0, load=1.0, nbytes=1, parts=9))  # before the run
    before = handoff_moments(m.render().decode())
    hand_off(m, 0.010, HandoffTiming(wait=0.001, send=0.004, verify=0.0005, load=0.002, nbytes=1 << 20, parts=1))
    hand_off(m, 0.030, HandoffTiming(wait=0.003, send=0.012, verify=0.0015, load=0.006, nbytes=3 << 20, parts=3))
    split = handoff_split(before, handoff_moments(m.render().decode()))
    assert split == pytest.approx({"mean_gap_ms": 20.0, "mean_wait_ms": 2.0, "mean_send_ms": 8.0,
                                   "mean_verify_ms": 1.0, "mean_load_ms": 4.0, "mean_kv_bytes": 2 << 20,
                                   "mean_parts": 2.0, "handoffs": 2, "timed_handoffs": 2})
    lines = format_summary(minimal_summary() | {"handoff_split": split}).splitlines()
    assert any(line.startswith("  send (ms):") and line.endswith("8.00") for line in lines)
    assert any(line.startswith("KV per hand-off (MiB):") and line.endswith("2.00") for line in lines)


def test_no_hand_off_metrics_or_no_hand_offs_give_no_split():
    vllm_page = "# TYPE vllm:time_to_first_token_seconds histogram\nvllm:time_to_first_token_seconds_count 3.0\n"
    assert handoff_split(handoff_moments(""), handoff_moments(vllm_page)) == {}
    colocated = RouterMetrics().render().decode()
    assert handoff_split(handoff_moments(colocated), handoff_moments(colocated)) == {}
    assert "Hand-offs" not in format_summary(minimal_summary())


def test_a_run_against_a_disaggregated_router_reports_the_gap_both_ways(tmp_path, capsys):
    with RouterHarness() as h:
        h.worker("prefill-0", "prefill")
        h.worker("decode-0", "decode", delay=0.1)  # its first token 0.1 s after the KV, each next 0.1 s on
        code = main(["run", "--base-url", h.base_url, "--num-requests", "4", "--input-len", "8", "--output-len",
                     "3", "--range-ratio", "0", "--no-progress", "--no-plots", "--output-dir", str(tmp_path)])
    assert code == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["completed"] == 4
    assert 90 < s["median_first_to_second_ms"] < 2000
    assert s["handoff_split"]["handoffs"] == 4 and 90 < s["handoff_split"]["mean_gap_ms"] < 2000
    out = capsys.readouterr().out
    assert "Median 1st->2nd (ms):" in out and "Gap, first -> second token (ms):" in out


def minimal_summary() -> dict:
    s: dict = {k: 0 for k in ("completed", "failed", "num_warmup", "duration", "total_input_tokens",
                              "total_output_tokens", "request_throughput", "output_throughput",
                              "total_token_throughput")}
    for key in ("ttft", "ttft_intended", "tpot", "tbt", "itl", "e2el", "send_lag"):
        s |= {f"{stat}_{key}_ms": 1.0 for stat in ("mean", "median", "p90", "p99", "max")}
    return s
