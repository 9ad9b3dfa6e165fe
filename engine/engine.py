"""The engine loop both worker kinds run: drain inputs -> schedule -> run -> postprocess.

Roles:
    colocated  prompts in, every token out (any policy from engine/policies.py)
    prefill    prompts in, first token out; the request's blocks are then held for the hand-off
               (`take_prefilled`, `export_kv`, `release`)
    decode     prefilled requests in (`add_prefilled` with their KV), decode steps only
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, kv_block_bytes
from engine.policies import make_policy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.weights import LoadedModel, load_model

log = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


class RequestRejected(ValueError):
    """A request the engine cannot take (too long, bad parameters); `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step (or its end, with `finish_reason`)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    position: int = 0  # index in the request's output of new_token_ids[0]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepStats:
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    num_preempted: int


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps_with_prefill: int = 0
    preemptions: int = 0
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=4096))


class Engine:
    def __init__(self, config: EngineConfig, role: str = "colocated", loaded: LoadedModel | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.config = config
        self.role = role
        loaded = loaded or load_model(config.model)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.tokenizer.stop_token_ids)
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_memory_gb * 2**30) // kv_block_bytes(loaded.config, config.block_size, config.torch_dtype)
        )
        policy = make_policy("decode-only" if role == "decode" else "chunked" if role == "prefill" else config.policy)
        budget = config.max_num_batched_tokens
        if not policy.chunks_prompts and role == "colocated":
            budget = max(budget, self.max_model_len)  # whole prompts must fit one step
        self.pool = BlockPool(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=self.max_model_len,
                waiting_served_ratio=config.waiting_served_ratio,
                prefill_only=role == "prefill",
            ),
            self.pool,
            policy,
        )
        self.runner = ModelRunner(config, loaded.config, loaded.state_dict, self.max_model_len, num_blocks)
        self.counters = EngineCounters()
        self._prefilled: list[Request] = []
        log.info("engine up: role=%s policy=%s model=%s blocks=%d x %d device=%s dtype=%s",
                 role, policy.name, self.model_name, num_blocks, config.block_size, config.device, config.dtype)

    # --- requests in -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    arrival_time: float | None = None) -> Request:
        """Queue a prompt (colocated and prefill roles). Raises RequestRejected for bad input."""
        if self.role == "decode":
            raise RequestRejected("role", "a decode worker takes prefilled requests only")
        self._check(prompt_token_ids, sampling)
        req = Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids,
                      arrival_time=arrival_time or time.time())
        self.scheduler.add_request(req)
        return req

    def _check(self, prompt: list[int], sampling: SamplingParams) -> None:
        if not prompt:
            raise RequestRejected("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestRejected("prompt", f"token ids must be in [0, {vocab})")
        try:
            sampling.validate(vocab)
        except ValueError as exc:
            raise RequestRejected(getattr(exc, "param", "sampling"), str(exc)) from None
        if len(prompt) >= self.max_model_len:
            raise RequestRejected("prompt", f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len}")
        if -(-(len(prompt) + 1) // self.pool.block_size) > self.pool.num_blocks:
            raise RequestRejected("prompt", "the prompt does not fit in this worker's KV cache")

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                      sampling: SamplingParams, kv_payload: torch.Tensor, arrival_time: float | None = None) -> bool:
        """Decode role: take a request whose first `len(prompt)` tokens' KV is `kv_payload`
        ([L, 2, n, S, Hkv, D]). Returns False (nothing held) when the cache has no room now."""
        n_blocks = kv_payload.shape[2]
        if n_blocks > self.pool.num_available:
            return False
        blocks = self.pool.allocate(n_blocks)
        self.runner.kv_cache[:, :, blocks] = kv_payload.to(self.runner.kv_cache.device, self.runner.kv_cache.dtype)
        req = Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids,
                      arrival_time=arrival_time or time.time())
        req.token_ids.extend(output_token_ids)
        req.num_computed_tokens = len(prompt_token_ids)
        req.block_ids = blocks
        req.timing.token_times.extend([time.time()] * len(output_token_ids))
        self.scheduler.add_request(req)
        return True

    def abort(self, request_ids) -> list[RequestOutput]:
        done = self.scheduler.abort(request_ids)
        self._prefilled = [r for r in self._prefilled if r.status is RequestStatus.PREFILLED]
        return [RequestOutput(r.request_id, [], "abort", num_prompt_tokens=r.num_prompt_tokens) for r in done]

    # --- one step --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        start = time.time()
        out = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for r in out.preempted:
            if r.status is RequestStatus.FINISHED_LENGTH:
                outputs.append(RequestOutput(r.request_id, [], "length", num_prompt_tokens=r.num_prompt_tokens,
                                             position=r.num_output_tokens))
        if out.empty:
            return outputs
        samplers, result = self.runner.execute(out.scheduled)
        sampled = {r.request_id: t for r, t in zip(samplers, result.token_ids, strict=True)} if result else {}
        now = time.time()
        self.scheduler.update(out, sampled, now)
        for i, req in enumerate(samplers):
            if req.status is RequestStatus.FINISHED_ABORTED:
                continue
            lp = top = None
            if result is not None and result.logprobs is not None and req.sampling.logprobs is not None:
                lp, top = [result.logprobs[i]], [result.top_logprobs[i]]  # type: ignore[index]
            reason = req.status.value if req.status.finished and req.status is not RequestStatus.PREFILLED else None
            outputs.append(RequestOutput(req.request_id, [req.token_ids[-1]], reason, lp, top,
                                         req.num_prompt_tokens, req.num_cached_tokens,
                                         position=req.num_output_tokens - 1))
            if req.status is RequestStatus.PREFILLED:
                self._prefilled.append(req)
        self._record(start, now, out, len(samplers))
        return outputs

    def _record(self, start: float, end: float, out, batch: int) -> None:
        c = self.counters
        c.steps += 1
        c.prefill_tokens += out.num_prefill_tokens
        c.decode_tokens += out.num_decode_tokens
        c.steps_with_prefill += out.num_prefill_tokens > 0
        c.preemptions += len(out.preempted)
        c.recent_steps.append(StepStats(start, end - start, out.num_prefill_tokens, out.num_decode_tokens,
                                        len(out.scheduled), len(out.preempted)))

    # --- prefill hand-off ------------------------------------------------------------------
    def take_prefilled(self) -> list[Request]:
        """Prefill role: requests whose first token is out and whose KV waits to be shipped."""
        out, self._prefilled = self._prefilled, []
        return out

    def export_kv(self, req: Request) -> torch.Tensor:
        """A contiguous copy of the request's blocks: [L, 2, n, S, Hkv, D]."""
        return self.runner.kv_cache[:, :, req.block_ids].contiguous()

    def release(self, request_id: str) -> None:
        self.scheduler.release_handoff(request_id)

    # --- load ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
