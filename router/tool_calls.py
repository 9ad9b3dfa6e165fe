"""A chat request's tools: what it offers, whether calls are free or forced, and the checks.

`tool_plan` reads `tools`, `tool_choice` and `parallel_tool_calls` (400s name the field); the
plan says how to render the prompt (text/tools.py), which constraint forces calls (`required`
and a named function: a grammar whose language is the calls, docs/tools.md) and whether the
router parses calls out of the output (every choice but `none`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.protocol.sampling import StructuredOutput
from pdserve.router.errors import bad_request
from pdserve.router.openai_schema import ChatCompletionRequest, NamedToolChoice
from pdserve.text.tools import Function, call_grammar

MAX_TOOLS = 128
# With parallel calls allowed, a forced answer holds at most this many: the grammar stays finite
# and a small model that will not stop still ends well before a long max_tokens.
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """`choice` is "auto", "required" or "named" (`forced` then names the function)."""

    functions: tuple[Function, ...]
    choice: str
    parallel: bool
    forced: str | None = None

    @property
    def allowed(self) -> tuple[Function, ...]:
        """The functions the output may call."""
        if self.forced is None:
            return self.functions
        return tuple(f for f in self.functions if f.name == self.forced)

    def instruction(self) -> str:
        """What the default prompt adds after the list of functions."""
        if self.choice == "named":
            return f"You must call the function {self.forced}."
        must = "You must call at least one function." if self.choice == "required" else ""
        once = "Call at most one function." if not self.parallel else ""
        return " ".join(x for x in (must, once) if x)

    def constraint(self) -> StructuredOutput | None:
        """The grammar that forces the calls, or None when the output is free (`auto`)."""
        if self.choice == "auto":
            return None
        max_calls = MAX_PARALLEL_CALLS if self.parallel and self.choice == "required" else 1
        return StructuredOutput("grammar", call_grammar(self.allowed, max_calls))

    def parameter_specs(self) -> list[tuple[StructuredOutput, str]]:
        """Each function's `parameters` as a JSON-schema constraint, with the field naming it."""
        return [
            (StructuredOutput("json_schema", json.dumps(f.schema)), f"tools[{i}].function.parameters")
            for i, f in enumerate(self.functions)
        ]


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, or None when it offers none or `tool_choice` is "none" (then the
    prompt does not list them and the output is plain content)."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("`tool_choice` needs a non-empty `tools` list", "tool_choice")
        if req.parallel_tool_calls is not None:
            raise bad_request("`parallel_tool_calls` needs a non-empty `tools` list", "parallel_tool_calls")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"`tools` takes at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        f = tool.function
        if not _NAME.fullmatch(f.name):
            raise bad_request(
                f"function name {f.name!r} must be 1 to 64 letters, digits, '_' or '-'",
                f"tools[{i}].function.name",
            )
        if f.name in seen:
            raise bad_request(f"two tools are named {f.name!r}", f"tools[{i}].function.name")
        seen.add(f.name)
        functions.append(Function(f.name, f.description, f.parameters))
    if choice == "none":
        return None
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in seen:
            raise bad_request(
                f"`tool_choice` names the function {choice.function.name!r}, which `tools` does not offer",
                "tool_choice",
            )
        return ToolPlan(tuple(functions), "named", parallel, choice.function.name)
    return ToolPlan(tuple(functions), choice or "auto", parallel)
