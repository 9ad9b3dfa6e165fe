"""Decode migration: kill -9 the decode worker streams run on, and they finish on the other one,
token for token what they would have been, with one usage and no error. In bfloat16 with
--deterministic on every CPU (where the tiles do not run natively, on the panels): the new worker
prefills the prompt and the streamed tokens, and only batch-invariant arithmetic makes that equal
the decode steps that made them (README, "Deterministic output")."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.service_harness import Cluster

pytestmark = pytest.mark.timeout(300)
N_STREAMS, MAX_TOKENS = 6, 1200


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("migration"), str(tiny_dir), num_prefill=1, num_decode=2,
                engine_args=("--drain-timeout", "2", "--dtype", "bfloat16", "--deterministic"),
                # The tiny model streams a token a millisecond: 3 ms a decode step keeps every stream
                # running well past the moment the test has seen them all start and kills a worker.
                faults="decode:step_delay_ms:3")
    c.start()
    yield c
    c.stop()


def model_id(c: Cluster) -> str:
    return httpx.get(c.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def body(c: Cluster, i: int, stream: bool) -> dict:
    return {"model": model_id(c), "prompt": f"migrate number {i} " * 3, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


def streamed(c: Cluster, i: int, progress: dict[int, int]) -> tuple[str, list[dict], list[str]]:
    """Text, usage chunks and error events of one streamed completion."""
    text, usages, errors = [], [], []
    with httpx.stream("POST", c.base_url + "/v1/completions", json=body(c, i, True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"]["message"])
            if chunk.get("usage"):
                usages.append(chunk["usage"])
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    text.append(choice["text"])
                    progress[i] = progress.get(i, 0) + 1
    return "".join(text), usages, errors


def streams_through(c: Cluster, n: int, fault):
    """Stream n completions and call `fault()` once each has streamed 5 tokens, while they run;
    returns every stream's (text, usage chunks, error events) and what `fault` returned."""
    progress: dict[int, int] = {}
    with ThreadPoolExecutor(n) as pool:
        futures = {i: pool.submit(streamed, c, i, progress) for i in range(n)}
        deadline = time.monotonic() + 60
        while not all(progress.get(i, 0) >= 5 for i in range(n)):
            assert time.monotonic() < deadline, f"streams did not start: {progress}"
            time.sleep(0.02)
        done = fault()
        return {i: f.result(timeout=120) for i, f in futures.items()}, done


def decode_holding_most(c: Cluster) -> str:
    running = {name: c.info(name)["running"] for name in ("decode-0", "decode-1")}
    return max(running, key=lambda k: running[k])


def test_killing_a_decode_worker_mid_stream_loses_no_request_and_changes_no_token(cluster):
    def complete(i: int) -> str:
        r = httpx.post(cluster.base_url + "/v1/completions", json=body(cluster, i, False), timeout=180)
        assert r.status_code == 200
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(N_STREAMS) as pool:  # the no-fault run
        reference = dict(enumerate(pool.map(complete, range(N_STREAMS))))

    def kill_the_busiest() -> tuple[str, int]:
        victim = decode_holding_most(cluster)
        held = cluster.info(victim)["running"]
        cluster.kill(victim)
        return victim, held

    results, (victim, held) = streams_through(cluster, N_STREAMS, kill_the_busiest)

    assert held > 0
    for i, (text, usages, errors) in results.items():
        assert errors == [], f"stream {i}: {errors}"
        assert text == reference[i], f"stream {i} differs after the migration"
        assert len(usages) == 1 and usages[0]["completion_tokens"] == MAX_TOKENS
    metrics = httpx.get(cluster.base_url + "/metrics", timeout=10).text
    migrated = sum(float(v) for v in re.findall(r'pdserve_router_migrations_total\{cause="decode[^"]*"\} ([0-9.]+)',
                                                metrics))
    assert migrated >= held
    deadline = time.monotonic() + 10
    survivor = "decode-1" if victim == "decode-0" else "decode-0"
    while cluster.info(survivor)["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.info(survivor)["used_blocks"] == 0
