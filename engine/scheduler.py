"""Iteration-level scheduling by token accounting.

Each request knows how many of its tokens are computed; each step hands out a token budget
(`max_num_batched_tokens`) across at most `max_num_seqs` running requests. Policies
(engine/policies.py) differ only in how they spend the budget; the mechanics they share —
admission with prefix-cache lookup, block growth with pre-emption, post-step bookkeeping — live
here. `schedule()` then `update()` once per step; `abort()` at any time.

KV that enters or leaves (a disaggregated worker's hand-off) goes through the KV connector
(engine/kv_connector.py): admission asks it how many tokens arrive with their KV, and a finished
request's blocks are freed or, when it says so, held until it releases them. Nothing here knows
which kind of worker it runs in.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorScheduler, NoConnector
from pdserve.engine.request import Request, RequestStatus
from pdserve.protocol.block_hash import ROOT, hash_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    waiting_served_ratio: float = 0.0


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: which tokens of which requests to compute. Decodes are 1 token each."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # could not be admitted (finished, error)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    kv: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    # Pipelined prompt chunks that sample nothing: their computed count went forward at launch
    # (Scheduler.launched), so update() does not add them again.
    advanced: set[Request] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def empty(self) -> bool:
        return not self.scheduled

    def drop(self, req: Request) -> int:
        """Take `req` out of the plan; the number of its tokens that were in it (0: none)."""
        for i, s in enumerate(self.scheduled):
            if s.request is req:
                del self.scheduled[i]
                if req.is_prefilling:
                    self.num_prefill_tokens -= s.num_new_tokens
                else:
                    self.num_decode_tokens -= s.num_new_tokens
                return s.num_new_tokens
        return 0


class Step:
    """The step being built: budgets left and what is in it so far."""

    def __init__(self, token_budget: int) -> None:
        self.tokens_left = token_budget
        self.out = SchedulerOutput()
        self.ids: set[str] = set()

    def add(self, req: Request, n: int) -> None:
        self.out.scheduled.append(ScheduledRequest(req, n))
        self.ids.add(req.request_id)
        self.tokens_left -= n
        if req.is_prefilling:
            self.out.num_prefill_tokens += n
        else:
            self.out.num_decode_tokens += n

    def remove(self, req: Request) -> None:
        self.tokens_left += self.out.drop(req)
        self.ids.discard(req.request_id)


class Scheduler:
    """Owns the waiting queue, the running list (admission order) and every request's blocks."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, policy,
                 connector: KVConnectorScheduler | None = None) -> None:
        policy.check_token_budget(config.max_num_batched_tokens, config.max_model_len)
        self.config = config
        self.pool = pool
        self.policy = policy
        self.connector = connector or NoConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request not finished, and the held ones
        self.held: dict[str, Request] = {}  # finished here; the connector owns their blocks
        # Requests whose structured-output matcher is still compiling (off the engine loop): not
        # schedulable yet; `ready` moves one to `waiting`.
        self.compiling: dict[str, Request] = {}
        self.num_preemptions = 0
        # Pipeline parallelism (engine/pipeline.py): up to `micro_batches` steps in flight. A
        # request whose in-flight step samples for it is `awaiting` (no new step takes it until
        # update()); `in_flight` counts each request's steps in flight (never pre-empted: a
        # later stage still writes its blocks).
        self.micro_batches = 1
        self.awaiting: set[Request] = set()
        self.in_flight: dict[Request, int] = {}
        self._num_hidden = 0  # running requests kept out of the step being built

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Request, ready: bool = True) -> None:
        """Queue a request; one not `ready` waits in `compiling` until `ready(req)`."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if ready:
            self.waiting.append(req)
        else:
            self.compiling[req.request_id] = req

    def ready(self, req: Request) -> None:
        """A compiling request may be scheduled now (no-op if it was aborted meanwhile)."""
        if self.compiling.pop(req.request_id, None) is not None:
            self.waiting.append(req)

    def fail_compiling(self, req: Request, error: str) -> bool:
        """Finish a compiling request with `error`; False if it is no longer compiling."""
        if req.request_id not in self.compiling:
            return False
        req.error = error
        self._finish(req, RequestStatus.FINISHED_ERROR, KVConnectorMetadata())
        return True

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the requests as aborted and free all they hold; unknown ids are ignored."""
        out = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if rid in self.held:
                self._release(rid)
                req.status = RequestStatus.FINISHED_ABORTED
            else:
                self._finish(req, RequestStatus.FINISHED_ABORTED, KVConnectorMetadata())
            out.append(req)
        return out

    def fail(self, out: SchedulerOutput, failures: dict[str, str]) -> list[Request]:
        """Take requests out of this step's plan and finish them with an error (e.g. their KV
        could not be loaded); returns them."""
        failed = [req for req, _ in out.scheduled if req.request_id in failures]
        for req in failed:
            out.drop(req)
            req.error = failures[req.request_id]
            self._finish(req, RequestStatus.FINISHED_ERROR, out.kv)
        return failed

    def reclaim(self) -> None:
        """Free the blocks of held requests the connector has released."""
        for rid in self.connector.take_released():
            self._release(rid)

    def _release(self, request_id: str) -> None:
        req = self.held.pop(request_id, None)
        if req is not None:
            self.requests.pop(request_id, None)
            self.pool.free(req.block_ids)
            req.block_ids = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.compiling)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.num_uncomputed_tokens for r in self.waiting)

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = Step(self.config.max_num_batched_tokens)
        if self.micro_batches == 1:
            self.policy.schedule(self, step)
            return step.out
        # Micro-batches: the policy sees the running requests that may join this one, and
        # decides as it always does. Out of it: those awaiting a sample, and decodes beyond this
        # micro-batch's share (1/N of them, so that N micro-batches in flight carry alike).
        everyone = self.running
        hidden = self._kept_out(everyone)
        self.running = [r for r in everyone if r not in hidden]
        self._num_hidden = len(hidden)
        try:
            self.policy.schedule(self, step)
        finally:
            visible, before = set(self.running), set(everyone)
            self.running = ([r for r in everyone if r in hidden or r in visible]
                            + [r for r in self.running if r not in before])
            self._num_hidden = 0
        return step.out

    def _kept_out(self, running: list[Request]) -> set[Request]:
        decoding = [r for r in running if not r.is_prefilling]
        share = -(-len(decoding) // self.micro_batches)
        out = set(self.awaiting)
        free = [r for r in decoding if r not in out]
        out.update(free[share:])
        return out

    def launched(self, out: SchedulerOutput) -> None:
        """A step went into the pipeline: its requests are in flight; a prompt chunk that samples
        nothing counts as computed now (its next chunk may follow it down the pipeline at once),
        a request that samples waits for update()."""
        for req, n in out.scheduled:
            self.in_flight[req] = self.in_flight.get(req, 0) + 1
            if req.num_computed_tokens + n < req.num_tokens:
                req.num_computed_tokens += n
                out.advanced.add(req)
            else:
                self.awaiting.add(req)

    def _landed(self, req: Request, sampled: bool) -> None:
        count = self.in_flight.pop(req, 0)
        if count > 1:
            self.in_flight[req] = count - 1
        if sampled:
            self.awaiting.discard(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, commit full blocks to the prefix cache, append sampled tokens.

        Returns the requests that finished in this step (the connector may hold their blocks:
        see `held`, and the saves in `out.kv`).
        """
        finished = []
        for req, n in out.scheduled:
            if self.in_flight:
                self._landed(req, req not in out.advanced)
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if req not in out.advanced:
                req.num_computed_tokens += n
            self._commit_blocks(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            status = req.check_stop(self.config.max_model_len)
            if status is not None:
                self._finish(req, status, out.kv)
                finished.append(req)
        return finished

    # --- mechanics the policies share ------------------------------------------------------
    def schedule_running(self, step: Step, req: Request, n: int) -> bool:
        """Put n more tokens of a running request in the step, pre-empting newer requests for blocks."""
        need = self._blocks_needed(req, n)
        while need > self.pool.num_available:
            victim = self._victim()
            if victim is None:  # all the others are in flight: next step
                return False
            self.preempt(victim, step)
            if victim is req:
                return False
        if need:
            req.block_ids.extend(self.pool.allocate(need))
        step.add(req, n)
        return True

    def _victim(self) -> Request | None:
        """The newest running request not in flight (None: every one is)."""
        if not self.in_flight:
            return self.running[-1]
        return next((r for r in reversed(self.running) if r not in self.in_flight), None)

    def try_admit(self, step: Step, req: Request, n_max: int) -> int:
        """Admit the waiting request at the head of the queue with up to n_max tokens; 0 if not."""
        if len(self.running) + self._num_hidden >= self.config.max_num_seqs:
            return 0
        hits: list[int] = []
        external = 0
        if req.num_computed_tokens == 0 and not req.block_ids:
            external = self.connector.num_external_tokens(req)
            if not external:
                self._extend_hashes(req)
                # Always leave at least one token to compute: its logits give the next token.
                usable = (req.num_tokens - 1) // self.pool.block_size
                hits = self.pool.lookup(req.block_hashes[:usable])
        computed = external or (len(hits) * self.pool.block_size if hits else req.num_computed_tokens)
        n = min(req.num_tokens - computed, n_max)
        if n <= 0:
            return 0
        blocks_total = -(-(computed + n) // self.pool.block_size)
        set_aside = self.connector.num_set_aside(req) if external else 0
        new = blocks_total - len(hits) - len(req.block_ids) - set_aside
        evictable_hits = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        if new > self.pool.num_available - evictable_hits:
            return 0
        try:
            if hits:
                self.pool.touch(hits)
                req.block_ids = list(hits)
                req.num_computed_tokens = computed
                req.num_committed_blocks = len(hits)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = computed
            if set_aside:  # the request's first blocks, some of its KV already in them
                req.block_ids = self.connector.adopt_blocks(req)
            if new > 0:
                req.block_ids.extend(self.pool.allocate(new))
            if external:
                req.num_computed_tokens = external
                n_load = -(-external // self.pool.block_size)
                self.connector.on_allocated(req, req.block_ids[:n_load], external, step.out.kv)
        except Exception as exc:  # roll the admission back; the request fails, nothing leaks
            log.exception("request %s: admission failed", req.request_id)
            self.pool.free(req.block_ids)
            req.block_ids, req.num_computed_tokens, req.num_committed_blocks = [], 0, 0
            req.error = f"admission failed: {exc}"
            self._finish(req, RequestStatus.FINISHED_ERROR, step.out.kv)
            step.out.failed.append(req)
            return 0
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.add(req, n)
        return n

    def preempt(self, req: Request, step: Step) -> None:
        """Drop a running request's blocks and queue it first: for recompute, or, when the
        connector keeps its KV (offloaded before this step runs), to load it back."""
        step.remove(req)
        step.out.kv.loads = [load for load in step.out.kv.loads if load.request_id != req.request_id]
        self.running.remove(req)
        kept = self.connector.request_preempted(req, step.out.kv)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_committed_blocks = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        step.out.preempted.append(req)
        if (not self.running and not self._num_hidden and not self.in_flight
                and self._blocks_needed(req, req.num_tokens) > self.pool.num_available):
            # Alone and still too big for the whole cache: waiting would deadlock; end it visibly.
            log.warning("request %s: KV cache too small to continue; finishing with 'length'", req.request_id)
            self._finish(req, RequestStatus.FINISHED_LENGTH, step.out.kv)
            return
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        log.info("request %s pre-empted (%s %d tokens)", req.request_id,
                 "KV offloaded for" if kept else "recompute", req.num_tokens)

    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, -(-(req.num_computed_tokens + n) // self.pool.block_size) - len(req.block_ids))

    def _extend_hashes(self, req: Request) -> None:
        parent = req.block_hashes[-1] if req.block_hashes else ROOT
        req.block_hashes.extend(hash_blocks(req.token_ids, self.pool.block_size, len(req.block_hashes), parent))

    def _commit_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.pool.block_size
        if full <= req.num_committed_blocks:
            return
        self._extend_hashes(req)
        for i in range(req.num_committed_blocks, full):
            self.pool.commit(req.block_ids[i], req.block_hashes[i])
        req.num_committed_blocks = full

    def _finish(self, req: Request, status: RequestStatus, meta: KVConnectorMetadata) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req.request_id in self.compiling:
            del self.compiling[req.request_id]
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.policy.on_finish(req)
        req.status = status
        if self.connector.request_finished(req, meta):
            self.held[req.request_id] = req
            return
        self.pool.free(req.block_ids)
        req.block_ids = []
        self.requests.pop(req.request_id, None)
