"""Every malformed or refused request gets its 4xx/5xx and an OpenAI error envelope."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)

OK_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def router():
    with RouterHarness(max_body_bytes=2048) as h:
        h.worker("colo-0", max_model_len=64)
        yield h


@pytest.fixture
def http(router):
    with httpx.Client(base_url=router.base_url, timeout=10) as c:
        yield c


def envelope(
    r: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def chat(**changes) -> dict:
    body = {**OK_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=...), "messages"),
        (chat(model=...), "model"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(messages="hi"), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0]",
        ),
        (chat(temperature=3.5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(top_k=-5), "top_k"),
        (chat(presence_penalty=9), "presence_penalty"),
        (chat(logprobs=True, top_logprobs=50), "top_logprobs"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(n=0), "n"),
        (chat(min_tokens=9), "min_tokens"),
        (chat(stop_token_ids=[99999]), "stop_token_ids"),
    ],
)
def test_bad_field_is_400_naming_the_param(http, body, param):
    envelope(http.post("/v1/chat/completions", json=body), 400, param)
    assert http.post("/v1/chat/completions", json=OK_CHAT).status_code == 200


def test_malformed_json_is_400(http):
    envelope(
        http.post(
            "/v1/chat/completions",
            content=b'{"model": ',
            headers={"content-type": "application/json"},
        ),
        400,
    )
    envelope(http.post("/v1/completions", content=b"\xff\xfe"), 400)


def test_empty_messages_is_400(http):
    envelope(http.post("/v1/chat/completions", json=chat(messages=[])), 400, "messages")


def test_unknown_model_is_404_model_not_found(http):
    envelope(
        http.post("/v1/chat/completions", json=chat(model="gpt-9")), 404, "model", "model_not_found"
    )


def test_prompt_over_context_length_is_400(http):
    envelope(
        http.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "x" * 80}])
        ),
        400,
        "messages",
        "context_length_exceeded",
    )
    envelope(
        http.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 62}
        ),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert (
        http.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 61}
        ).status_code
        == 200
    )


def test_completion_prompt_errors(http):
    for prompt in ("", [], [1, "a"], [[1], [2]], [-1], [10**6]):
        envelope(
            http.post("/v1/completions", json={"model": "fake-model", "prompt": prompt}),
            400,
            "prompt",
        )


def test_chat_template_failure_is_400(http):
    envelope(
        http.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "RAISE"}])
        ),
        400,
        "messages",
        "chat_template_error",
    )


def test_oversized_body_is_413_by_content_length_and_by_stream(http):
    envelope(
        http.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "x" * 4000}])
        ),
        413,
    )

    def chunks():
        yield b'{"model": "fake-model", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    envelope(http.post("/v1/completions", content=chunks()), 413)  # chunked: no Content-Length
    assert http.post("/v1/chat/completions", json=OK_CHAT).status_code == 200


def test_unknown_route_404_and_wrong_method_405(http):
    envelope(http.get("/v1/nothing"), 404)
    r = http.get("/v1/chat/completions")
    envelope(r, 405)
    assert "POST" in r.headers["allow"]


def test_health_ready_metrics(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 200
    body = http.get("/metrics").text
    assert "pdserve_router_queue_depth" in body and "pdserve_router_ttft_seconds_bucket" in body


def test_no_workers_is_503_and_not_ready():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url) as c:
        assert c.get("/ready").status_code == 503
        envelope(c.post("/v1/chat/completions", json=OK_CHAT), 503)


def test_ready_waits_for_the_expected_workers_so_a_first_burst_is_not_all_fallback():
    """`pdserve up` starts a prefill and a decode worker: until both are in, a decode worker alone
    could serve every request whole (the fallback), so /ready says 503 until then."""
    with RouterHarness(expect_workers=2) as h, httpx.Client(base_url=h.base_url) as c:
        h.worker("decode-0", role="decode")
        r = c.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "starting", "workers": 1, "expected": 2}
        h.worker("prefill-0", role="prefill")
        assert c.get("/ready").status_code == 200


def test_ready_with_warm_waits_for_every_workers_kv_cache_to_be_faulted_in():
    """Plain /ready answers once workers are in; /ready?warm=1 also waits until each one's
    heartbeat says its KV cache is resident (what `pdserve bench compare` waits for), and
    /metrics shows each worker's state."""
    with RouterHarness() as h, httpx.Client(base_url=h.base_url) as c:
        w = h.worker("colo-0", kv_resident=False)
        h.wait_until(lambda: h.service.registry.workers["colo-0"].last_heartbeat is not None)
        r = c.get("/ready")
        assert r.status_code == 200 and r.json()["warm"] is False
        r = c.get("/ready", params={"warm": "1"})
        assert r.status_code == 503 and r.json() == {"status": "warming", "workers": 1, "cold": ["colo-0"]}
        assert 'pdserve_kv_cache_resident{role="colocated",worker="colo-0"} 0.0' in c.get("/metrics").text
        w.kv_resident = True
        assert h.wait_until(lambda: c.get("/ready", params={"warm": "1"}).status_code == 200)
        assert c.get("/ready", params={"warm": "1"}).json() == {"status": "ready", "workers": 1, "warm": True}
        assert 'pdserve_kv_cache_resident{role="colocated",worker="colo-0"} 1.0' in c.get("/metrics").text


def test_api_key_required_when_set():
    with RouterHarness(api_key="s3cret") as h, httpx.Client(base_url=h.base_url) as c:
        h.worker("colo-0")
        envelope(c.post("/v1/chat/completions", json=OK_CHAT), 401)
        envelope(
            c.post("/v1/chat/completions", json=OK_CHAT, headers={"authorization": "Bearer nope"}),
            401,
        )
        envelope(c.get("/v1/models"), 401)
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        ok = c.post(
            "/v1/chat/completions", json=OK_CHAT, headers={"authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200


def test_over_max_inflight_is_429_with_retry_after():
    with RouterHarness(max_inflight=1) as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        w = h.worker("colo-0", first_delay=30)  # holds the one slot
        with c.stream("POST", "/v1/chat/completions", json={**OK_CHAT, "stream": True}) as held:
            assert held.status_code == 200
            r = c.post("/v1/chat/completions", json=OK_CHAT)
            envelope(r, 429, code="too_many_requests")
            assert r.headers["retry-after"] == "1"
        assert w.wait_for(lambda: w.requests(), timeout=3)  # work leaves on the control I/O thread
        rid = w.requests()[0].request_id
        assert w.wait_for(lambda: rid in w.aborted, timeout=3)
        w.first_delay = 0
        assert h.wait_until(lambda: h.service.inflight == 0)
        assert c.post("/v1/chat/completions", json=OK_CHAT).status_code == 200
