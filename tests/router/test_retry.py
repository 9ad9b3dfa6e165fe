"""Retries: a worker that refuses a request or fails its KV hand-off costs a re-dispatch, never
the request; past --migration-limit the request fails with the worker's reason."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.helpers.fake_worker import RouterHarness, toks

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello world, again"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


def retries(h: RouterHarness, cause: str) -> float:
    text = h.service.metrics.render().decode()
    m = re.search(rf'pdserve_router_migrations_total\{{cause="{cause}"\}} ([0-9.]+)', text)
    return float(m.group(1)) if m else 0.0


def stream_text(c: httpx.Client) -> tuple[str, list[dict]]:
    text, errors = [], []
    with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            for ch in chunk.get("choices") or []:
                text.append(ch["delta"].get("content") or "")
    return "".join(text), errors


def test_a_refusing_prefill_worker_sends_its_requests_to_the_other():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        stubborn = h.worker("prefill-0", "prefill", script=toks(TEXT), refuse=1000)
        good = h.worker("prefill-1", "prefill", script=toks(TEXT))
        h.worker("decode-0", "decode", script=toks(TEXT))
        for _ in range(4):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == TEXT
        assert stream_text(c) == (TEXT, [])
        assert len(good.requests()) == 5  # every request ended up there ...
        refused = len(stubborn.requests())  # ... some after a refusal, each counted once
        assert retries(h, "refused") == refused


def test_a_failed_kv_hand_off_is_retried_on_another_decode_worker():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        p = h.worker("prefill-0", "prefill", script=toks(TEXT))
        bad = h.worker("decode-0", "decode", script=toks(TEXT), kv_refuse=1000)
        good = h.worker("decode-1", "decode", script=toks(TEXT))
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == TEXT
            assert r.json()["usage"]["completion_tokens"] == len(toks(TEXT))
        assert stream_text(c) == (TEXT, [])
        failed = sum(1 for m in bad.received if isinstance(m, tuple))
        assert retries(h, "kv_failed") == failed
        # Each retry re-sent what the router had of the stream: the prefill worker's first token
        # when it had arrived before the refusal (the two travel on different connections).
        retried = [m for m in p.requests() if "~" in m.request_id]
        assert len(retried) == failed
        assert all(m.output_token_ids in ((), tuple(toks(TEXT)[:1])) for m in retried)
        assert all(m.decode_worker_id == "decode-1" for m in retried)
        assert sum(1 for m in good.received if isinstance(m, tuple)) == 4


def test_the_same_pair_is_retried_when_there_is_no_other():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker("prefill-0", "prefill", script=toks(TEXT))
        h.worker("decode-0", "decode", script=toks(TEXT), kv_refuse=1)
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == TEXT
        assert retries(h, "kv_failed") == 1


def test_past_the_migration_limit_the_request_fails_with_the_workers_reason():
    with RouterHarness(migration_limit=2) as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        w = h.worker("colo-0", refuse=1000)
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_error"
        assert "refused (test)" in r.json()["error"]["message"]
        assert len(w.requests()) == 3 and retries(h, "refused") == 2
        assert h.wait_until(lambda: h.service.inflight == 0 and len(h.service.tracker) == 0)


def test_an_error_without_a_retry_cause_fails_at_once():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        w = h.worker("colo-0", refuse=1, refuse_cause="")
        h.worker("colo-1", refuse=1, refuse_cause="")
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_error"
        assert retries(h, "refused") == 0 and len(w.requests()) + len(h.workers[1].requests()) == 1
