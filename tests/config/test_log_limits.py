"""Rate-limited logging: one line per window per key, then a count of what was suppressed."""

from __future__ import annotations

import logging

from pdserve.config.log_limits import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_logs_one_line_per_window_and_then_the_count(caplog):
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("flood"), per_seconds=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="flood"):
        logged = [limited("bad frame from %s", i) for i in range(10_000)]
        clock.now = 10.5
        limited("bad frame from %s", "late")
    assert sum(logged) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame from 0",
        "bad frame from late (and 9999 more like it in the last 10 s)",
    ]


def test_distinct_keys_are_limited_separately(caplog):
    limited = RateLimitedLog(logging.getLogger("keys"), clock=Clock())
    with caplog.at_level(logging.WARNING, logger="keys"):
        assert limited("a %s", 1) and limited("b %s", 1)
        assert not limited("a %s", 2)
    assert len(caplog.records) == 2
