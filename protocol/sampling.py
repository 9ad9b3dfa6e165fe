"""Per-request sampling parameters: one msgspec Struct used by the engine and on the wire."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

# The largest constraint text a request may carry (a schema, a regex, a grammar, the choices).
MAX_STRUCTURED_BYTES = 64 * 1024

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names it (the OpenAI error envelope's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A constraint on the output's text, compiled by each worker (text/grammar.py).

    `spec` by `kind`: json_schema: the schema as JSON text; json_object: "" (any JSON object);
    regex: the pattern; choice: a JSON list of the allowed strings; grammar: Lark or GBNF text.
    """

    kind: StructuredKind
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick each next token and when to stop. `temperature=0` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs of each sampled token (0: only the sampled one)
    structured: StructuredOutput | None = None  # constrained output (None: free text)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise SamplingParamsError naming the first bad parameter; return self when valid."""
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", f"must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.structured is not None and len(self.structured.spec.encode()) > MAX_STRUCTURED_BYTES:
            bad("structured", f"the constraint is longer than {MAX_STRUCTURED_BYTES} bytes")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"token id {t} is outside the vocabulary (size {vocab_size})")
        return self
