"""The tool-call parser: model text to content and calls, the same whole or split anywhere."""

from __future__ import annotations

import itertools
import json

import pytest

from pdserve.text.tool_parser import ToolCallParser, partial_suffix, read_head
from pdserve.text.tools import call_text


def parser() -> ToolCallParser:
    ids = itertools.count()
    return ToolCallParser(new_id=lambda: f"call_{next(ids)}")


def run(pieces: list[str]) -> tuple[str, list[dict], list]:
    """(content, calls as {id, name, arguments}, every call piece in order) of text fed in pieces."""
    p = parser()
    content, calls, seen = [], [], []
    for out in [*(p.push(x) for x in pieces), p.finish()]:
        content.append(out.content)
        for piece in out.calls:
            seen.append(piece)
            if piece.id is not None:
                calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.arguments
    return "".join(content), calls, seen


CALL = call_text("get_weather", {"city": "Paris", "unit": "celsius"})
TEXTS = {
    "plain text": "Hello there, no tools today.  \n",
    "a lone angle bracket": "a < b and <tool but not a call <",
    "content then a call": f"Let me look.\n{CALL}\n",
    "only a call": CALL,
    "two calls": f"{CALL}\n{call_text('get_time', {})}",
    "calls with text between": f"{CALL}\nand then\n{call_text('get_time', {'tz': 'UTC'})}",
    "the close marker inside an argument": call_text("echo", {"text": "</tool_call> {[\"x"}),
    "escaped quotes in arguments": call_text("echo", {"text": 'say "hi" \\ ok'}),
    "nested arguments": call_text("f", {"a": {"b": [1, {"c": []}]}, "d": "}"}),
    "arguments before the name": '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',
    "arguments as JSON text": '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
    "extra keys after the arguments": '<tool_call>{"name": "f", "arguments": {"x": 1}, "id": 3}</tool_call>',
    "a block that is not a call": "<tool_call>not json</tool_call> after",
    "a block cut off in its head": 'text <tool_call>\n{"name": "get_w',
    "a call cut off in its arguments": '<tool_call>\n{"name": "f", "arguments": {"city": "Par',
    "a close marker cut short at the end": f"{CALL[:-3]}",
    "unicode": call_text("f", {"q": "café ☕"}) + " fin ☕",
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_split_at_every_position_gives_what_the_whole_text_gives(text):
    whole = run([text])[:2]
    for cut in range(1, len(text)):
        assert run([text[:cut], text[cut:]])[:2] == whole, cut
    assert run(list(text))[:2] == whole  # one character at a time


def test_plain_text_passes_through_unchanged():
    content, calls, _ = run(["Hello there, ", "no tools today.  \n"])
    assert content == "Hello there, no tools today.  \n" and calls == []


def test_content_before_a_call_stays_content_and_the_call_is_parsed():
    content, calls, _ = run([TEXTS["content then a call"]])
    assert content == "Let me look."
    assert calls == [{"id": "call_0", "name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "celsius"}'}]


def test_two_calls_get_their_own_index_and_id():
    _, calls, _ = run([TEXTS["two calls"]])
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("call_0", "get_weather", {"city": "Paris", "unit": "celsius"}), ("call_1", "get_time", {})]


def test_text_between_calls_is_content_without_the_whitespace_around_the_blocks():
    content, calls, _ = run([TEXTS["calls with text between"]])
    assert content == "and then" and [c["name"] for c in calls] == ["get_weather", "get_time"]


def test_the_name_comes_first_then_the_arguments_in_pieces_as_they_arrive():
    _, calls, seen = run(list(CALL))
    first = seen[0]
    assert (first.id, first.name, first.arguments) == ("call_0", "get_weather", "")
    args = [p.arguments for p in seen[1:] if p.arguments]
    assert len(args) > 5 and "".join(args) == '{"city": "Paris", "unit": "celsius"}'
    assert all(p.id is None and p.name is None for p in seen[1:])


def test_text_that_may_begin_a_call_is_held_until_it_cannot():
    p = parser()
    assert p.push("Sure <tool").content == "Sure"
    assert p.push("box>").content == " <toolbox>"


def test_a_close_marker_inside_an_argument_string_is_part_of_the_argument():
    _, calls, _ = run([TEXTS["the close marker inside an argument"]])
    assert json.loads(calls[0]["arguments"]) == {"text": '</tool_call> {["x'}


def test_a_block_in_another_key_order_is_still_a_call():
    _, calls, _ = run([TEXTS["arguments before the name"]])
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == ("f", {"x": 1})
    _, calls, _ = run([TEXTS["arguments as JSON text"]])
    assert calls[0]["arguments"] == '{"x": 1}'


def test_keys_after_the_arguments_are_dropped():
    content, calls, _ = run([TEXTS["extra keys after the arguments"]])
    assert content == "" and calls[0]["arguments"] == '{"x": 1}'


def test_a_block_that_is_not_a_call_stays_content_markers_and_all():
    content, calls, _ = run([TEXTS["a block that is not a call"]])
    assert calls == [] and content == "<tool_call>not json</tool_call> after"


def test_output_cut_off_in_a_head_is_content_and_in_arguments_a_call_with_what_came():
    content, calls, _ = run([TEXTS["a block cut off in its head"]])
    assert calls == [] and content == 'text <tool_call>\n{"name": "get_w'
    content, calls, _ = run([TEXTS["a call cut off in its arguments"]])
    assert content == "" and calls[0]["arguments"] == '{"city": "Par'


def test_read_head_tells_match_maybe_and_no():
    assert read_head('{"name": "f", "arguments": {') == ("f", 27)
    assert read_head(' { "name" : "f" ,\n"arguments":{}') == ("f", 30)
    assert read_head('{"name": "f", "argu') is True
    assert read_head('{"na') is True
    assert read_head('{"arguments": {}') is False
    assert read_head('{"name": "f", "arguments": "x"') is False  # not an object: read whole
    assert read_head('{"name": "", "arguments": {') is False


def test_partial_suffix_finds_the_longest_proper_beginning():
    assert partial_suffix("abc <tool_ca", "<tool_call>") == 8
    assert partial_suffix("x<", "<tool_call>") == 1
    assert partial_suffix("<tool_call>", "<tool_call>") == 0
    assert partial_suffix("plain", "<tool_call>") == 0


def run_cut(text: str) -> tuple[str, list[dict]]:
    """(content, calls) of output cut off by max_tokens, fed whole and one character at a time."""
    results = []
    for pieces in ([text], list(text)):
        p = parser()
        content, calls = [], []
        for out in [*(p.push(x) for x in pieces), p.finish(truncated=True)]:
            content.append(out.content)
            for piece in out.calls:
                if piece.id is not None:
                    calls.append({"name": piece.name, "arguments": ""})
                calls[piece.index]["arguments"] += piece.arguments
        results.append(("".join(content), calls))
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("text", [
    f"{CALL}\n{CALL}\n<tool_call",  # the reported answer: two calls, a third cut in its marker
    f"{CALL}\n<tool_call>\n",
    f'{CALL}\n<tool_call>\n{{"name": "get_w',
    f"{CALL}\n<tool_call>\n[1, 2",  # a block that is no call, cut before its end
    f"{CALL}\n<",
], ids=["open marker cut", "head not begun", "head cut", "other block cut", "one bracket"])
def test_output_cut_by_max_tokens_leaves_no_markup_in_the_content(text):
    content, calls = run_cut(text)
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather"] * text.count(CALL)
    assert all(json.loads(c["arguments"]) == {"city": "Paris", "unit": "celsius"} for c in calls)


def test_content_before_a_marker_cut_by_max_tokens_stays_without_the_marker():
    assert run_cut("Let me check. <tool_ca") == ("Let me check.", [])
    assert run_cut('Let me check.\n<tool_call>\n{"name"') == ("Let me check.", [])


def test_a_call_cut_by_max_tokens_in_its_arguments_goes_out_with_what_came():
    assert run_cut('<tool_call>\n{"name": "f", "arguments": {"city": "Par') == (
        "", [{"name": "f", "arguments": '{"city": "Par'}])
