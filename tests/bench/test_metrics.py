"""Metric formulas on hand-made records: TBT splitting, TPOT, SLO, goodput and attainment."""

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, RunInfo, itl_gaps, summarize, tbt_gaps, tpot_s


def rec(rid, sent=0.0, chunks=(), tokens=None, end=None, success=True, intended=None, out=None):
    chunks = list(chunks)
    tokens = list(tokens) if tokens is not None else [1] * len(chunks)
    return RequestRecord(request_id=rid, intended_s=sent if intended is None else intended, sent_s=sent,
                         chunk_times=chunks, chunk_tokens=tokens,
                         end_s=end if end is not None else (chunks[-1] if chunks else sent),
                         output_tokens=sum(tokens) if out is None else out, success=success,
                         error="" if success else "HTTP 500", prompt_tokens=10)


def test_multi_token_chunk_gap_is_split_evenly_across_its_tokens():
    gaps = tbt_gaps([1.0, 1.3, 1.4], [1, 3, 1])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_tokens_arriving_with_the_first_token_add_no_gap():
    assert tbt_gaps([0.5, 0.7], [4, 2]) == pytest.approx([0.1, 0.1])


def test_itl_is_one_unsplit_gap_per_chunk():
    assert itl_gaps([1.0, 1.3, 1.4]) == pytest.approx([0.3, 0.1])


def test_tpot_is_decode_time_over_output_tokens_minus_one():
    r = rec("a", sent=0.0, chunks=[0.2, 0.5], tokens=[1, 4], end=0.6)
    assert tpot_s(r) == pytest.approx((0.6 - 0.2) / 4)
    assert tpot_s(rec("b", chunks=[0.2])) is None  # one token: no TPOT


def test_slo_parse_reads_units_and_percentiles():
    slo = SLO.parse("ttft=500ms, tbt_p99=0.1s, e2e=2s, tbt=250ms, tpot=40")
    assert slo.ttft_s == pytest.approx(0.5)
    assert slo.e2e_s == pytest.approx(2.0)
    assert slo.tpot_s == pytest.approx(0.04)  # a bare number is milliseconds
    assert dict(slo.tbt) == pytest.approx({99.0: 0.1, 100.0: 0.25})


@pytest.mark.parametrize("bad", ["ttft", "latency=5ms", "ttft=fast", "tbt_pxx=3ms"])
def test_slo_parse_rejects_bad_terms_with_a_message(bad):
    with pytest.raises(ValueError, match="SLO"):
        SLO.parse(bad)


def test_goodput_and_attainment_equal_hand_computed_values():
    slo = SLO.parse("ttft=100ms,tbt_p99=50ms")
    records = [
        rec("meets", chunks=[0.05, 0.09, 0.13]),  # TTFT 50 ms, gaps 40 ms
        rec("slow-ttft", chunks=[0.15, 0.19]),  # TTFT 150 ms
        rec("failed", chunks=[0.05], success=False),  # failures are misses whatever their timing
        rec("stall", chunks=[0.05, 0.09, 0.30]),  # one 210 ms gap: its p99 is over 50 ms
        rec("meets-too", sent=1.0, chunks=[1.02, 1.03]),
    ]
    s = summarize(records, RunInfo(duration_s=2.0), slo)
    assert s["slo_met"] == 2
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["completed"] == 4 and s["failed"] == 1


def test_slo_is_judged_from_intended_send_time_by_default():
    late = rec("late", sent=0.5, intended=0.0, chunks=[0.55, 0.56])  # 50 ms after send, 550 after intended
    assert not SLO.parse("ttft=100ms").met_by(late)
    assert SLO.parse("ttft=100ms", from_intended=False).met_by(late)


def test_warmup_records_are_excluded_from_results():
    warm = rec("w", chunks=[5.0, 5.1])
    warm.warmup = True
    s = summarize([warm, rec("m", chunks=[0.05, 0.06])], RunInfo(duration_s=1.0), SLO())
    assert s["completed"] == 1 and s["num_warmup"] == 1
    assert s["max_ttft_ms"] == pytest.approx(50.0)


def test_summary_uses_vllm_names_and_reports_percentiles():
    records = [rec(str(i), chunks=[0.01 * (i + 1), 0.01 * (i + 1) + 0.02], tokens=[1, 1]) for i in range(10)]
    s = summarize(records, RunInfo(duration_s=1.0, request_rate=4.0), SLO())
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "completed", "failed",
                "duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_tbt_ms",
                "goodput", "slo_attainment", "p50_ttft_ms", "p90_ttft_ms", "p95_ttft_ms", "max_ttft_ms"):
        assert key in s, key
    assert s["max_ttft_ms"] == pytest.approx(100.0)
    assert s["median_ttft_ms"] == pytest.approx(55.0)
    assert s["p99_tbt_ms"] == pytest.approx(20.0)
    assert s["request_throughput"] == pytest.approx(10.0)
    assert s["output_throughput"] == pytest.approx(20.0)
    assert s["total_token_throughput"] == pytest.approx(120.0)
