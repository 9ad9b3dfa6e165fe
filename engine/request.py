"""A request as the scheduler sees it: its tokens, how many are computed, its blocks, its status.

    token_ids   = prompt_token_ids + output_token_ids
    0 .............. num_computed_tokens-1 | num_computed_tokens ......... num_tokens-1
    K/V in the cache                       | still to compute (a prefill chunk, or 1 for decode)

A step computes some of the uncomputed tokens; when it computes the last one the request samples
its next token. Pre-emption drops the blocks and resets num_computed_tokens to 0 (recompute).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.protocol.sampling import SamplingParams
from pdserve.text.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, by index
    num_committed_blocks: int = 0  # blocks whose hash is registered in the pool
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # Structured output: the grammar's state after every output token (advanced by append_token).
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is still to compute (a prompt, or a recompute)."""
        return self.num_uncomputed_tokens > 1 or self.num_computed_tokens == 0

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling.max_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.advance(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status after the latest sampled token, or None to go on. A complete
        grammar stops the request (min_tokens cannot extend it); a failed one errs (`error`)."""
        n_out = self.num_output_tokens
        last = self.token_ids[-1]
        if self.grammar is not None and self.grammar.done:
            self.error = self.grammar.error
            if self.error is not None:
                self.error = f"structured output failed: {self.error}"
                return RequestStatus.FINISHED_ERROR
            return RequestStatus.FINISHED_STOPPED
        if n_out >= self.sampling.min_tokens:
            if last in self.sampling.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not self.sampling.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.sampling.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
