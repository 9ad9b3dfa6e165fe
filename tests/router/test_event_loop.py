"""Nothing a request sends blocks the router's event loop: big prompts are templated, tokenized
and hashed off it, and prompts that cannot fit are refused before any of that."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdserve.text.loader import load_tokenizer
from tests.helpers.fake_worker import FakeTokenizer, RouterHarness

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

MAX_BODY = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def real():
    return load_tokenizer("default").tokenizer


def max_size_chat(model: str) -> dict:
    """A chat body just under the 4 MiB limit: ~700k tokens of prompt."""
    words = "hello world " * ((MAX_BODY - 1024) // 12)
    return {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 2}


def health_latencies_while(router, busy: list[threading.Thread], limit_s: float = 60.0) -> list[float]:
    """/health latencies, sampled back to back while `busy` threads run (at most 2000, limit_s)."""
    out: list[float] = []
    deadline = time.monotonic() + limit_s
    with httpx.Client(base_url=router.base_url, timeout=30) as c:
        c.get("/health")
        for t in busy:
            t.start()
        while any(t.is_alive() for t in busy) and len(out) < 2000 and time.monotonic() < deadline:
            start = time.monotonic()
            assert c.get("/health").status_code == 200
            out.append(time.monotonic() - start)
            time.sleep(0.005)
    for t in busy:
        t.join(30)
    return sorted(out)


# The router in a process of its own, as in production: the test's clients (three threads
# JSON-encoding 4 MiB each) must not share its GIL and skew what is measured.
_ROUTER = """
import sys, time
from pdserve.text.loader import load_tokenizer
from tests.helpers.fake_worker import RouterHarness
tok = load_tokenizer("default").tokenizer
with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=%d) as h:
    h.worker("colo-0", script=tok.encode("ok") + [tok.eos_token_id], max_model_len=10**7)
    print(h.base_url, flush=True)
    sys.stdin.read()
"""


class _Url:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


def test_three_max_size_bodies_keep_health_p99_under_100ms():
    proc = subprocess.Popen(
        [sys.executable, "-c", _ROUTER % MAX_BODY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        router = _Url(proc.stdout.readline().strip())
        # Encoded once, up front: the clients' own JSON encoding must not delay the probes.
        body = json.dumps(max_size_chat("m")).encode()
        assert len(body) <= MAX_BODY
        statuses: list[int] = []

        def post() -> None:
            with httpx.Client(base_url=router.base_url, timeout=60) as c:
                r = c.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                statuses.append(r.status_code)

        lat = health_latencies_while(router, [threading.Thread(target=post) for _ in range(3)])
    finally:
        proc.communicate("", timeout=30)
    assert statuses == [200, 200, 200]
    assert len(lat) >= 20  # the bodies took a while: /health was really measured during them
    p99 = lat[max(0, int(len(lat) * 0.99) - 1)]
    print(f"/health p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms over {len(lat)}")
    assert p99 < 0.1, f"p99 {p99 * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms over {len(lat)}"


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(real):
    with RouterHarness(tokenizer=real, served_model_name="m", max_body_bytes=MAX_BODY) as h:
        h.worker("colo-0", max_model_len=2048)
        with httpx.Client(base_url=h.base_url, timeout=30) as c:
            start = time.monotonic()
            r = c.post("/v1/chat/completions", json=max_size_chat("m"))
            elapsed = time.monotonic() - start
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
        assert elapsed < 1.0  # tokenizing it alone takes seconds


class CountingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.encoded = 0
        self.threads: set[str] = set()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded += 1
        self.threads.add(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


def test_character_bound_refuses_without_calling_the_tokenizer():
    tok = CountingTokenizer()
    with RouterHarness(tokenizer=tok, max_body_bytes=MAX_BODY) as h:
        h.worker("colo-0", max_model_len=64)
        limit = 64 * h.service.max_token_chars
        with httpx.Client(base_url=h.base_url, timeout=30) as c:
            r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "x" * (limit + 1)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert tok.encoded == 0


def test_big_template_kwargs_with_small_messages_are_tokenized_off_the_loop():
    tok = CountingTokenizer()
    with RouterHarness(tokenizer=tok, max_body_bytes=MAX_BODY) as h:
        h.worker("colo-0")
        body = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "chat_template_kwargs": {"notes": "n" * 100_000},
        }
        with httpx.Client(base_url=h.base_url, timeout=30) as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            assert tok.threads and all(t.startswith("pdserve-tokenize") for t in tok.threads)
            tok.threads.clear()
            small = {**body, "chat_template_kwargs": None}
            assert c.post("/v1/chat/completions", json=small).status_code == 200
            assert not any(t.startswith("pdserve-tokenize") for t in tok.threads)
