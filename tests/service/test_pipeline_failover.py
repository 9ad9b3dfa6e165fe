"""A pipeline stage killed under load: its worker leaves (the router sees it lost), every stream
finishes on the other worker with the text of the undisturbed run, and nothing of the dead
worker stays behind: no process, no held block. Workers of two stages each (P=2 -> D=2), in
bfloat16 with --deterministic, as tests/service/test_migration.py (why: its docstring)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.service_harness import Cluster
from tests.service.test_migration import body, decode_holding_most, streams_through

pytestmark = pytest.mark.timeout(300)
N_STREAMS = 4


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pp-failover"), str(tiny_dir), num_prefill=1, num_decode=2,
                engine_args=("--drain-timeout", "2", "--dtype", "bfloat16", "--deterministic",
                             "--pipeline-parallel-size", "2", "--no-pp-pin"),
                faults="decode:step_delay_ms:3")
    c.start()
    yield c
    c.stop()


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_stage_migrates_its_workers_streams_and_leaves_nothing(cluster):
    def complete(i: int) -> str:
        r = httpx.post(cluster.base_url + "/v1/completions", json=body(cluster, i, False), timeout=180)
        assert r.status_code == 200
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(N_STREAMS) as pool:  # the undisturbed run
        reference = dict(enumerate(pool.map(complete, range(N_STREAMS))))
    assert all(cluster.info(w)["pipeline"]["stages"] == 2 for w in cluster.workers())

    def kill_a_stage():
        victim = decode_holding_most(cluster)
        held = cluster.info(victim)["running"]
        worker = cluster.proc(victim).popen
        stages = children(worker.pid)
        assert len(stages) == 1, stages  # stage 1, a child of the worker (stage 0)
        os.kill(stages[0], signal.SIGKILL)
        return victim, held, worker, stages

    results, (victim, held, worker, stages) = streams_through(cluster, N_STREAMS, kill_a_stage)

    assert held > 0
    for i, (text, usages, errors) in results.items():
        assert errors == [], f"stream {i}: {errors}"
        assert text == reference[i], f"stream {i} differs after the migration"
        assert len(usages) == 1
    # The worker went down with its stage, and left no process behind.
    assert worker.wait(timeout=30) != 0
    assert not any(alive(pid) for pid in stages)
    survivor = "decode-1" if victim == "decode-0" else "decode-0"
    deadline = time.monotonic() + 10
    while cluster.info(survivor)["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.info(survivor)["used_blocks"] == 0
    assert cluster.info("prefill-0")["used_blocks"] == 0
    metrics = httpx.get(cluster.proc(survivor).health + "/metrics", timeout=5).text
    assert 'pdserve_stage_busy_seconds_total{stage="1"' in metrics
