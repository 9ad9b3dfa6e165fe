"""The official `openai` client against the router with scripted fake workers."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.fake_worker import RouterHarness, toks

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello world, the END is near"


@pytest.fixture(scope="module")
def colocated():
    with RouterHarness() as h:
        h.worker("colo-0", script=toks(TEXT))
        yield h


@pytest.fixture(scope="module")
def disagg():
    with RouterHarness() as h:
        h.worker("prefill-0", "prefill", script=toks(TEXT))
        h.worker("decode-0", "decode", script=toks(TEXT))
        yield h


def client(h: RouterHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


CHAT = [{"role": "user", "content": "hi"}]


def test_chat_returns_scripted_text_and_usage(colocated):
    r = client(colocated).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=50)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.content == TEXT
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    prompt_len = len(toks("<user>hi\n<assistant>"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, len(toks(TEXT)))
    assert r.usage.total_tokens == prompt_len + len(toks(TEXT))
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stops_at_max_tokens_with_length(colocated):
    r = client(colocated).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=2)
    assert r.choices[0].message.content == "Hello"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 2


def test_chat_stream_concatenates_to_text_with_usage_chunk(colocated):
    stream = client(colocated).chat.completions.create(
        model="fake-model", messages=CHAT, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(toks(TEXT))


def test_completion_text_and_token_id_prompt(colocated):
    c = client(colocated)
    r = c.completions.create(model="fake-model", prompt="Say hi", max_tokens=50)
    assert r.id.startswith("cmpl-") and r.choices[0].text == TEXT
    assert r.usage.prompt_tokens == len(toks("Say hi"))
    r = c.completions.create(model="fake-model", prompt=[72, 105], max_tokens=50)
    assert r.choices[0].text == TEXT and r.usage.prompt_tokens == 2


def test_completion_stream(colocated):
    chunks = list(
        client(colocated).completions.create(
            model="fake-model", prompt="x", max_tokens=50, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_2_gives_two_choices_and_summed_usage(colocated):
    r = client(colocated).chat.completions.create(model="fake-model", messages=CHAT, n=2, seed=7)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert all(ch.message.content == TEXT for ch in r.choices)
    assert r.usage.completion_tokens == 2 * len(toks(TEXT))
    seeds = sorted(m.sampling.seed for m in colocated.workers[0].requests()[-2:])
    assert seeds == [7, 8]


@pytest.mark.parametrize("stop", ["lo w", "END", ["zzz", ", t"], "d"])
def test_stop_string_cuts_across_token_boundaries(colocated, stop):
    c = client(colocated)
    first = stop if isinstance(stop, str) else stop[1]
    expected = TEXT[: TEXT.index(first)]
    r = c.chat.completions.create(model="fake-model", messages=CHAT, stop=stop)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = list(
        c.chat.completions.create(model="fake-model", messages=CHAT, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected


def test_stop_string_match_aborts_the_worker(colocated):
    w = colocated.workers[0]
    client(colocated).completions.create(
        model="fake-model", prompt="x", stop="Hello", max_tokens=50
    )
    rid = w.requests()[-1].request_id
    assert w.wait_for(lambda: rid in w.aborted, timeout=2)


def test_chat_logprobs_shape(colocated):
    r = client(colocated).chat.completions.create(
        model="fake-model", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == ["Hel", "lo", " wor"]
    assert all(e.logprob == -0.5 and len(e.top_logprobs) == 2 for e in content)
    assert content[0].bytes == list(b"Hel")


def test_completion_logprobs_shape(colocated):
    r = client(colocated).completions.create(
        model="fake-model", prompt="x", max_tokens=3, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == ["Hel", "lo", " wor"] and lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [0, 3, 5] and all(len(t) == 2 for t in lp.top_logprobs)


def test_models_lists_served_name(colocated):
    assert [m.id for m in client(colocated).models.list().data] == ["fake-model"]


def test_disaggregated_chat_gets_first_token_from_prefill_and_rest_from_decode(disagg):
    r = client(disagg).chat.completions.create(model="fake-model", messages=CHAT, max_tokens=50)
    assert r.choices[0].message.content == TEXT
    prefill, decode = disagg.workers
    req = prefill.requests()[-1]
    assert req.decode_worker_id == "decode-0" and req.kv_transport == "tcp"
    assert ("kv", req.request_id) in decode.received


def test_disaggregated_stream(disagg):
    chunks = list(
        client(disagg).completions.create(
            model="fake-model", prompt="x", max_tokens=50, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT


def test_disaggregated_single_token_finishes_at_prefill_and_aborts_decode(disagg):
    r = client(disagg).completions.create(model="fake-model", prompt="x", max_tokens=1)
    assert r.choices[0].text == "Hel" and r.choices[0].finish_reason == "length"
    prefill, decode = disagg.workers
    rid = prefill.requests()[-1].request_id
    assert decode.wait_for(lambda: rid in decode.aborted, timeout=2)


def test_line_separator_characters_in_text_keep_every_sse_event_on_one_line():
    import json

    import httpx

    text = "a\u2028b\u2029c\x85d"
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker("colo-0", script=toks(text))
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: {")]  # splits like str.splitlines
    chunks = [json.loads(x[6:]) for x in lines]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch.get("choices")) == text
