"""Turning choice deltas into OpenAI bodies: chat vs. completions, streamed vs. whole.

A `Renderer` is made per HTTP request. Streaming calls `start`, `chunk` per delta, and
`usage_chunk`; non-streaming feeds every delta to `add` and calls `body` at the end.
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
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    encode,
)
from pdserve.router.requests import ChoiceDelta, LogprobEntry


def make_usage(prompt: int, completion: int, cached: int | None) -> Usage:
    details = PromptTokensDetails(cached) if cached is not None else None
    return Usage(prompt, completion, prompt + completion, details)


class Renderer(ABC):
    """Formats one request's output; keeps per-choice text for the non-streaming body."""

    def __init__(
        self, request_id: str, model: str, n: int, tokenizer: Any, want_logprobs: bool
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[LogprobEntry]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n

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
        if not d.text and not d.logprobs and d.finish_reason is None:
            return None
        delta = ChatDelta(content=d.text) if d.text or d.logprobs else ChatDelta()
        return self._chunk(
            [ChatChunkChoice(d.index, delta, self._logprobs(d.logprobs), d.finish_reason)]
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def body(self, usage: Usage) -> bytes:
        choices = [
            ChatChoice(
                i,
                ChatMessageOut("".join(self.texts[i])),
                self._logprobs(self.logprobs[i]),
                self.finish[i],
            )
            for i in range(len(self.texts))
        ]
        return encode(ChatCompletion(self.request_id, self.created, self.model, choices, usage))


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
