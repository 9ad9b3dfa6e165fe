"""OpenAI request and response bodies as msgspec Structs, and their strict parsing.

Requests ignore fields we do not know and that change nothing about the answer (clients send
`user`, `store`, `metadata`...), but every known field is type-checked and a wrong type names its
`param`, and a field that would change the answer in a way pdserve does not honour
(`logit_bias`, `functions`, ...) is a 400 naming it rather than a silent drop: `UNSUPPORTED` lists them, and
README's "The API" section lists both kinds. `structured_output` turns the constraint fields
(`response_format`, vLLM's `guided_*` and `structured_outputs`) into one `StructuredOutput`;
`tools` and `tool_choice` are read by router/tool_calls.py. Responses follow OpenAI's shape
field for field so the official `openai` client parses them.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec

from pdserve.protocol.sampling import StructuredOutput
from pdserve.router.errors import bad_request

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_TOP_LOGPROBS = 20

# --- requests --------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; some clients send the object


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call an assistant made earlier in the conversation."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is always enforced where a call is forced


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: ToolChoiceFunction


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one constraint. pdserve always emits compact JSON,
    so `disable_any_whitespace` is accepted and changes nothing; there is no fallback to drop."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields chat and completions share (OpenAI's plus the vLLM extras benchmarks use).

    The `Any` fields at the end are parsed only to be refused when set (see `UNSUPPORTED`).
    """

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


R = TypeVar("R", ChatCompletionRequest, CompletionRequest)

