"""Bubble accounting (engine/stage_timeline.py) against a scripted schedule whose busy and idle
gaps are known."""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.stage_timeline import Interval, StageTimeline


def scripted() -> StageTimeline:
    """Two stages over 10 s. Stage 0 computes micro-batches at [0, 2), [2, 4) and [6, 7): 5 s busy.
    Stage 1 takes each after stage 0: [2, 4), [4, 6), [7, 9): 6 s busy, idle at [0, 2), [6, 7), [9, 10)."""
    t = StageTimeline(2, since=0.0, clock=lambda: 10.0)
    for stage, mb, start, end in [(0, 1, 0, 2), (1, 1, 2, 4), (0, 2, 2, 4), (1, 2, 4, 6), (0, 3, 6, 7), (1, 3, 7, 9)]:
        t.record(Interval(stage, mb, float(start), float(end)))
    return t


def test_busy_idle_and_bubble_fractions_of_a_known_schedule():
    t = scripted()
    assert t.busy == [5.0, 6.0]
    assert t.idle() == [5.0, 4.0]
    assert t.bubble_fraction() == [0.5, 0.4]
    # The last 5 s, [5, 10]: stage 0 busy 1 s (6-7), stage 1 busy 1 + 2 s (5-6, 7-9).
    assert t.bubble_fraction(window=5.0) == pytest.approx([0.8, 0.4])
    # While a micro-batch was in flight: spans [0, 4], [2, 6], [6, 9], 9 s in all, stage 0 busy
    # 5 of them, stage 1 6: the last second, when nothing was there, is no bubble.
    assert t.in_flight_between(0.0, 10.0) == pytest.approx([4 / 9, 3 / 9])
    info = t.describe()
    assert info["bubble_fraction"] == [0.5, 0.4] and info["idle_seconds"] == [5.0, 4.0]


def test_the_timeline_window_and_bad_intervals():
    t = scripted()
    assert [(iv.stage, iv.micro_batch) for iv in t.window(5.0, 6.5)] == [(1, 2), (0, 3)]
    with pytest.raises(ValueError):
        t.record(Interval(2, 4, 0.0, 1.0))  # no such stage
    with pytest.raises(ValueError):
        t.record(Interval(0, 4, 2.0, 1.0))  # ends before it starts


def test_the_wall_starts_at_the_first_micro_batch():
    """A worker's loading before its first micro-batch is not a bubble."""
    now = [100.0]
    t = StageTimeline(2, clock=lambda: now[0])
    assert t.idle() == [0.0, 0.0]
    t.record(Interval(0, 1, 104.0, 105.0))
    now[0] = 106.0
    assert t.idle() == [1.0, 2.0] and t.bubble_fraction() == [0.5, 1.0]


def test_describe_from_another_thread_while_the_engine_records():
    """/info reads the timeline on the health thread while the engine thread records into it:
    a read must never see the deque change under it (it once answered /info with a 500)."""
    t = StageTimeline(2, since=0.0, clock=lambda: 1e6)
    for k in range(20_000):
        t.record(Interval(k % 2, k, float(k), k + 0.5))
    stop = threading.Event()

    def engine() -> None:
        k = 20_000
        while not stop.is_set():
            t.record(Interval(k % 2, k, float(k), k + 0.5))
            k += 1

    writer = threading.Thread(target=engine)
    writer.start()
    try:
        for _ in range(30):
            info = t.describe()
            assert info["stages"] == 2 and len(info["bubble_fraction_in_flight_last_minute"]) == 2
            assert len(t.window(0.0, 1e9)) >= 20_000
    finally:
        stop.set()
        writer.join()
