"""Turning choice deltas into OpenAI bodies: chat vs. completions, streamed vs. whole.

A `Renderer` is made per HTTP request. Streaming calls `start`, `chunk` per delta, and
`usage_chunk`; non-streaming feeds every delta to `add` and calls `body` at the end. A chat
request with tools parses each choice's text for calls (text/tool_parser.py): streamed, as the
text comes (`delta.tool_calls`); whole, over the finished text; the same either way.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from pdserve.router.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatToolCallsMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    encode,
)
from pdserve.router.requests import ChoiceDelta, LogprobEntry
from pdserve.text.tool_parser import CallPiece, ToolCallParser


def make_usage(prompt: int, completion: int, cached: int | None) -> Usage:
    details = PromptTokensDetails(cached) if cached is not None else None
    return Usage(prompt, completion, prompt + completion, details)


class Renderer(ABC):
    """Formats one request's output; keeps per-choice text for the non-streaming body."""

    def __init__(
        self, request_id: str, model: str, n: int, tokenizer: Any, want_logprobs: bool,
        tool_calls: bool = False,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[LogprobEntry]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        # One parser per choice when the output is read for tool calls (chat with tools).
        self.parsers = [ToolCallParser() for _ in range(n)] if tool_calls else None

    def piece(self, token_id: int) -> str:
        to_piece = getattr(self.tokenizer, "token_to_piece", None)
        if to_piece is not None:
            return to_piece(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def add(self, d: ChoiceDelta) -> None:
        self.texts[d.index].append(d.text)
        self.logprobs[d.index].extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason

    def start(self) -> list[bytes]:
        return []

    @abstractmethod
    def chunk(self, d: ChoiceDelta) -> bytes | None: ...

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> bytes: ...

    @abstractmethod
    def body(self, usage: Usage) -> bytes: ...


class ChatRenderer(Renderer):
    def _logprobs(self, entries: list[LogprobEntry]) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        out = []
        for e in entries:
            tok = self.piece(e.token_id)
            top = [TopLogprob(self.piece(t), lp, list(self.piece(t).encode())) for t, lp in e.top]
            out.append(ChatTokenLogprob(tok, e.logprob, list(tok.encode()), top))
        return ChatLogprobs(out)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return encode(
            ChatCompletionChunk(self.request_id, self.created, self.model, choices, usage=usage)
        )

    def start(self) -> list[bytes]:
        return [
            self._chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
            for i in range(len(self.texts))
        ]

    def chunk(self, d: ChoiceDelta) -> bytes | None:
        if self.parsers is not None:
            return self._tool_chunk(d, self.parsers[d.index])
        if not d.text and not d.logprobs and d.finish_reason is None:
            return None
        delta = ChatDelta(content=d.text) if d.text or d.logprobs else ChatDelta()
        return self._chunk(
            [ChatChunkChoice(d.index, delta, self._logprobs(d.logprobs), d.finish_reason)]
        )

    def _tool_chunk(self, d: ChoiceDelta, parser: ToolCallParser) -> bytes | None:
        parsed = parser.push(d.text)
        if d.finish_reason is not None:
            parsed += parser.finish(truncated=d.finish_reason == "length")
        calls = _call_deltas(parsed.calls)
        if not parsed.content and not calls and not d.logprobs and d.finish_reason is None:
            return None
        delta = ChatDelta(content=parsed.content or None, tool_calls=calls or None)
        finish = _finish_reason(d.finish_reason, parser)
        return self._chunk([ChatChunkChoice(d.index, delta, self._logprobs(d.logprobs), finish)])

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def body(self, usage: Usage) -> bytes:
        choices = []
        for i in range(len(self.texts)):
            message: ChatMessageOut | ChatToolCallsMessageOut = ChatMessageOut("".join(self.texts[i]))
            finish = self.finish[i]
            if self.parsers is not None:
                message, finish = self._parse_whole(i, self.parsers[i])
            choices.append(ChatChoice(i, message, self._logprobs(self.logprobs[i]), finish))
        return encode(ChatCompletion(self.request_id, self.created, self.model, choices, usage))

    def _parse_whole(
        self, i: int, parser: ToolCallParser
    ) -> tuple[ChatMessageOut | ChatToolCallsMessageOut, str | None]:
        parsed = parser.push("".join(self.texts[i]))
        parsed += parser.finish(truncated=self.finish[i] == "length")
        finish = _finish_reason(self.finish[i], parser)
        if not parser.num_calls:
            return ChatMessageOut(parsed.content), finish
        calls: list[ToolCallOut] = []
        for piece in parsed.calls:
            if piece.id is not None:
                calls.append(ToolCallOut(piece.id, FunctionCallOut(piece.name or "", "")))
            calls[piece.index].function.arguments += piece.arguments
        return ChatToolCallsMessageOut(parsed.content or None, calls), finish


def _call_deltas(pieces: list[CallPiece]) -> list[ToolCallDelta]:
    """One delta per call among `pieces` (a call's pieces in one chunk merge); a call's first
    delta carries its id, type and name, as OpenAI streams them."""
    out: dict[int, ToolCallDelta] = {}
    for p in pieces:
        d = out.get(p.index)
        if d is None:
            d = out[p.index] = ToolCallDelta(p.index, function=FunctionDelta(arguments=""))
        if p.id is not None:
            d.id, d.type = p.id, "function"
            assert d.function is not None
            d.function.name = p.name
        assert d.function is not None and d.function.arguments is not None
        d.function.arguments += p.arguments
    return list(out.values())


def _finish_reason(reason: str | None, parser: ToolCallParser) -> str | None:
    """OpenAI's `tool_calls` when an answer that stopped of itself made calls."""
    return "tool_calls" if reason == "stop" and parser.num_calls else reason


class CompletionRenderer(Renderer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets = [0] * len(self.texts)

    def _logprobs(self, index: int, entries: list[LogprobEntry]) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        tokens, offsets = [], []
        for e in entries:
            tok = self.piece(e.token_id)
            tokens.append(tok)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(tok)
        top = [{self.piece(t): lp for t, lp in e.top} for e in entries]
        return CompletionLogprobs(tokens, [e.logprob for e in entries], top, offsets)

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return encode(Completion(self.request_id, self.created, self.model, choices, usage=usage))

    def chunk(self, d: ChoiceDelta) -> bytes | None:
        if not d.text and not d.logprobs and d.finish_reason is None:
            return None
        return self._completion(
            [
                CompletionChoice(
                    d.index, d.text, self._logprobs(d.index, d.logprobs), d.finish_reason
                )
            ]
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._completion([], usage)

    def body(self, usage: Usage) -> bytes:
        choices = [
            CompletionChoice(
                i, "".join(self.texts[i]), self._logprobs(i, self.logprobs[i]), self.finish[i]
            )
            for i in range(len(self.texts))
        ]
        return self._completion(choices, usage)
