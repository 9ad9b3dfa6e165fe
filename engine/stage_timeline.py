"""Busy and idle time of each pipeline stage, and the micro-batches behind them (the bubbles).

A stage is busy while it computes a micro-batch (its layers; on the first stage also the LM head
and the sampler), idle otherwise: waiting for the previous stage's activations, for the next
micro-batch, or for work at all. The bubble fraction of a stage over a window is idle / wall.
Intervals arrive once their micro-batch comes back to the first stage (engine/pipeline.py), with
every stage's start and end on one clock (CLOCK_MONOTONIC, shared by the processes of a host).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

RECENT_SECONDS = 60.0  # the "last minute" window of /info
MAX_INTERVALS = 50_000  # kept for the recent window and the timeline: a bounded deque


@dataclass(frozen=True, slots=True)
class Interval:
    stage: int
    micro_batch: int
    start: float
    end: float
    kind: str = "layers"  # "layers", or "head": the first stage's LM head and sampler
    tokens: int = 0  # the micro-batch's token count (the timeline's labels)


class StageTimeline:
    """Per stage: busy seconds since `since`, and the recent intervals (for the last minute and
    the Gantt chart). The engine thread records; a worker's health thread reads (/info), so each
    reader works on a copy taken under the lock that `record` holds."""

    def __init__(self, num_stages: int, since: float | None = None, clock=time.monotonic) -> None:
        self.num_stages = num_stages
        self.clock = clock
        # The wall's start: given, or the first micro-batch's (a worker's loading is no bubble).
        self._since = since
        self.busy = [0.0] * num_stages
        self.recent: deque[Interval] = deque(maxlen=MAX_INTERVALS)
        self._lock = threading.Lock()

    @property
    def since(self) -> float:
        return self._since if self._since is not None else self.clock()

    def record(self, interval: Interval) -> None:
        if not 0 <= interval.stage < self.num_stages or interval.end < interval.start:
            raise ValueError(f"bad interval {interval}")
        with self._lock:
            if self._since is None:
                self._since = interval.start
            self.busy[interval.stage] += interval.end - interval.start
            self.recent.append(interval)

    def intervals(self) -> list[Interval]:
        """A copy of the recent intervals, safe to walk while the engine records."""
        with self._lock:
            return list(self.recent)

    def idle(self, now: float | None = None) -> list[float]:
        """Idle seconds of each stage since the timeline began."""
        wall = (self.clock() if now is None else now) - self.since
        return [max(0.0, wall - b) for b in self.busy]

    def bubble_fraction(self, now: float | None = None, window: float | None = None) -> list[float]:
        """idle / wall per stage: over the timeline's whole life, or over the last `window`
        seconds (the part of each interval inside it)."""
        now = self.clock() if now is None else now
        if window is None:
            wall = now - self.since
            return [max(0.0, wall - b) / wall if wall > 0 else 0.0 for b in self.busy]
        return self.between(max(self.since, now - window), now)

    def between(self, start: float, end: float) -> list[float]:
        """idle / wall per stage over [start, end], from the recent intervals (a benchmark's run)."""
        wall = end - start
        busy = [0.0] * self.num_stages
        for iv in self.intervals():
            overlap = min(iv.end, end) - max(iv.start, start)
            if overlap > 0:
                busy[iv.stage] += overlap
        return [max(0.0, wall - b) / wall if wall > 0 else 0.0 for b in busy]

    def in_flight_between(self, start: float, end: float) -> list[float]:
        """Per stage, idle / the time some micro-batch was in the pipeline (from its first
        interval's start to its last one's end) over [start, end]: the bubbles proper, without
        the time there was nothing to compute at all (which idle / wall counts too)."""
        spans: dict[int, list[float]] = {}
        for iv in self.window(start, end):
            span = spans.setdefault(iv.micro_batch, [iv.start, iv.end])
            span[0], span[1] = min(span[0], iv.start), max(span[1], iv.end)
        merged: list[list[float]] = []
        for a, b in sorted(spans.values()):
            a, b = max(a, start), min(b, end)
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        total = sum(b - a for a, b in merged)
        busy = [0.0] * self.num_stages
        for iv in self.window(start, end):
            busy[iv.stage] += min(iv.end, end) - max(iv.start, start)
        return [max(0.0, total - b) / total if total > 0 else 0.0 for b in busy]

    def window(self, start: float, end: float) -> list[Interval]:
        """The intervals that overlap [start, end] (what a timeline picture draws)."""
        return [iv for iv in self.intervals() if iv.end > start and iv.start < end]

    def describe(self, now: float | None = None) -> dict:
        """What a worker's /info says of its stages."""
        now = self.clock() if now is None else now
        idle = self.idle(now)
        return {
            "stages": self.num_stages,
            "busy_seconds": [round(b, 6) for b in self.busy],
            "idle_seconds": [round(i, 6) for i in idle],
            "bubble_fraction": [round(f, 4) for f in self.bubble_fraction(now)],
            "bubble_fraction_last_minute": [round(f, 4) for f in self.bubble_fraction(now, RECENT_SECONDS)],
            # The last minute's idle time while a micro-batch was in flight: the bubbles proper.
            "bubble_fraction_in_flight_last_minute": [
                round(f, 4) for f in self.in_flight_between(max(self.since, now - RECENT_SECONDS), now)],
        }