# Fields that would change the answer in a way pdserve does not honour: set to anything but
# their "off" value, they are a 400 naming the field. (field, off values, why)
UNSUPPORTED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("chat_template", (None,), "the model's own chat template is always used"),
    ("functions", (None, []), "the legacy function calling API is not supported; use `tools`"),
    ("function_call", (None, "none"), "the legacy function calling API is not supported; use `tool_choice`"),
    ("logit_bias", (None, {}), "logit bias is not supported"),
    ("best_of", (None, 1), "best_of is not supported; use n"),
    ("use_beam_search", (None, False), "beam search is not supported"),
    ("length_penalty", (None, 1, 1.0), "length_penalty (beam search) is not supported"),
    ("modalities", (None, ["text"]), "only text output is supported"),
    ("audio", (None,), "audio output is not supported"),
    ("prediction", (None,), "predicted outputs are not supported"),
)

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def parse_request(body: bytes, kind: type[R]) -> R:
    """Decode and check one request body; raise APIError(400) naming the bad param."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        m = _PATH.search(str(exc))
        missing = _MISSING.search(str(exc))
        param = m.group(1) if m else None
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        msg = _PATH.sub("", str(exc)).rstrip(" -")
        raise bad_request(
            f"invalid request: {msg}" + (f" (at {param})" if param else ""), param
        ) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    _check_common(req)
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    else:
        _check_completion(req)
    return req


def _check_unsupported(req: _SamplingFields) -> None:
    for name, off, why in UNSUPPORTED:
        value = getattr(req, name, None)
        if not any(value == o and type(value) is type(o) for o in off):
            raise bad_request(
                f"`{name}` is not supported by this server: {why}", name, "unsupported_parameter"
            )


def _check_common(req: _SamplingFields) -> None:
    _check_unsupported(req)
    if not req.model:
        raise bad_request("`model` must be a non-empty string", "model")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"`n` must be in [1, {MAX_N}], got {req.n}", "n")
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(
            f"`stop` takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop"
        )
    if any(not s for s in stops):
        raise bad_request("`stop` strings must be non-empty", "stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "`stream_options` is only allowed when `stream` is true", "stream_options"
        )


def _check_chat(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise bad_request("`messages` must contain at least one message", "messages")
    for i, message in enumerate(req.messages):
        if message.tool_calls and message.role != "assistant":
            raise bad_request(
                f"only assistant messages carry `tool_calls`, not a {message.role} message",
                f"messages[{i}].tool_calls",
            )
        if message.role == "tool" and not message.tool_call_id:
            raise bad_request(
                "a tool message needs the `tool_call_id` of the call it answers",
                f"messages[{i}].tool_call_id",
            )
        if message.content is None and message.role != "assistant":
            raise bad_request(
                f"a {message.role} message needs `content` (a string or a list of text parts)",
                f"messages[{i}].content",
            )
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"only text content parts are supported, got type {part.type!r}",
                        f"messages[{i}].content[{j}]",
                    )
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")


def _check_completion(req: CompletionRequest) -> None:
    if req.echo:
        raise bad_request("`echo` is not supported", "echo")
    if req.suffix:
        raise bad_request("`suffix` is not supported", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`logprobs` must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")


def structured_output(req: ChatCompletionRequest | CompletionRequest) -> tuple[StructuredOutput, str] | None:
    """The request's output constraint and the parameter that set it, or None for free text.
    Only the shape is checked here; the router compiles the constraint (RouterService)."""
    found: list[tuple[StructuredOutput, str]] = []
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.guided_json is not None:
        found.append((_json_spec(req.guided_json), "guided_json"))
    if req.guided_regex is not None:
        found.append((StructuredOutput("regex", req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append((StructuredOutput("choice", msgspec.json.encode(req.guided_choice).decode()), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((StructuredOutput("grammar", req.guided_grammar), "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        given = [(name, v) for name in ("json", "regex", "choice", "grammar", "json_object")
                 if (v := getattr(so, name)) is not None and v is not False]
        if len(given) > 1:
            raise bad_request(f"`{param}` takes one constraint, got {', '.join(n for n, _ in given)}", param)
        if given:
            name, value = given[0]
            param = f"structured_outputs.{name}"
            if name == "json":
                spec = _json_spec(value)
            elif name == "choice":
                spec = StructuredOutput("choice", msgspec.json.encode(value).decode())
            elif name == "json_object":
                spec = StructuredOutput("json_object")
            else:
                spec = StructuredOutput("regex" if name == "regex" else "grammar", value)
            found.append((spec, param))
    if len(found) > 1:
        raise bad_request(
            f"only one output constraint may be set, got {' and '.join(f'`{p}`' for _, p in found)}",
            found[1][1],
        )
    return found[0] if found else None


def _json_spec(schema: Any) -> StructuredOutput:
    if isinstance(schema, str):
        return StructuredOutput("json_schema", schema)
    return StructuredOutput("json_schema", msgspec.json.encode(schema).decode())


def _response_format(rf: dict[str, Any]) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request('`response_format` {"type": "json_schema"} needs a `json_schema` object',
                              "response_format")
        schema = js.get("schema", {})  # no schema: any JSON value
        if not isinstance(schema, dict):
            raise bad_request("`response_format.json_schema.schema` must be a JSON schema object",
                              "response_format")
        if "strict" in js and not isinstance(js["strict"], bool | None):
            raise bad_request("`response_format.json_schema.strict` must be a boolean", "response_format")
        return _json_spec(schema)
    raise bad_request(
        f'`response_format` type must be "text", "json_object" or "json_schema", got {kind!r}',
        "response_format",
    )


def stop_strings(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def message_text(message: ChatMessage) -> str | None:
    """A message's content as one string (text parts joined), as chat templates expect."""
    if isinstance(message.content, list):
        return "".join(part.text or "" for part in message.content)
    return message.content


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completions request: a string or a list of token ids."""
    prompt: Any = req.prompt
    # OpenAI also accepts a batch ([str] or [[int]]); a batch of one is the same request.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("`prompt` must not be empty", "prompt")
        return prompt
    if not prompt:
        raise bad_request("`prompt` must not be empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise bad_request(
        "`prompt` must be a string or a list of token ids (one prompt per request)", "prompt"
    )


# --- responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatMessageOut(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI gives it


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatToolCallsMessageOut(msgspec.Struct):
    """An answer that made calls: `content` is the text around them, None when there is none."""

    content: str | None
    tool_calls: list[ToolCallOut]
    role: str = "assistant"
    refusal: None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut | ChatToolCallsMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed piece of a call: the first has `id`, `type` and the name, the rest arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct):
    """Both the non-streaming body and each streamed chunk of /v1/completions."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "pdserve"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def encode(obj: msgspec.Struct) -> bytes:
    return msgspec.json.encode(obj)
