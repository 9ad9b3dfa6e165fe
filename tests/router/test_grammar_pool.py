"""The router's compile pool: the grammar timeout counts compile time only and stops the work,
and tokenizing never waits behind grammars (they have separate threads)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve.protocol.sampling import StructuredOutput
from tests.helpers.fake_worker import RouterHarness
from tests.helpers.tiny_llama import default_tokenizer

pytestmark = pytest.mark.timeout(60)

C = "/v1/chat/completions"
SLOW_S = 0.4  # what one slow tool schema takes to compile here
TOOLS = 8  # one request's slow tools: 3.2 s of compile work against a 1 s timeout


def slow_tool(i: int) -> dict:
    parameters = {"type": "object", "properties": {f"slow{i}": {"type": "integer"}}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}


@pytest.fixture
def router():
    tok = default_tokenizer()
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20, grammar_timeout=1.0,
                       grammar_threads=1, tokenize_threads=1) as h:
        h.worker("colo-0", script=tok.encode("{}") + [tok.eos_token_id])
        check = h.service.grammars.check
        compiled: list[str] = []

        def slow_check(spec: StructuredOutput) -> None:  # tool schemas named slow* take SLOW_S each
            if '"slow' in spec.spec:
                compiled.append(spec.spec)
                time.sleep(SLOW_S)
            check(spec)

        h.service.grammars.check = slow_check  # type: ignore[method-assign]
        h.compiled = compiled  # type: ignore[attr-defined]
        yield h


def post_in_thread(url: str, body: dict, results: dict, key: str) -> threading.Thread:
    def run() -> None:
        start = time.monotonic()
        r = httpx.post(url, json=body, timeout=30)
        results[key] = (r, time.monotonic() - start)

    t = threading.Thread(target=run)
    t.start()
    return t


def hold_the_grammar_thread(router, results: dict) -> threading.Thread:
    """Send a request whose tools compile slowly (results["slow"]) and return once it holds the
    grammar thread."""
    slow = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "tools": [slow_tool(i) for i in range(TOOLS)]}
    thread = post_in_thread(router.base_url + C, slow, results, "slow")
    while not router.compiled:
        time.sleep(0.01)
    return thread


def test_a_request_over_its_compile_time_stops_its_work_and_others_compile_in_time(router):
    url = router.base_url + C
    results: dict = {}
    t_slow = hold_the_grammar_thread(router, results)
    quick = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
             "response_format": {"type": "json_object"}}
    t_quick = post_in_thread(url, quick, results, "quick")
    t_slow.join()
    t_quick.join()
    r, took = results["slow"]
    assert r.status_code == 400 and "took more than 1 s to compile" in r.json()["error"]["message"]
    assert took < 1.0 + 2 * SLOW_S + 1.0
    # The thread stopped at the next schema after the timeout: not all 8 compiled.
    assert len(router.compiled) <= 1.0 / SLOW_S + 2 < TOOLS
    r, took = results["quick"]
    assert r.status_code == 200, r.text  # queued behind the slow one; its own compile is instant
    assert router.service.inflight == 0


def test_tokenizing_a_big_prompt_does_not_wait_behind_grammars(router):
    url = router.base_url + C
    results: dict = {}
    t_slow = hold_the_grammar_thread(router, results)
    big = {"model": "m", "messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 5}  # 20 KB: off the loop
    t_big = post_in_thread(url, big, results, "big")
    t_big.join()
    t_slow.join()
    r, took = results["big"]
    assert r.status_code == 200, r.text
    assert took < SLOW_S * 2, f"the big prompt waited {took:.2f} s"
