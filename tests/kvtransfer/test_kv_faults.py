"""A corrupted KV transfer and an expired lease cost a retry, never the request, and the answer
never comes from bad KV: `pdserve up` with faults injected (tests/helpers/faults)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.up_harness import Up

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def up(tiny_dir, tmp_path_factory):
    u = Up(str(tiny_dir), tmp_path_factory.mktemp("kv-faults") / "up.log", num_prefill=1, num_decode=2,
           faults="prefill-0:kv_flip:1,decode-1:lease_expired:1").start()
    yield u
    u.stop()


def complete(u: Up, stream: bool = False) -> tuple[str, int]:
    body = {"model": u.model(), "prompt": "the same prompt every time " * 4, "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(u.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
    text, usage = [], []
    with httpx.stream("POST", u.base_url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                text += [c["text"] for c in chunk.get("choices") or []]
                usage += [chunk["usage"]["completion_tokens"]] if chunk.get("usage") else []
    assert len(usage) == 1
    return "".join(text), usage[0]


def test_a_flipped_kv_byte_and_an_expired_lease_each_cost_a_retry_not_the_request(up):
    results = [complete(up, stream=i % 2 == 1) for i in range(6)]
    assert up.metric("pdserve_router_migrations_total", 'cause="kv_failed"') >= 1  # the flip, caught
    log = up.log()
    assert "FAULT kv_flip" in log and "checksum" in log
    if "FAULT lease_expired" in log:  # decode-1 got a transfer: its lease "ran out"
        assert up.metric("pdserve_router_migrations_total", 'cause="kv_lease_expired"') >= 1
    reference = complete(up)  # every fault is spent by now
    assert all(r == reference for r in results) and reference[1] == 40


def test_the_lease_fault_was_met(up):
    """decode-1 must have been given a transfer among the requests above (routing is by free
    blocks); send more until it is, then check the retry."""
    reference = complete(up)
    for _ in range(10):
        if "FAULT lease_expired" in up.log():
            break
        assert complete(up) == reference
    assert "FAULT lease_expired" in up.log()
    assert up.metric("pdserve_router_migrations_total", 'cause="kv_lease_expired"') >= 1
