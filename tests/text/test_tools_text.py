"""The tool-call format in text: the default prompt, the conversation in the default format,
template detection, and the grammar whose language is exactly the calls."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.sampling import StructuredOutput
from pdserve.text.grammar import GrammarCompiler
from pdserve.text.tools import (
    NO_PARAMETERS,
    Function,
    call_grammar,
    call_text,
    default_tools_prompt,
    for_template,
    render_default,
    template_supports_tools,
)
from tests.helpers.chat_templates import family_tokenizer
from tests.helpers.tiny_llama import default_tokenizer

WEATHER = Function(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city", "unit"], "additionalProperties": False},
)
TIME = Function("get_time")


def test_call_text_is_the_hermes_block_with_json_dumps_spacing():
    assert call_text("f", {"a": 1, "b": "x"}) == '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>'
    assert call_text("f", '{"a":1}') == '<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call>'


def test_the_default_prompt_lists_each_function_with_its_schema_and_shows_the_format():
    text = default_tools_prompt([WEATHER, TIME], "You must call at least one function.")
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                          "parameters": WEATHER.parameters}},
        {"type": "function", "function": {"name": "get_time", "parameters": NO_PARAMETERS}},
    ]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in text
    assert text.endswith("\n\nYou must call at least one function.")


def test_the_tools_block_joins_a_leading_system_message_or_becomes_one():
    joined = render_default([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [TIME])
    assert joined[0]["role"] == "system" and joined[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert joined[1] == {"role": "user", "content": "hi"}
    added = render_default([{"role": "user", "content": "hi"}], [TIME])
    assert [m["role"] for m in added] == ["system", "user"] and "get_time" in added[0]["content"]
    assert render_default([{"role": "user", "content": "hi"}], []) == [{"role": "user", "content": "hi"}]


def test_a_conversation_with_calls_and_results_renders_as_plain_turns():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    messages = [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
    ]
    out = render_default(messages, [])
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"] == (call_text("get_weather", '{"city": "Oslo"}') + "\n" + call_text("get_time", {}))
    assert "tool_calls" not in out[1]
    assert out[2]["content"] == '<tool_response>\n{"temp": 3}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>'


def test_content_before_an_assistants_calls_is_kept():
    out = render_default([{"role": "assistant", "content": "Checking.",
                           "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}], [])
    assert out[0]["content"] == "Checking.\n" + call_text("f", "{}")


def test_templates_that_name_tools_are_told_apart_from_those_that_do_not():
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert not template_supports_tools("{{ toolset }}") and not template_supports_tools(None)


def test_for_template_gives_call_arguments_as_objects():
    m = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "d", "function": {"name": "g", "arguments": "not json"}}]}
    out = for_template([m])[0]["tool_calls"]
    assert out[0]["function"]["arguments"] == {"a": 1} and out[1]["function"]["arguments"] == "not json"
    assert m["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the input is not changed


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(default_tokenizer())


def accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes the text's tokens and may then end."""
    tok = default_tokenizer()
    m = compiler.compile(StructuredOutput("grammar", grammar))
    if not m.advance_all(tok.encode(text, add_special_tokens=False)):
        return False
    if m.done:  # complete: nothing but the end may follow
        return m.error is None
    return m.advance(tok.eos_token_id) and m.error is None


def test_the_call_grammar_accepts_exactly_one_call_of_an_offered_function(compiler):
    g = call_grammar([WEATHER, TIME])
    assert accepts(compiler, g, call_text("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert accepts(compiler, g, call_text("get_time", {}))
    assert not accepts(compiler, g, call_text("get_weather", {"city": "Oslo"}))  # a required key missing
    assert not accepts(compiler, g, call_text("get_weather", {"city": "Oslo", "unit": "kelvin"}))
    assert not accepts(compiler, g, call_text("get_date", {}))
    assert not accepts(compiler, g, call_text("get_weather", '{"city":"Oslo","unit":"celsius"}'))  # other spacing
    assert not accepts(compiler, g, "Sure! " + call_text("get_time", {}))
    assert not accepts(compiler, g, call_text("get_time", {}) + "\n" + call_text("get_time", {}))


def test_the_parallel_call_grammar_takes_up_to_its_limit(compiler):
    g = call_grammar([TIME], max_calls=3)
    one = call_text("get_time", {})
    assert accepts(compiler, g, one) and accepts(compiler, g, "\n".join([one] * 3))
    assert not accepts(compiler, g, "\n".join([one] * 4))


def allowed_ids(m) -> set[int]:
    mask = m.allowed_bitmask()
    return {i for i in range(len(mask) * 8) if mask[i >> 3] >> (i & 7) & 1}


def after(compiler: GrammarCompiler, grammar: str, text: str):
    m = compiler.compile(StructuredOutput("grammar", grammar))
    assert m.advance_all(default_tokenizer().encode(text, add_special_tokens=False)) and m.error is None
    return m


@pytest.mark.parametrize("max_calls", [1, 2, 3])
def test_after_the_last_allowed_call_only_the_end_of_sequence_may_come(compiler, max_calls):
    tok = default_tokenizer()
    one = call_text("get_time", {})
    m = after(compiler, call_grammar([WEATHER, TIME], max_calls), "\n".join([one] * max_calls))
    assert m.done and allowed_ids(m) <= set(tok.stop_token_ids) and allowed_ids(m)


@pytest.mark.parametrize("calls_so_far", [1, 2])
def test_with_parallel_calls_the_end_may_come_after_each_call_its_newline_or_a_blank_line(compiler, calls_so_far):
    tok = default_tokenizer()
    newline, bracket = tok.encode("\n")[0], tok.encode("<")[0]
    written = "\n".join([call_text("get_time", {})] * calls_so_far)
    g = call_grammar([TIME], max_calls=3)
    assert {tok.eos_token_id, newline} <= allowed_ids(after(compiler, g, written))
    assert {tok.eos_token_id, newline, bracket} <= allowed_ids(after(compiler, g, written + "\n"))
    blank = after(compiler, g, written + "\n\n")  # a blank line: the turn ends
    assert blank.done and allowed_ids(blank) <= set(tok.stop_token_ids)
    assert not accepts(compiler, g, written + "\n\n" + call_text("get_time", {}))


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_with_qwens_vocabulary_the_grammar_of_calls_writes_each_marker_as_its_one_token(name):
    # Qwen's <tool_call> is an added token that is not special: llguidance alone would read it as
    # special, allow it as the only first token, then refuse it.
    tok = family_tokenizer(name)
    m = GrammarCompiler(tok).compile(StructuredOutput("grammar", call_grammar([WEATHER, TIME], max_calls=2)))
    assert allowed_ids(m) == {tok.token_to_id("<tool_call>")}
    ids = tok.encode(call_text("get_time", {}))
    assert ids[0] == tok.token_to_id("<tool_call>") and ids[-1] == tok.token_to_id("</tool_call>")
    assert m.advance_all(ids) and m.error is None
    assert tok.token_to_id("<|im_end|>") in allowed_ids(m)
    assert m.advance(tok.token_to_id("<|im_end|>")) and m.error is None
