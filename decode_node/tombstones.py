"""Abort tombstones: request ids aborted before their KV arrived, remembered for a while.

An Abort from the router can overtake the KV transfer of its request (they travel on different
planes); the decode worker then NACKs the transfer when it lands. A tombstone lives `ttl_s`
seconds and at most `capacity` are kept (the oldest goes first), so an abort flood costs a
bounded map, and each abort O(1): ids sit in insertion order, and expiry pops from the front.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

TOMBSTONE_SECONDS = 120.0  # longer than any KV lease: a transfer that late is refused anyway
MAX_TOMBSTONES = 65_536


class Tombstones:
    """Recently aborted request ids; `rid in tombstones` until it expires or is pushed out."""

    def __init__(self, ttl_s: float = TOMBSTONE_SECONDS, capacity: int = MAX_TOMBSTONES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.ttl_s, self.capacity = ttl_s, capacity
        self._clock = clock
        self._at: OrderedDict[str, float] = OrderedDict()  # oldest first

    def add(self, request_ids: Iterable[str]) -> None:
        now = self._clock()
        at = self._at
        for rid in request_ids:
            at[rid] = now
            at.move_to_end(rid)
            if len(at) > self.capacity:
                at.popitem(last=False)
        while at:  # amortized O(1): each id is popped once
            rid, t = next(iter(at.items()))
            if now - t < self.ttl_s:
                break
            at.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        t = self._at.get(request_id) if isinstance(request_id, str) else None
        return t is not None and self._clock() - t < self.ttl_s

    def __len__(self) -> int:
        return len(self._at)
