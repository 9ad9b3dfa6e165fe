"""Rate-limited log lines: a flood of bad frames or requests costs a count, not a disk.

    log_bad = RateLimitedLog(log, logging.WARNING, per_seconds=10.0)
    log_bad("control frame from %r dropped: %s", ident, why)

The first line of each `key` (the format string by default) in a window is logged at once; the
rest are counted, and the next line logged says how many were suppressed. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, per_seconds: float = 10.0,
                 clock=time.monotonic) -> None:
        self.logger = logger
        self.level = level
        self.per_seconds = per_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, msg: str, *args: object, key: str | None = None) -> bool:
        """Log `msg % args` unless its key was logged within the window; True when it was logged."""
        k = key or msg
        now = self._clock()
        with self._lock:
            last = self._last.get(k)
            if last is not None and now - last < self.per_seconds:
                self._suppressed[k] = self._suppressed.get(k, 0) + 1
                return False
            if len(self._last) > 1024:  # many distinct keys: forget the old ones
                self._last = {kk: t for kk, t in self._last.items() if now - t < self.per_seconds}
            self._last[k] = now
            suppressed = self._suppressed.pop(k, 0)
        if suppressed:
            msg = f"{msg} (and {suppressed} more like it in the last {self.per_seconds:.0f} s)"
        self.logger.log(self.level, msg, *args)
        return True
