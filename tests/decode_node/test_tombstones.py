"""Abort tombstones on the decode worker: a hard cap, and O(1) per abort."""

from __future__ import annotations

import time

from pdserve.config.engine import EngineConfig
from pdserve.config.worker import WorkerOptions
from pdserve.decode_node.tombstones import MAX_TOMBSTONES, Tombstones
from pdserve.decode_node.worker import DecodeWorker

CFG = EngineConfig(dtype="float32", num_kv_blocks=64, block_size=4)
OPTIONS = WorkerOptions(host="127.0.0.1", kv_port=0, health_port=0)


def test_tombstones_never_exceed_their_capacity_and_forget_the_oldest_first():
    t = Tombstones(capacity=100)
    t.add(f"r{i}" for i in range(1000))
    assert len(t) == 100
    assert "r999" in t and "r900" in t and "r899" not in t


def test_a_tombstone_expires_after_its_ttl():
    now = [0.0]
    t = Tombstones(ttl_s=10.0, clock=lambda: now[0])
    t.add(["old"])
    now[0] = 5.0
    t.add(["young"])
    now[0] = 11.0
    t.add(["new"])  # pops the expired one from the front
    assert "old" not in t and "young" in t and "new" in t and len(t) == 2


def test_the_decode_worker_keeps_a_bounded_map_and_each_abort_costs_the_same_at_20000(tiny):
    w = DecodeWorker.create(OPTIONS, CFG, loaded=tiny)
    try:
        def per_abort(start: int, n: int = 2000) -> float:
            t0 = time.perf_counter()
            for i in range(start, start + n):
                w.abort([f"gone-{i}"])
            return (time.perf_counter() - t0) / n

        first = per_abort(0)
        per_abort(2000, 16_000)
        last = per_abort(18_000)  # the 18,000th to 20,000th abort
        assert len(w.aborted) == 20_000 <= MAX_TOMBSTONES and "gone-0" in w.aborted
        assert last < 3 * first + 20e-6, f"{last * 1e6:.1f} us an abort at 20,000 vs {first * 1e6:.1f} us at first"
        w.aborted.add(f"more-{i}" for i in range(MAX_TOMBSTONES))
        assert len(w.aborted) == MAX_TOMBSTONES
    finally:
        w.receiver.close()
        w.health.close()
