"""The pipeline benchmark's readings of a timeline: the activation hand-off and the Gantt chart."""

from __future__ import annotations

import pytest

from pdserve.bench.pipeline_bench import Slo, gantt, hand_offs
from pdserve.engine.stage_timeline import Interval, StageTimeline


def test_hand_offs_count_only_micro_batches_stage_1_waited_for():
    t = StageTimeline(2, since=0.0, clock=lambda: 10.0)
    # mb 1: stage 1 idle, starts 2 ms after stage 0 ends; mb 2: stage 1 still busy with mb 1
    # when stage 0 ends (a queue, not a transfer); mb 3: idle again, 4 ms.
    for stage, mb, s, e in [(0, 1, 0.0, 1.0), (1, 1, 1.002, 2.0), (0, 2, 1.0, 1.5), (1, 2, 2.0, 2.5),
                            (0, 3, 3.0, 3.5), (1, 3, 3.504, 4.0)]:
        t.record(Interval(stage, mb, s, e, tokens=8))
    t.record(Interval(0, 1, 2.1, 2.2, "head", 1))
    ms, count = hand_offs(t, 0.0, 10.0)
    assert count == 3
    assert ms == pytest.approx(3.0)  # the median of 2 and 4


def test_gantt_draws_a_png(tmp_path):
    t = StageTimeline(2, since=0.0, clock=lambda: 1.0)
    t.record(Interval(0, 1, 0.0, 0.2, tokens=300))
    t.record(Interval(1, 1, 0.2, 0.4, tokens=300))
    path = gantt(t, 0.0, 0.5, "test", tmp_path / "g.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slo():
    slo = Slo(ttft_ms=100, tbt_ms=20)
    assert slo.met(0.05, [0.01] * 10) and not slo.met(0.2, [0.01]) and not slo.met(0.05, [0.01, 0.5])
