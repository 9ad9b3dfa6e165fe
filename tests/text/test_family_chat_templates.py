"""The Qwen2.5, Qwen3 and Gemma 3 chat formats (tests/helpers/chat_templates) render through
pdserve's sandboxed renderer to exactly the families' prompts: default system message, tools in
the system turn, calls and results, reasoning, multi-part content, role checks."""

from __future__ import annotations

import json

import pytest

from pdserve.text.chat_template import render_chat_template
from pdserve.text.tokenizer import Tokenizer
from pdserve.text.tools import Function, for_template, template_supports_tools
from tests.helpers.chat_templates import (
    end_of_turn_tokens,
    family_tokenizer,
    generation_config,
    template,
    tokenizer_config,
)

WEATHER = Function("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]})
TOOLS = [WEATHER.as_tool()]
TOOLS_LINE = json.dumps(WEATHER.as_tool())
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
CALL_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
QWEN_TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{TOOLS_LINE}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
TOOL_TURN = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_1", "content": "cloudy"},
]
TOOL_RESULTS = ('<|im_start|>user\n<tool_response>\n{"temp": 3}\n</tool_response>\n'
                "<tool_response>\ncloudy\n</tool_response><|im_end|>\n")


def render(name: str, messages: list[dict], **kwargs) -> str:
    """What the router renders: the conversation as transformers passes it to a template."""
    return render_chat_template(template(name), messages=for_template(messages), **kwargs)


# --- Qwen2.5 ---------------------------------------------------------------------------------


def test_qwen2_5_opens_with_its_default_system_message():
    assert render("qwen2_5", [{"role": "user", "content": "Hi"}], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_qwen2_5_lists_tools_in_the_system_turn_and_writes_calls_and_results():
    messages = [{"role": "system", "content": "Be brief."}, *TOOL_TURN]
    assert render("qwen2_5", messages, tools=TOOLS, add_generation_prompt=True) == (
        f"<|im_start|>system\nBe brief.\n\n{QWEN_TOOLS_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_BLOCK}<|im_end|>\n" + TOOL_RESULTS + "<|im_start|>assistant\n")


def test_qwen2_5_keeps_an_assistants_content_before_its_calls_and_ends_a_finished_turn():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]
    assert render("qwen2_5", messages, add_generation_prompt=False).endswith(
        f"<|im_start|>assistant\nChecking.\n{CALL_BLOCK}<|im_end|>\n")


# --- Qwen3 -----------------------------------------------------------------------------------


def test_qwen3_drops_reasoning_before_the_last_query_and_keeps_it_after():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "\nI need the tool.\n", "tool_calls": [CALL]},
        *TOOL_TURN[2:],
        {"role": "assistant", "content": "<think>\nIt is cold.</think>\n\nIt is 3 C and cloudy."},
    ]
    assert render("qwen3", messages, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\nI need the tool.\n</think>\n\n{CALL_BLOCK}<|im_end|>\n"
        + TOOL_RESULTS
        + "<|im_start|>assistant\n<think>\nIt is cold.\n</think>\n\nIt is 3 C and cloudy.<|im_end|>\n")


def test_qwen3_lists_tools_after_the_system_prompt_and_takes_string_arguments():
    messages = [{"role": "system", "content": "Be brief."}, *TOOL_TURN[:2]]
    # Given as OpenAI sends them: `arguments` is JSON text, written as it is.
    rendered = render_chat_template(template("qwen3"), messages=messages, tools=TOOLS, add_generation_prompt=False)
    assert rendered == (
        f"<|im_start|>system\nBe brief.\n\n{QWEN_TOOLS_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\n\n</think>\n\n{CALL_BLOCK}<|im_end|>\n")


@pytest.mark.parametrize(("kwargs", "ending"), [
    ({}, "<|im_start|>assistant\n"),
    ({"enable_thinking": True}, "<|im_start|>assistant\n"),
    ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
], ids=["default", "thinking", "no thinking"])
def test_qwen3_generation_prompt_closes_an_empty_think_block_when_thinking_is_off(kwargs, ending):
    rendered = render("qwen3", [{"role": "user", "content": "Hi"}], add_generation_prompt=True, **kwargs)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n" + ending


def test_qwen3_has_no_default_system_message():
    assert render("qwen3", [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n")


# --- Gemma 3 ---------------------------------------------------------------------------------


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn_and_names_the_assistant_model():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "text", "text": "there\n"}]},
        {"role": "assistant", "content": "Hello!\n"},
        {"role": "user", "content": "Weather?"},
    ]
    assert render("gemma3", messages, bos_token="<bos>", add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHithere<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWeather?<end_of_turn>\n"
        "<start_of_turn>model\n")


@pytest.mark.parametrize("roles", [["assistant"], ["user", "user"], ["system", "user", "assistant", "assistant"]])
def test_gemma3_refuses_turns_that_do_not_alternate(roles):
    messages = [{"role": r, "content": "x"} for r in roles]
    with pytest.raises(ValueError, match="Conversation roles must alternate user/assistant"):
        render("gemma3", messages, bos_token="<bos>")


def test_only_the_qwen_templates_render_tools_themselves():
    assert template_supports_tools(template("qwen2_5")) and template_supports_tools(template("qwen3"))
    assert not template_supports_tools(template("gemma3"))


# --- through a tokenizer ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "markup"), [
    ("qwen3", ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]),
    ("gemma3", ["<bos>", "<start_of_turn>", "<end_of_turn>"]),
])
def test_a_familys_markup_becomes_its_single_tokens_and_its_end_of_turn_stops(name, markup):
    tok = family_tokenizer(name)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Weather?"}]
    if name == "qwen3":
        messages = [*messages[:2], *TOOL_TURN[:2], {"role": "assistant", "content": "<think>\nx\n</think>\n\nDone."}]
    ids = tok.encode_chat(messages, add_generation_prompt=True)  # bos_token: the tokenizer's own
    pieces = [tok.token_to_piece(i) for i in ids]
    for m in markup:
        assert m in pieces, m
    end = "<|im_end|>" if name == "qwen3" else "<end_of_turn>"
    assert tok.token_to_id(end) in tok.stop_token_ids
    if name == "gemma3":
        assert pieces.count("<bos>") == 1 and pieces[0] == "<bos>"


def test_the_tokenizer_config_names_every_added_token_with_its_flag():
    tok = family_tokenizer("qwen3")
    decoder = tokenizer_config("qwen3", tok.token_to_id)["added_tokens_decoder"]
    flags = {v["content"]: v["special"] for v in decoder.values()}
    assert flags["<|im_end|>"] and not flags["<tool_call>"] and not flags["</think>"]
    # Non-special tokens survive decoding, where the tool-call parser reads them.
    ids = tok.encode("<tool_call>\n{}\n</tool_call><|im_end|>")
    assert tok.decode(ids) == "<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "gemma3"])
def test_a_model_directory_written_from_the_helper_loads_with_its_template_and_stops(tmp_path, name):
    backend = family_tokenizer(name).backend
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(name, backend.token_to_id)))
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config(name, backend.token_to_id)))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == template(name)
    assert {tok.token_to_id(t) for t in end_of_turn_tokens(name)} <= set(tok.stop_token_ids)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<bos><start_of_turn>user\nHi" if name == "gemma3" else "<|im_start|>")
