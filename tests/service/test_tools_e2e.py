"""Tool calls end to end: real router and workers (disaggregated and colocated), the official
`openai` client, the tiny random Llama. A random model writes noise, so calls that parse and
validate come from the grammar holding, across the P->D hand-off too."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.service_harness import Cluster

pytestmark = pytest.mark.timeout(400)

INT09 = {"type": "integer", "minimum": 0, "maximum": 9}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two digits",
    "parameters": {"type": "object", "properties": {"a": INT09, "b": INT09}, "required": ["a", "b"],
                   "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}  # no parameters: {}
TOOLS = [WEATHER, ADD, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
MAX_TOKENS = 600  # up to 8 parallel calls of a few dozen tokens each


@pytest.fixture(scope="module")
def disagg(tiny_dir, tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("tools-disagg"), str(tiny_dir), transport="tcp").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def colocated(tiny_dir, tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("tools-colo"), str(tiny_dir), mode="colocated").start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["disaggregated", "colocated"])
def cluster(request):
    return request.getfixturevalue("disagg" if request.param == "disaggregated" else "colocated")


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def call(c: openai.OpenAI, stream: bool, **kw) -> tuple[list[tuple[str, str]], str, str | None]:
    """([(name, arguments)], finish_reason, content) of one chat request, streamed or not."""
    kw = {"model": c.models.list().data[0].id, "messages": USER, "tools": TOOLS, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        choice = c.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or ()]
        return calls, choice.finish_reason, choice.message.content
    by_index: dict[int, list[str]] = {}
    content, finish = [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            for d in ch.delta.tool_calls or ():
                if d.index not in by_index:
                    assert d.id and d.type == "function" and d.function.name  # the first delta names it
                    by_index[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                by_index[d.index][1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return [tuple(by_index[i]) for i in sorted(by_index)], finish, "".join(content) or None


def assert_valid_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_returns_calls_whose_arguments_validate(cluster, stream):
    c = client(cluster)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        calls, finish, content = call(c, stream, tool_choice="required", **kw)
        assert finish == "tool_calls" and content is None, (calls, content)
        assert_valid_calls(calls, set(SCHEMAS))
        assert len(calls) <= 8


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_returns_exactly_one_call_of_it(cluster, stream):
    c = client(cluster)
    for name in ("add", "get_weather", "now"):
        calls, finish, content = call(c, stream, tool_choice={"type": "function", "function": {"name": name}},
                                      temperature=1.0, seed=7)
        assert finish == "tool_calls" and content is None
        assert len(calls) == 1 and calls[0][0] == name
        assert_valid_calls(calls, {name})


def test_required_with_one_call_only_gives_one(cluster):
    calls, finish, _ = call(client(cluster), False, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert finish == "tool_calls" and len(calls) == 1
    assert_valid_calls(calls, set(SCHEMAS))


def test_disaggregated_calls_equal_colocated_calls(disagg, colocated):
    kw = {"tool_choice": "required", "temperature": 0}
    assert call(client(disagg), False, **kw) == call(client(colocated), False, **kw)


def test_a_conversation_continues_after_a_tool_result(cluster):
    c = client(cluster)
    model = c.models.list().data[0].id
    first = c.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
    assistant = first.choices[0].message
    (made,) = assistant.tool_calls
    history = [*USER, assistant.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": made.id, "content": json.dumps({"result": "sunny, 21 C"})}]
    # Forced again: the answer to the longer conversation still validates.
    again = c.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "add"}},
                                      temperature=0, max_tokens=MAX_TOKENS)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result were rendered
    (second,) = again.choices[0].message.tool_calls
    assert_valid_calls([(second.function.name, second.function.arguments)], {"add"})
    # Free: a well-formed answer, text or calls.
    free = c.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=30)
    choice = free.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.role == "assistant"
    assert choice.message.content is not None or choice.message.tool_calls
    assert free.usage.completion_tokens >= 1
