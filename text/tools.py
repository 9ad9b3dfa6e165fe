"""Tool calls in text: the call format, the default tools prompt, and the grammar of calls.

A call is written the way Hermes and Qwen2.5 models write it, one per block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Chat templates that know tools get them (`tools=`) and the conversation as transformers passes
it; for the others (SmolLM2's) `render_default` lists the functions in a system block, writes an
assistant's calls as blocks and a tool's result as a `<tool_response>` block in a user turn
(docs/tools.md). `call_grammar` is the llguidance grammar whose language is exactly one call, or
up to `max_calls` separated by newlines, each call's arguments held to its function's schema.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdserve.text.json_grammar import schema_rules, terminals

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
# A function with no `parameters` takes none (OpenAI): its arguments are exactly {}.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# The separators json.dumps writes by default, so a grammar-made call is byte for byte what
# `call_text` writes for the conversation history.
_ITEM_SEPARATOR, _KEY_SEPARATOR = ", ", ": "
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": _ITEM_SEPARATOR, "key_separator": _KEY_SEPARATOR}
_USES_TOOLS = re.compile(r"\btools\b")


class Function(NamedTuple):
    """One function a request offers (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return NO_PARAMETERS if self.parameters is None else self.parameters

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object, as chat templates and the default prompt show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


def call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """One call block; `arguments` is the JSON text a client sent back, or a decoded object."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it names the `tools` variable)."""
    return template is not None and _USES_TOOLS.search(template) is not None


def default_tools_prompt(functions: Sequence[Function], instruction: str = "") -> str:
    """The system block that offers `functions` to a model whose template does not."""
    listed = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    text = (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. The functions are "
        "listed within <tools></tools> tags, one JSON object per line:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and its arguments within "
        "<tool_call></tool_call> tags, one block per call:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CLOSE}'
    )
    return text + (f"\n\n{instruction}" if instruction else "")


def render_default(
    messages: list[dict[str, Any]], functions: Sequence[Function], instruction: str = ""
) -> list[dict[str, Any]]:
    """The conversation in the default format: plain role/content messages any template renders.

    `functions` (none: the request offers no tools) go in a system block, appended to a leading
    system message or in a new one; assistant `tool_calls` become call blocks after the content;
    consecutive tool results become one user turn of `<tool_response>` blocks.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        msg = {k: v for k, v in m.items() if k != "tool_calls"}
        calls = m.get("tool_calls") or ()
        if calls:
            blocks = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            msg["content"] = f"{content}\n{blocks}" if content else blocks
        else:
            msg["content"] = content
        out.append(msg)
    for msg in out:
        msg.pop("_tool_results", None)
    if functions:
        block = default_tools_prompt(functions, instruction)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows tools: transformers' convention, where a
    call's `arguments` is an object (OpenAI sends JSON text; text that does not parse stays)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_decoded(c) for c in calls]}
        out.append(m)
    return out


def _decoded(call: dict[str, Any]) -> dict[str, Any]:
    args = call["function"]["arguments"]
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    return {**call, "function": {**call["function"], "arguments": args}}


def call_grammar(functions: Sequence[Function], max_calls: int = 1) -> str:
    """A Lark grammar (llguidance's dialect) for 1..max_calls calls of `functions`, newline
    separated, each exactly as `call_text` writes it, its arguments held to the function's
    `parameters`, written with json.dumps' separators and no other whitespace.

    The end is reachable right after every call, and so is a blank line: with parallel calls, a
    newline after a call may begin the next call or end the turn, and a second newline ends it.
    A small model that would go on with prose after its call (most often a blank line first) so
    ends its turn instead of being steered, token by token, into repeating the call until
    max_tokens. After the `max_calls`-th call only the end may come."""
    if max_calls < 1:
        raise ValueError("max_calls must be at least 1")

    def calls(n: int) -> str:
        return "call" + (f' ("\\n" call){{0,{n - 1}}}' if n > 1 else "")

    start = calls(max_calls) + (f' | {calls(max_calls - 1)} "\\n" "\\n"?' if max_calls > 1 else "")
    rules = [f"start: {start}"]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    needs_terminals = False
    for i, f in enumerate(functions):
        head = f'{OPEN}\n{{"name": {json.dumps(f.name)}, "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + chr(10) + CLOSE)}")
        bounded = schema_rules(f.schema, f"args_{i}", _ITEM_SEPARATOR, _KEY_SEPARATOR)
        if bounded is not None:  # numbers of bounded length (text/json_grammar.py)
            rules.extend(bounded)
            needs_terminals = True
        else:
            schema = {**f.schema, "x-guidance": _JSON_STYLE}
            rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    if needs_terminals:
        rules.extend(terminals())
    return "\n".join(rules) + "\n"
