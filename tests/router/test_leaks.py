"""An unexpected exception after admission leaks nothing: the in-flight slot is released, the
workers are told to abort, and the next request is served."""

from __future__ import annotations

import httpx
import pytest

from pdserve.protocol.messages import Abort
from pdserve.router import render
from tests.helpers.fake_worker import RouterHarness, toks

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
LONG = toks("Hello world") * 50


def test_exceptions_before_submit_release_the_slot(monkeypatch):
    with RouterHarness(max_inflight=2) as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker("colo-0")

        def boom(*args, **kwargs):
            raise RuntimeError("bug (test)")

        monkeypatch.setattr(h.service, "sampling_params", boom)
        for _ in range(5):  # more than --max-inflight: a leak would turn these into 429s
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert h.service.inflight == 0
        monkeypatch.undo()
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_exception_while_collecting_aborts_every_worker_and_releases_the_slot(monkeypatch):
    with RouterHarness(max_inflight=1) as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        p = h.worker("prefill-0", "prefill", script=LONG, delay=0.05)
        d = h.worker("decode-0", "decode", script=LONG, delay=0.05)

        def boom(self, delta):
            raise RuntimeError("renderer bug (test)")

        monkeypatch.setattr(render.Renderer, "add", boom)
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 200})
        assert r.status_code == 500
        assert h.service.inflight == 0 and len(h.service.tracker) == 0
        for w in (p, d):
            assert w.wait_for(lambda w=w: any(isinstance(m, Abort) for m in w.received), 3), w
        monkeypatch.undo()
        ok = c.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_exception_while_streaming_releases_the_slot(monkeypatch):
    with RouterHarness(max_inflight=1) as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        w = h.worker("colo-0", script=LONG, delay=0.02)

        def boom(self, delta):
            raise RuntimeError("renderer bug (test)")

        monkeypatch.setattr(render.ChatRenderer, "chunk", boom)
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            try:
                for _ in r.iter_lines():
                    pass
            except httpx.HTTPError:
                pass  # the stream breaks off: the bug is the server's, not the client's
        assert h.wait_until(lambda: h.service.inflight == 0, 3)
        assert w.wait_for(lambda: any(isinstance(m, Abort) for m in w.received), 3)
        monkeypatch.undo()
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
