"""Failover under `pdserve up --num-prefill 2 --num-decode 2` (tiny model, loopback): a killed
decode worker's 8 streams, a killed prefill worker's 10 requests, and every prefill worker gone
all end as the no-fault run does, token for token, with a single usage and no error."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.up_harness import Up

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def up(tiny_dir, tmp_path_factory):
    u = Up(str(tiny_dir), tmp_path_factory.mktemp("failover") / "up.log", args=("--drain-timeout", "1")).start()
    yield u
    u.stop()


def body(u: Up, prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": u.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}


def complete(u: Up, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    r = httpx.post(u.base_url + "/v1/completions", json=body(u, prompt, max_tokens, False), timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return r.json()["choices"][0]["text"]


class Stream:
    """One streamed completion: its id, text, usage chunks and error events."""

    def __init__(self, u: Up, prompt: str, max_tokens: int = MAX_TOKENS) -> None:
        self.u, self.prompt, self.max_tokens = u, prompt, max_tokens
        self.id, self.text, self.usages, self.errors, self.chunks = "", "", [], [], 0

    def run(self) -> Stream:
        with httpx.stream("POST", self.u.base_url + "/v1/completions", timeout=180,
                          json=body(self.u, self.prompt, self.max_tokens, True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                self.id = chunk.get("id", self.id)
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                if chunk.get("usage"):
                    self.usages.append(chunk["usage"])
                for choice in chunk.get("choices") or []:
                    self.text += choice.get("text") or ""
                    self.chunks += 1
        return self


def wait_for(cond, timeout: float, what: str, u: Up) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}:\n" + u.log()[-3000:]
        time.sleep(0.02)


def test_kill_9_of_the_decode_worker_8_streams_run_on_loses_none_and_changes_no_token(up):
    prompts = [f"stream number {i} goes on " * 3 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:  # the no-fault run
        reference = list(pool.map(lambda p: complete(up, p), prompts))
    # Put all 8 on decode-0: decode-1 is stopped (out of rotation) while they are routed.
    up.signal("decode-1", signal.SIGSTOP)
    try:
        up.wait_workers({"prefill": 2, "decode": 1, "colocated": 0}, timeout=15)
        streams = [Stream(up, p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(s.run) for s in streams]
            wait_for(lambda: all(s.chunks >= 5 for s in streams), 60, "the streams did not start", up)
            up.signal("decode-1", signal.SIGCONT)
            up.wait_workers({"prefill": 2, "decode": 2, "colocated": 0}, timeout=30)
            routes = up.routes()
            assert all(routes[s.id + "-0"][-1] == "decode-0" for s in streams)
            assert all(s.chunks < MAX_TOKENS // 2 for s in streams), "streams ended before the kill"
            up.signal("decode-0", signal.SIGKILL)
            done = [f.result(timeout=240) for f in futures]
    finally:
        up.signal("decode-1", signal.SIGCONT)
    for s, ref in zip(done, reference, strict=True):
        assert s.errors == []
        assert s.text == ref
        assert len(s.usages) == 1 and s.usages[0]["completion_tokens"] == MAX_TOKENS
    assert up.metric("pdserve_router_migrations_total", 'cause="decode_lost_after_first_token"') >= 8
    up.wait_workers({"prefill": 2, "decode": 2, "colocated": 0}, timeout=90)  # decode-0 restarted


def test_kill_9_of_a_prefill_worker_with_4_long_prefills_and_6_short_requests_queued(up):
    longs = [f"a long prompt {i} " * 300 for i in range(4)]  # ~1,500 tokens each
    shorts = [f"short {i}" for i in range(6)]
    cases = [(p, 64) for p in longs] + [(p, 32) for p in shorts]
    with ThreadPoolExecutor(10) as pool:
        reference = list(pool.map(lambda c: complete(up, *c), cases))
    # Both prefill workers stop where they are (looking alive until their heartbeats are missed)
    # and are given the 10 requests; the one given the most is killed with its share queued, the
    # other resumes: the router must move the victim's requests to it. Stopping both pins the
    # victim's share whichever way the router's prefix-aware choice splits the 10 (stopping one
    # alone left it none when the reference run had cached every prompt on the other).
    before = set(up.routes())
    stopped = {name: up.signal(name, signal.SIGSTOP) for name in ("prefill-0", "prefill-1")}
    streams = [Stream(up, p, n) for p, n in cases]
    try:
        with ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(s.run) for s in streams]
            wait_for(lambda: len(set(up.routes()) - before) >= 10, 30, "the requests were not routed", up)
            first = [route[0] for rid, route in up.routes().items() if rid not in before]
            victim = max(stopped, key=first.count)
            survivor = next(name for name in stopped if name != victim)
            os.kill(stopped.pop(victim), signal.SIGKILL)
            os.kill(stopped.pop(survivor), signal.SIGCONT)
            done = [f.result(timeout=240) for f in futures]
    finally:
        for pid in stopped.values():
            os.kill(pid, signal.SIGCONT)  # a worker left stopped by a failure above
    on_victim = [s for s in done if up.routes()[s.id + "-0"][0] == victim]
    assert len(on_victim) >= 5, first
    for s, ref in zip(done, reference, strict=True):
        assert s.errors == [] and s.text == ref
        assert len(s.usages) == 1 and s.usages[0]["completion_tokens"] == s.max_tokens
    assert up.metric("pdserve_router_migrations_total", 'cause="prefill_lost_before_first_token"') >= len(on_victim)
    up.wait_workers({"prefill": 2, "decode": 2, "colocated": 0}, timeout=90)


def test_with_every_prefill_worker_gone_decode_workers_serve_whole_requests(up):
    prompt = "no prefill worker left"
    reference = complete(up, prompt, 48)
    stopped = [up.signal(name, signal.SIGSTOP) for name in ("prefill-0", "prefill-1")]
    try:
        up.wait_workers({"prefill": 0, "decode": 2, "colocated": 0}, timeout=15)
        s = Stream(up, prompt, 48).run()
        assert s.errors == [] and s.text == reference and s.usages[0]["completion_tokens"] == 48
        assert up.routes()[s.id + "-0"][0].startswith("decode-")
        assert complete(up, prompt, 48) == reference
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    up.wait_workers({"prefill": 2, "decode": 2, "colocated": 0}, timeout=30)


def test_a_decode_worker_draining_past_its_deadline_hands_its_streams_on(up):
    prompts = [f"drain number {i} " * 3 for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        reference = list(pool.map(lambda p: complete(up, p, 2000), prompts))

    def moved() -> float:
        return sum(up.metric("pdserve_router_migrations_total", f'cause="{c}"')
                   for c in ("stopped", "decode_lost_after_first_token"))

    moved_before = moved()
    streams = [Stream(up, p, 2000) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(s.run) for s in streams]
        wait_for(lambda: all(s.chunks >= 5 for s in streams), 60, "the streams did not start", up)
        victim = up.routes()[streams[0].id + "-0"][-1]
        up.signal(victim, signal.SIGTERM)  # drains for 1 s (--drain-timeout), then gives up
        done = [f.result(timeout=240) for f in futures]
    assert "exited with status 0" in up.log() or f"{victim} restarted" in up.log()
    for s, ref in zip(done, reference, strict=True):
        assert s.errors == [] and s.text == ref and len(s.usages) == 1
    # The worker hands its streams back (cause "stopped") and says goodbye; whichever of the two
    # the router acts on first moves them.
    assert moved() - moved_before >= sum(1 for s in done if up.routes()[s.id + "-0"][-1] == victim) >= 1
    up.wait_workers({"prefill": 2, "decode": 2, "colocated": 0}, timeout=90)
