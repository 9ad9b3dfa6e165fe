"""Batching policies: how one step's token budget is spent. Each reproduces a system.

    static         request-level batching (Triton + FasterTransformer)
    prefill-first  vLLM v0: a step is all-prefill or all-decode; waiting prompts pre-empt decode
    mixed          Orca: decodes and whole prompts share a step
    chunked        Sarathi-Serve stall-free batching: decodes first, prompt chunks fill the rest
    decode-only    a disaggregated decode worker: requests arrive prefilled; steps are decodes

`waiting_served_ratio` (TGI) gates prefill-first and mixed: new prompts interrupt or join the
running decodes only when waiting >= ratio * running (0: always).
Non-chunked policies admit whole prompts, so their token budget must cover max_model_len.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.config import names
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, Step


class Policy(ABC):
    name = "abstract"
    chunks_prompts = False

    def token_budget(self, budget: int, max_model_len: int) -> int:
        """The step budget this policy runs with: a whole-prompt policy must fit any prompt."""
        return budget if self.chunks_prompts else max(budget, max_model_len)

    def check_token_budget(self, budget: int, max_model_len: int) -> None:
        if self.token_budget(budget, max_model_len) != budget:
            raise ValueError(
                f"policy {self.name!r} admits whole prompts, so max_num_batched_tokens "
                f"({budget}) must be at least max_model_len ({max_model_len})"
            )

    @abstractmethod
    def schedule(self, s: Scheduler, step: Step) -> None:
        """Fill `step` from s.running and s.waiting, using the scheduler's shared mechanics."""

    def on_finish(self, req: Request) -> None:
        """A request left (finished or aborted)."""

    # -- building blocks ----------------------------------------------------------------------
    @staticmethod
    def schedule_decodes(s: Scheduler, step: Step) -> None:
        for req in list(s.running):
            if req in s.running and not req.is_prefilling and step.tokens_left >= 1:
                s.schedule_running(step, req, 1)

    @staticmethod
    def schedule_prefill_chunks(s: Scheduler, step: Step) -> None:
        """Running requests part-way through a prompt get the next chunk that fits."""
        for req in list(s.running):
            if req in s.running and req.is_prefilling and req.request_id not in step.ids and step.tokens_left > 0:
                s.schedule_running(step, req, min(req.num_uncomputed_tokens, step.tokens_left))

    @staticmethod
    def admit_waiting(s: Scheduler, step: Step, chunk: bool, only=None) -> None:
        """FCFS from the head of the queue; stop at the first that cannot start (no overtaking)."""
        while s.waiting and step.tokens_left > 0:
            req = s.waiting[0]
            if only is not None and req.request_id not in only:
                return
            n_max = step.tokens_left if chunk else req.num_uncomputed_tokens
            if not chunk and n_max > step.tokens_left:
                return
            if s.try_admit(step, req, n_max) == 0:
                return

    @staticmethod
    def prompts_may_interrupt(s: Scheduler) -> bool:
        running = len(s.running)
        return running == 0 or len(s.waiting) >= s.config.waiting_served_ratio * running


class ChunkedPolicy(Policy):
    name = names.CHUNKED
    chunks_prompts = True

    def schedule(self, s: Scheduler, step: Step) -> None:
        self.schedule_decodes(s, step)
        self.schedule_prefill_chunks(s, step)
        self.admit_waiting(s, step, chunk=True)


class MixedPolicy(Policy):
    name = names.MIXED

    def schedule(self, s: Scheduler, step: Step) -> None:
        self.schedule_decodes(s, step)
        if self.prompts_may_interrupt(s):
            self.admit_waiting(s, step, chunk=False)


class PrefillFirstPolicy(Policy):
    name = names.PREFILL_FIRST

    def schedule(self, s: Scheduler, step: Step) -> None:
        if s.waiting and self.prompts_may_interrupt(s):
            self.admit_waiting(s, step, chunk=False)
            if not step.out.empty:
                return
        self.schedule_decodes(s, step)


class StaticPolicy(Policy):
    """A batch forms only when the previous one has fully drained; nobody joins it midway."""

    name = names.STATIC

    def __init__(self) -> None:
        self.batch: set[str] = set()

    def schedule(self, s: Scheduler, step: Step) -> None:
        if not self.batch:
            self.batch = {r.request_id for r in list(s.waiting)[: s.config.max_num_seqs]}
        # Members not running yet (the batch's first step, or pre-empted ones) prefill first.
        if any(r.request_id in self.batch for r in s.waiting):
            self.admit_waiting(s, step, chunk=False, only=self.batch)
            if not step.out.empty:
                return
        self.schedule_decodes(s, step)

    def on_finish(self, req: Request) -> None:
        self.batch.discard(req.request_id)


class DecodeOnlyPolicy(Policy):
    """Disaggregated decode: requests arrive with their KV; every step is decode tokens only."""

    name = names.DECODE_ONLY
    chunks_prompts = True

    def schedule(self, s: Scheduler, step: Step) -> None:
        self.schedule_decodes(s, step)
        # Recomputes (a pre-empted request, or a whole prompt when no prefill worker is left) run
        # in chunks like the chunked policy's: a chunk admitted in one step goes on in the next.
        self.schedule_prefill_chunks(s, step)
        self.admit_waiting(s, step, chunk=True)  # admits prefilled arrivals (1 token) and recomputes


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (StaticPolicy, PrefillFirstPolicy, MixedPolicy, ChunkedPolicy, DecodeOnlyPolicy)
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
