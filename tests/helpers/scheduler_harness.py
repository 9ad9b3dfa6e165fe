"""A fake model for scheduler tests: deterministic tokens, no tensors, every invariant checked."""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.policies import make_policy
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.protocol.sampling import SamplingParams

EOS = 0


def fake_token(req: Request) -> int:
    """Deterministic in (request, position); never EOS so lengths are what the test asked."""
    return 1 + (hash((req.request_id, req.num_tokens)) % 97)


class Sim:
    """Drives a Scheduler with a fake runner and checks invariants after every step."""

    def __init__(self, policy: str, *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 32, max_model_len: int = 64, prefix_caching: bool = True,
                 ratio: float = 0.0) -> None:
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        pol = make_policy(policy)
        max_num_batched_tokens = pol.token_budget(max_num_batched_tokens, max_model_len)
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, ratio)
        self.sched = Scheduler(self.config, self.pool, pol)
        self.steps: list[SchedulerOutput] = []
        self.finished: dict[str, Request] = {}
        self.all: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), (EOS,))
        self.sched.add_request(req)
        self.all[rid] = req
        return req

    def abort(self, rid: str) -> None:
        for r in self.sched.abort([rid]):
            self.finished[r.request_id] = r
        self.check()

    def step(self) -> SchedulerOutput:
        decoding_before = [r for r in self.sched.running if not r.is_prefilling]
        out = self.sched.schedule()
        self.last_decoding_before = decoding_before
        assert out.num_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        assert len(self.sched.running) <= self.config.max_num_seqs, "sequence budget exceeded"
        for req, n in out.scheduled:
            assert 0 < n <= req.num_uncomputed_tokens
            needed = -(-(req.num_computed_tokens + n) // self.pool.block_size)
            assert len(req.block_ids) >= needed, "scheduled without the blocks it writes"
        sampled = {req.request_id: fake_token(req) for req, n in out.scheduled
                   if req.num_computed_tokens + n == req.num_tokens}
        for r in self.sched.update(out, sampled):
            self.finished[r.request_id] = r
        for r in out.preempted:
            if r.status.finished:
                self.finished[r.request_id] = r
        self.steps.append(out)
        self.check()
        return out

    def check(self) -> None:
        self.pool.check_integrity()
        held = {}
        for r in self.sched.running + list(self.sched.waiting):
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count[b] == held.get(b, 0), f"block {b}: ref {self.pool.ref_count[b]} != holders {held.get(b, 0)}"

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("scheduler made no progress (livelock or deadlock)")

    def statuses(self) -> set[RequestStatus]:
        return {r.status for r in self.all.values()}
