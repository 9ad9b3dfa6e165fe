"""`pdserve up --model DIR` on a Qwen2.5, a Qwen3 and a Gemma 3 random-weight directory, each
with its family's chat format: chat, streaming, tools in the model's own format and structured
outputs through a real router, prefill worker, KV hand-off and decode worker, with the official
`openai` client. A random model writes noise, so what holds comes from the template, the grammar
and the parsers, and greedy decoding makes streamed and whole answers comparable."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdserve.text.tokenizer import Tokenizer
from tests.helpers.tiny_models import make_tiny_dir
from tests.helpers.up_harness import Up

pytestmark = pytest.mark.timeout(600)

# (model family, chat format of tests/helpers/chat_templates)
FAMILIES = [("qwen2", "qwen2_5"), ("qwen3", "qwen3"), ("gemma3", "gemma3")]
USER = [{"role": "user", "content": "What's the weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture(scope="module", params=FAMILIES, ids=[f for f, _ in FAMILIES])
def served(request, tmp_path_factory):
    family, chat = request.param
    tmp = tmp_path_factory.mktemp(family)
    path = make_tiny_dir(tmp / "model", family, chat=chat)
    up = Up(str(path), tmp / "up.log", num_prefill=1, num_decode=1).start()
    client = openai.OpenAI(base_url=up.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, client.models.list().data[0].id, Tokenizer.from_dir(path)
    up.stop()


def test_chat_uses_the_family_template_and_streams_the_same_answer(served):
    client, model, tokenizer = served
    kw = {"model": model, "messages": USER, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    # The prompt the workers ran is the family's own rendering, token for token.
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(USER, add_generation_prompt=True))
    assert whole.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_in_the_model_format(served, stream):
    client, model, _ = served
    kw = {"model": model, "messages": USER, "tools": [WEATHER], "tool_choice": "required",
          "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0}
    if stream:
        calls: dict[int, list[str]] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or ():
                    calls.setdefault(d.index, [d.function.name or "", ""])[1] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        got = [tuple(v) for _, v in sorted(calls.items())]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        got = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or ()]
        content, finish = choice.message.content or "", choice.finish_reason
    assert len(got) == 1 and got[0][0] == "get_weather"
    jsonschema.validate(json.loads(got[0][1]), WEATHER["function"]["parameters"])
    assert finish == "tool_calls"
    assert "<tool_call" not in content and "</tool_call" not in content


def test_structured_output_is_bounded_valid_json(served):
    client, model, _ = served
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # a number cannot grow until max_tokens
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
