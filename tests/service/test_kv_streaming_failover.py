"""KV streamed while the prompt is prefilled, cut by a kill -9 of the prefill worker half-way: the
request finishes through the other prefill worker with the text an undisturbed run gives, and the
decode worker holds no part of the dead stream (its abort dropped it), no transfer and no block,
set aside for the parts copied in early or otherwise;
the dead worker's shm segments go when it is started again."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.service_harness import Cluster

pytestmark = pytest.mark.timeout(300)
# ~100 tokens: 7 chunks of 16. Each test request has a prompt of its own: a prefix-cache hit would
# leave one chunk to compute, and nothing to stream.
def prompt(i: int) -> str:
    return f"a long prompt number {i} that streams its KV in parts " * 12


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("kv-streaming"), str(tiny_dir), num_prefill=2, num_decode=1,
                transport="shm",
                # bfloat16 --deterministic: the same tokens however the prompt was chunked or cached.
                engine_args=("--max-num-batched-tokens", "16", "--dtype", "bfloat16", "--deterministic"),
                # 150 ms a prefill chunk: time to see parts arrive and kill the worker before the end.
                faults="prefill:step_delay_ms:150")
    c.start()
    yield c
    c.stop()


def complete(c: Cluster, text: str) -> str:
    model = httpx.get(c.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(c.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def receiver(c: Cluster) -> dict:
    return c.info("decode-0")["receiver"]


def test_a_stream_cut_by_a_dead_prefill_worker_is_retried_and_leaves_nothing_behind(cluster):
    complete(cluster, prompt(0))
    parts = receiver(cluster).get("parts_received", 0)
    assert parts >= 3, "the prompt's KV should have been streamed in parts"
    early = cluster.info("decode-0")["kv_early"]  # copied in as they came; the load skipped them
    assert early["parts"] >= 2 and early["adopted"] == early["parts"], early

    with ThreadPoolExecutor(1) as pool:
        retried = pool.submit(complete, cluster, prompt(1))
        deadline = time.monotonic() + 60
        while receiver(cluster).get("parts_received", 0) < parts + 2:
            assert time.monotonic() < deadline, "no part of the second request arrived"
            time.sleep(0.02)
        victim = max(("prefill-0", "prefill-1"), key=lambda n: cluster.info(n)["running"])
        pid = cluster.proc(victim).popen.pid
        cluster.kill(victim, group=True)  # its resource tracker too: its segments stay behind
        text = retried.result(timeout=120)
    assert text == complete(cluster, prompt(1))  # what the survivor gives it undisturbed

    deadline = time.monotonic() + 10
    while (receiver(cluster).get("streams_open", 0) or cluster.info("decode-0")["kv_waiting"]
           or cluster.info("decode-0")["kv_set_aside"] or cluster.info("decode-0")["used_blocks"]):
        assert time.monotonic() < deadline, f"the decode worker still holds the dead stream: {receiver(cluster)}"
        time.sleep(0.05)
    assert cluster.info("decode-0")["running"] == 0
    survivor = "prefill-1" if victim == "prefill-0" else "prefill-0"
    assert cluster.info(survivor)["kv_in_flight"] == 0

    left = [n for n in os.listdir("/dev/shm") if f"-{pid}-" in n and n.startswith("pdserve-kv-")]
    assert left, "a kill -9 of the process group leaves the dead worker's segments"
    cluster.restart(victim)  # the restarted worker (same id) reaps its predecessor's
    assert not [n for n in os.listdir("/dev/shm") if f"-{pid}-" in n and n.startswith("pdserve-kv-")]
