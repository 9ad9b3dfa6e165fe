"""The Qwen and Gemma 3 formats at the router, with scripted workers: Qwen's template lists the
tools itself and its `<tool_call>` blocks come back as `tool_calls`; Gemma 3's has no tools, so
the default tools prompt goes into its first user turn; a template's raise_exception is a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve.router.tool_calls import MAX_PARALLEL_CALLS
from pdserve.text.tools import Function, call_grammar, call_text
from tests.helpers.chat_templates import family_tokenizer
from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "Weather in Oslo?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": PARAMS}}
SAID = call_text("get_weather", {"city": "Oslo"})


@pytest.fixture(scope="module", params=["qwen2_5", "qwen3"])
def qwen(request):
    tok = family_tokenizer(request.param)
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=tok.encode(SAID) + [tok.token_to_id("<|im_end|>")])
        h.tok = tok
        yield h


@pytest.fixture(scope="module")
def gemma():
    tok = family_tokenizer("gemma3")
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=tok.encode("Sunny.") + [tok.token_to_id("<end_of_turn>")])
        h.tok = tok
        yield h


def client(h: RouterHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def last_prompt(h: RouterHarness) -> str:
    return h.tok.decode(list(h.workers[0].requests()[-1].token_ids), skip_special_tokens=False)


def test_qwens_template_lists_the_tools_in_its_own_system_turn(qwen):
    client(qwen).chat.completions.create(model="m", messages=USER, tools=[WEATHER], max_tokens=100)
    prompt = last_prompt(qwen)
    listed = json.dumps(Function("get_weather", "Current weather", PARAMS).as_tool())
    assert prompt.startswith("<|im_start|>system\n")
    assert f"<tools>\n{listed}\n</tools>" in prompt and "# Tools\n\nYou may call one or more functions to assist" in prompt
    assert "to help with the user's request" not in prompt  # not pdserve's default tools prompt
    assert prompt.endswith("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")


def test_qwens_call_blocks_come_back_as_tool_calls_whole_and_streamed(qwen):
    c = client(qwen)
    whole = c.chat.completions.create(model="m", messages=USER, tools=[WEATHER], max_tokens=100).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    content, deltas, finish = [], [], None
    for chunk in c.chat.completions.create(model="m", messages=USER, tools=[WEATHER], max_tokens=100, stream=True):
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            deltas.extend(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert "".join(content) == "" and finish == "tool_calls"
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Oslo"}


def test_qwens_history_of_calls_and_results_is_rendered_by_its_template(qwen):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}]
    client(qwen).chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=100)
    prompt = last_prompt(qwen)
    assert f"<|im_start|>assistant\n{SAID}<|im_end|>\n" in prompt or f"</think>\n\n{SAID}<|im_end|>\n" in prompt
    assert "<|im_start|>user\n<tool_response>\n3 C\n</tool_response><|im_end|>\n" in prompt


@pytest.mark.parametrize(("choice", "parallel", "max_calls"), [
    ("required", None, MAX_PARALLEL_CALLS),
    ("required", False, 1),
    ({"type": "function", "function": {"name": "get_weather"}}, None, 1),
], ids=["required", "required one call", "named"])
def test_qwens_forced_calls_are_the_grammar_of_the_calls(qwen, choice, parallel, max_calls):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    with httpx.Client(base_url=qwen.base_url, timeout=20) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": [WEATHER],
                                                    "tool_choice": choice, "max_tokens": 100, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    want = call_grammar([Function("get_weather", "Current weather", PARAMS)], max_calls)
    assert qwen.workers[0].requests()[-1].sampling.structured.spec == want


def test_gemma_gets_the_default_tools_prompt_in_its_first_user_turn(gemma):
    r = client(gemma).chat.completions.create(model="m", messages=[{"role": "system", "content": "Be brief."}, *USER],
                                              tools=[WEATHER], max_tokens=100)
    assert r.choices[0].message.content == "Sunny."
    prompt = last_prompt(gemma)
    assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert prompt.endswith("Weather in Oslo?<end_of_turn>\n<start_of_turn>model\n")


def test_gemmas_multi_part_content_is_joined_into_its_turn(gemma):
    parts = [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]
    client(gemma).chat.completions.create(model="m", messages=[{"role": "user", "content": parts}], max_tokens=100)
    assert last_prompt(gemma) == "<bos><start_of_turn>user\nWeather in Oslo?<end_of_turn>\n<start_of_turn>model\n"


def test_gemmas_raise_exception_is_an_openai_400_that_reaches_no_worker(gemma):
    seen = len(gemma.workers[0].requests())
    with httpx.Client(base_url=gemma.base_url, timeout=20) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "messages", "chat_template_error")
    assert "Conversation roles must alternate user/assistant" in err["message"]
    assert len(gemma.workers[0].requests()) == seen


def test_qwen3s_thinking_switch_reaches_its_template_through_chat_template_kwargs():
    tok = family_tokenizer("qwen3")
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=tok.encode("Hi.") + [tok.token_to_id("<|im_end|>")])
        h.tok = tok
        r = client(h).chat.completions.create(model="m", messages=USER, max_tokens=20,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == "Hi."
        assert last_prompt(h).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
