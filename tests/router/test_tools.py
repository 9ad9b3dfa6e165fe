"""Tool calls at the router, with scripted workers: what the prompt says, which constraint forces
calls, how the output is parsed into `tool_calls` (streamed and whole, colocated and
disaggregated), and the 400s for bad tools."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve.protocol.sampling import StructuredOutput
from pdserve.router.tool_calls import MAX_PARALLEL_CALLS
from pdserve.text.grammar import MAX_SCHEMA_DEPTH
from pdserve.text.tokenizer import Tokenizer
from pdserve.text.tools import Function, call_grammar, call_text
from tests.helpers.fake_worker import RouterHarness
from tests.helpers.tiny_llama import default_tokenizer

pytestmark = pytest.mark.timeout(60)

C = "/v1/chat/completions"
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SAID = 'Let me check.\n' + call_text("get_weather", {"city": "Paris"}) + "\n"


def script(tok) -> list[int]:
    return tok.encode(SAID, add_special_tokens=False) + [tok.eos_token_id]


@pytest.fixture(scope="module")
def colocated():
    tok = default_tokenizer()
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=script(tok))
        yield h


@pytest.fixture(scope="module")
def disagg():
    tok = default_tokenizer()
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("prefill-0", "prefill", script=script(tok))
        h.worker("decode-0", "decode", script=script(tok))
        yield h


@pytest.fixture(params=["colocated", "disaggregated"])
def router(request):
    return request.getfixturevalue("colocated" if request.param == "colocated" else "disagg")


def client(h: RouterHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def last_prompt(h: RouterHarness) -> str:
    req = h.workers[0].requests()[-1]
    return default_tokenizer().decode(list(req.token_ids), skip_special_tokens=False)


def test_auto_parses_a_scripted_call_into_tool_calls(router):
    r = client(router).chat.completions.create(model="m", messages=USER, tools=[WEATHER, TIME], max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert router.workers[0].requests()[-1].sampling.structured is None  # auto: the output is free


def test_auto_streams_the_call_as_openai_does(router):
    stream = client(router).chat.completions.create(model="m", messages=USER, tools=[WEATHER], max_tokens=200,
                                                    stream=True)
    content, deltas, finish = [], [], None
    for chunk in stream:
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            deltas.extend(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert "".join(content) == "Let me check." and finish == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_")
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert len(rest) > 1  # the arguments came in pieces, token by token
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    assert json.loads(arguments) == {"city": "Paris"}


def test_the_default_prompt_offers_the_tools_when_the_template_does_not(colocated):
    client(colocated).chat.completions.create(model="m", messages=USER, tools=[WEATHER, TIME], max_tokens=200)
    prompt = last_prompt(colocated)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(Function("get_weather", "Current weather", PARAMS).as_tool()) in prompt
    assert '"name": "get_time"' in prompt and prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_choice_none_neither_offers_tools_nor_parses_calls(colocated):
    r = client(colocated).chat.completions.create(model="m", messages=USER, tools=[WEATHER], tool_choice="none",
                                                  max_tokens=200)
    assert "# Tools" not in last_prompt(colocated)
    assert r.choices[0].message.content == SAID and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("choice", "parallel", "functions", "max_calls"), [
    ("required", None, ["get_weather", "get_time"], MAX_PARALLEL_CALLS),
    ("required", False, ["get_weather", "get_time"], 1),
    ({"type": "function", "function": {"name": "get_time"}}, None, ["get_time"], 1),
], ids=["required", "required one call", "named"])
def test_required_and_named_reach_the_worker_as_the_grammar_of_the_calls(colocated, choice, parallel, functions,
                                                                        max_calls):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    with httpx.Client(base_url=colocated.base_url, timeout=20) as http:
        r = http.post(C, json={"model": "m", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice,
                               "max_tokens": 50, **extra})
    assert r.status_code == 200, r.text
    by_name = {"get_weather": Function("get_weather", "Current weather", PARAMS), "get_time": Function("get_time")}
    want = StructuredOutput("grammar", call_grammar([by_name[n] for n in functions], max_calls))
    assert colocated.workers[0].requests()[-1].sampling.structured == want


def test_a_conversation_with_calls_and_results_is_rendered_and_answered(colocated):
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": '{"temp_c": 21}'},
    ]
    r = client(colocated).chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    prompt = last_prompt(colocated)
    assert ("<|im_start|>assistant\n" + call_text("get_weather", '{"city": "Paris"}') + "<|im_end|>") in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in prompt


# A template that knows tools (as Qwen2.5's does): it lists them itself and writes a call's
# arguments from the object transformers passes.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_objects():
    base = default_tokenizer()
    tok = Tokenizer(base.backend, bos_token=base.bos_token, eos_token=base.eos_token, chat_template=TOOLS_TEMPLATE)
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "21 C"},
    ]
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=script(tok))
        r = client(h).chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=200)
        prompt = last_prompt(h)
    assert r.choices[0].finish_reason == "tool_calls"
    assert prompt.startswith("<|im_start|>system\nTOOLS:" + json.dumps(Function("get_weather", "Current weather", PARAMS).as_tool()) + ";")
    assert '<|im_start|>assistant\nCALL get_weather {"city": "Paris"}<|im_end|>' in prompt
    assert "<|im_start|>tool\n21 C<|im_end|>" in prompt and "# Tools" not in prompt


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def tool(name: str = "f", parameters=None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


REFUSED = [
    # (id, body changes, param, code)
    ("invalid parameters schema", {"tools": [tool("a"), tool("b", {"type": "frob"})]}, "tools[1].function.parameters",
     "invalid_structured_output"),
    ("parameters nest too deep", {"tools": [tool("a", nested(MAX_SCHEMA_DEPTH + 1))]}, "tools[0].function.parameters",
     "invalid_structured_output"),
    ("unsatisfiable parameters", {"tools": [tool("a", {"type": "string", "minLength": 3, "maxLength": 1})]},
     "tools[0].function.parameters", "invalid_structured_output"),
    ("parameters not an object", {"tools": [tool("a", [1])]}, "tools[0].function.parameters", None),
    ("bad function name", {"tools": [tool("no spaces")]}, "tools[0].function.name", None),
    ("duplicate names", {"tools": [tool("f"), tool("f")]}, "tools[1].function.name", None),
    ("no function name", {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", None),
    ("tool type not function", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", None),
    ("named function not offered", {"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", None),
    ("tool_choice unknown", {"tools": [tool("f")], "tool_choice": "always"}, "tool_choice", None),
    ("required without tools", {"tool_choice": "required"}, "tool_choice", None),
    ("parallel_tool_calls without tools", {"parallel_tool_calls": True}, "parallel_tool_calls", None),
    ("parallel_tool_calls not a boolean", {"tools": [tool("f")], "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     None),
    ("required and a response format", {"tools": [tool("f")], "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}, "response_format", None),
    ("tool message without tool_call_id", {"messages": [*USER, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id", None),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls", None),
    ("a history call without its function", {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "1"}]}]},
     "messages[1].tool_calls[0].function", None),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ("legacy function_call", {"function_call": "auto"}, "function_call", "unsupported_parameter"),
]


@pytest.mark.parametrize(("changes", "param", "code"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_tools_are_a_400_naming_the_field_and_reach_no_worker(colocated, changes, param, code):
    seen = len(colocated.workers[0].requests())
    with httpx.Client(base_url=colocated.base_url, timeout=20) as http:
        r = http.post(C, json={"model": "m", "messages": USER, "max_tokens": 5, **changes})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["param"], err["code"]) == (param, code), err
        assert len(colocated.workers[0].requests()) == seen
        ok = http.post(C, json={"model": "m", "messages": USER, "max_tokens": 200, "tools": [WEATHER]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]


def test_a_call_cut_by_max_tokens_leaves_no_markup_in_the_content_streamed_or_not():
    # The reported answer: two calls, then max_tokens ends the output inside a third's marker.
    tok = default_tokenizer()
    call = call_text("get_weather", {"city": "Oslo"})
    said = tok.encode(f"{call}\n{call}\n<tool_call", add_special_tokens=False)
    rest = tok.encode('>\n{"name": "get_weather"', add_special_tokens=False)
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=said + rest)
        c = client(h)
        body = {"model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": "required",
                "max_tokens": len(said)}
        whole = c.chat.completions.create(**body).choices[0]
        content, deltas, finish = [], [], None
        for chunk in c.chat.completions.create(**body, stream=True):
            for ch in chunk.choices:
                content.append(ch.delta.content or "")
                deltas.extend(ch.delta.tool_calls or [])
                finish = ch.finish_reason or finish
    assert whole.finish_reason == "length" and whole.message.content is None
    assert [json.loads(t.function.arguments) for t in whole.message.tool_calls] == [{"city": "Oslo"}] * 2
    assert "".join(content) == "" and finish == "length"
    assert sorted({d.index for d in deltas}) == [0, 1]
