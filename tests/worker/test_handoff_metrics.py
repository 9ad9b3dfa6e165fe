"""A worker's /metrics: the phases, bytes and parts of the KV hand-offs it took in."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protocol.messages import HandoffTiming
from pdserve.worker.handoff_metrics import HandoffMetrics
from pdserve.worker.stage_metrics import worker_metrics


def samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_each_hand_off_adds_its_phases_bytes_and_parts_under_the_worker():
    handoffs = HandoffMetrics("decode-0")
    scrape = worker_metrics(None, "decode-0", handoffs)
    handoffs.observe(HandoffTiming(wait=0.001, send=0.02, verify=0.0005, load=0.003, nbytes=1 << 20, parts=1))
    handoffs.observe(HandoffTiming(wait=0.003, send=0.04, verify=0.0015, load=0.005, nbytes=3 << 20, parts=8))
    got = samples(scrape())
    phase = lambda p: (("phase", p), ("worker", "decode-0"))  # noqa: E731
    for name, total in (("wait", 0.004), ("send", 0.06), ("verify", 0.002), ("load", 0.008)):
        assert got[("pdserve_handoff_phase_seconds_count", phase(name))] == 2
        assert got[("pdserve_handoff_phase_seconds_sum", phase(name))] == pytest.approx(total)
    worker = (("worker", "decode-0"),)
    assert got[("pdserve_handoff_bytes_sum", worker)] == 4 << 20
    assert got[("pdserve_kv_stream_parts_sum", worker)] == 9
    assert got[("pdserve_kv_stream_parts_bucket", (("le", "1.0"), *worker))] == 1


def test_a_worker_without_hand_offs_exports_no_hand_off_samples():
    page = worker_metrics(None, "prefill-0", HandoffMetrics("prefill-0"))()
    assert not [s for s in samples(page) if s[0].startswith(("pdserve_handoff", "pdserve_kv_stream"))]


def test_a_metrics_page_built_without_hand_offs_has_no_hand_off_families():
    assert b"pdserve_handoff" not in worker_metrics(None, "w")()
