"""The engine every worker runs: schedule -> load KV -> run the model -> update; then save KV.

An engine is a policy (engine/policies.py) plus a KV connector (engine/kv_connector.py). It never
knows which kind of worker it is in: a colocated worker plugs in no connector, a prefill and a
decode worker the two halves of a hand-off (kvtransfer/connector.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pdserve.config.engine import EngineConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.device import kv_cache_blocks, weights_bytes
from pdserve.engine.kv_connector import KVConnector, KVSave, KVStream
from pdserve.engine.pipeline import MicroBatch, PipelineRunner, stage_weights
from pdserve.engine.policies import make_policy
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SampleResult
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.model.config import ModelConfig, resolve_dtype, torch_dtype
from pdserve.model.weights import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams
from pdserve.text.grammar import GrammarCompiler, GrammarError, GrammarMatcher

log = logging.getLogger(__name__)

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
    # The request's work here is done but it goes on elsewhere: the connector holds its KV.
    kv_held: bool = False
    # With `error`: the failure is this engine's alone (its KV could not be loaded), another
    # worker may serve the request (a protocol RetryCause; "" : failed for good).
    retry: str = ""

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


class EngineLoad(NamedTuple):
    """What a worker's heartbeat reports of its engine."""

    free_blocks: int
    total_blocks: int
    queued_prefill_tokens: int
    running: int
    waiting: int
    kv_resident: bool = True  # the KV cache's pages are all in (ModelRunner.kv_cache_resident)


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps_with_prefill: int = 0
    preemptions: int = 0
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=4096))


def context_length(config: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence an engine runs: the config's cap, within the model's own context."""
    return min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)


class Engine:
    """One model, its KV cache, a scheduler under a policy, and a KV connector."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 connector: KVConnector | None = None) -> None:
        config = replace(config, dtype=resolve_dtype(config.dtype, config.device))
        self.config = config
        loaded = loaded or load_model(config.model, single_use=True, keep=stage_weights(config, 0))  # its own copy: let go as it loads
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.tokenizer.stop_token_ids)
        self.max_model_len = context_length(config, loaded.config)
        dtype = torch_dtype(config.dtype)
        num_blocks = kv_cache_blocks(config, loaded.config, dtype, weights_bytes(loaded.state_dict, dtype))
        policy = make_policy(config.policy)
        self.connector = connector or KVConnector.none()
        self.pool = BlockPool(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=policy.token_budget(config.max_num_batched_tokens, self.max_model_len),
                max_model_len=self.max_model_len,
                waiting_served_ratio=config.waiting_served_ratio,
            ),
            self.pool,
            policy,
            self.connector.scheduler,
        )
        self.pipeline: PipelineRunner | None = None
        self.runner: ModelRunner | PipelineRunner
        if config.pipeline_parallel_size > 1:
            self.runner = self.pipeline = PipelineRunner(config, loaded.config, loaded.state_dict, self.max_model_len,
                                                         num_blocks, consume_weights=loaded.single_use)
            self.scheduler.micro_batches = self.pipeline.depth
        else:
            self.runner = ModelRunner(config, loaded.config, loaded.state_dict, self.max_model_len, num_blocks,
                                      consume_weights=loaded.single_use)
        self._in_flight: deque[tuple[SchedulerOutput, MicroBatch, float]] = deque()
        self.counters = EngineCounters()
        self.last_step_ran = False  # whether the last step() ran the model (a caller's idle check)
        self.grammars = GrammarCompiler(loaded.tokenizer)
        # Constraints compile here, never on the engine loop (a big schema takes a second): the
        # request waits in the scheduler's `compiling` until its matcher is ready.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._compiles: dict[str, tuple[Future[GrammarMatcher], list[int]]] = {}  # id -> (matcher, tokens so far)
        self._saves: list[KVSave] = []
        self._streams: list[KVStream] = []
        log.info("engine up: policy=%s connector=%s model=%s blocks=%d x %d device=%s dtype=%s linears=%s "
                 "deterministic=%s", policy.name, type(self.connector.scheduler).__name__, self.model_name,
                 num_blocks, config.block_size, config.device, str(self.runner.dtype).removeprefix("torch."),
                 self.runner.cpu_linear, self.runner.deterministic)

    # --- requests in -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    arrival_time: float | None = None, output_token_ids: list[int] | None = None) -> Request:
        """Queue a request; `output_token_ids` are tokens it already generated elsewhere (a
        structured output's grammar is advanced over them: the state another worker had).
        Raises RequestRejected for bad input, ValueError for an id already in use."""
        self._check(prompt_token_ids, sampling, output_token_ids or ())
        req = Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids,
                      arrival_time=arrival_time or time.time())
        req.token_ids.extend(output_token_ids or ())
        generated = list(output_token_ids or ())
        if sampling.structured is None:
            self.scheduler.add_request(req)
            return req
        cached = self.grammars.lookup(sampling.structured)
        if cached is not None:  # compiled lately: no wait
            req.grammar = self._resumed(cached, generated)
            self.scheduler.add_request(req)
            return req
        self.scheduler.add_request(req, ready=False)
        self._compiles[request_id] = (self._compiler.submit(self.grammars.compile, sampling.structured), generated)
        return req

    @staticmethod
    def _resumed(grammar: GrammarMatcher, generated: list[int]) -> GrammarMatcher:
        if not grammar.advance_all(generated) or grammar.done:
            raise RequestRejected("output_token_ids", "the tokens generated so far do not continue "
                                  f"the structured output's grammar: {grammar.error or 'it is complete'}")
        return grammar

    def _take_compiled(self) -> list[RequestOutput]:
        """Requests whose matcher is ready join the waiting queue; those whose constraint failed
        end with an error output (as a rejection at `add_request` would have)."""
        outputs: list[RequestOutput] = []
        for rid, (future, generated) in list(self._compiles.items()):
            if not future.done():
                continue
            del self._compiles[rid]
            req = self.scheduler.compiling.get(rid)
            if req is None:  # it ended meanwhile
                continue
            try:
                req.grammar = self._resumed(future.result(), generated)
            except GrammarError as exc:
                error = f"structured: invalid structured output constraint: {exc}"
            except RequestRejected as exc:
                error = f"{exc.param}: {exc}"
            else:
                self.scheduler.ready(req)
                continue
            log.info("request %s rejected: %s", rid, error)
            if self.scheduler.fail_compiling(req, error):
                outputs.append(self._ended(req))
        return outputs

    def _check(self, prompt: list[int], sampling: SamplingParams, output: Sequence[int] = ()) -> None:
        if not prompt:
            raise RequestRejected("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestRejected("prompt", f"token ids must be in [0, {vocab})")
        # Tokens generated elsewhere (migration, a KV hand-off) come from a peer too: an id the
        # embedding cannot look up would fail the whole step, every running request with it.
        if any(not 0 <= t < vocab for t in output):
            raise RequestRejected("output_token_ids", f"token ids must be in [0, {vocab})")
        num_output = len(output)
        try:
            sampling.validate(vocab)
        except ValueError as exc:
            raise RequestRejected(getattr(exc, "param", "sampling"), str(exc)) from None
        if len(prompt) + num_output >= self.max_model_len:
            raise RequestRejected("prompt", f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len}")
        if -(-(len(prompt) + num_output + 1) // self.pool.block_size) > self.pool.num_blocks:
            raise RequestRejected("prompt", "the prompt does not fit in this worker's KV cache")

    def abort(self, request_ids) -> list[RequestOutput]:
        request_ids = list(request_ids)
        for rid in request_ids:
            pending = self._compiles.pop(rid, None)
            if pending is not None:
                pending[0].cancel()  # if it has not started; a started compile just finishes
        done = self.scheduler.abort(request_ids)
        return [RequestOutput(r.request_id, [], "abort", num_prompt_tokens=r.num_prompt_tokens) for r in done]

    # --- one step --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        if self.pipeline is not None:
            return self._pipelined_step(self.pipeline)
        start = time.time()
        out, outputs = self._schedule()
        self.last_step_ran = not out.empty
        if out.empty:
            return outputs
        samplers, result = self.runner.execute(out.scheduled)
        return outputs + self._landed(out, samplers, result, start)

    def _schedule(self) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """The next step's plan, its KV offloads and loads done, and the outputs of requests
        that ended without a token."""
        compiled = self._take_compiled() if self._compiles else []
        out = self.scheduler.schedule()
        # Requests that ended without a token this step: too big for the cache, refused at admission.
        ended = [r for r in out.preempted if r.status is RequestStatus.FINISHED_LENGTH] + out.failed
        if out.kv.offloads:
            self.connector.worker.offload(out.kv.offloads, self.runner)
        load_failed: set[str] = set()
        if out.kv.loads:
            failed = self.scheduler.fail(out, self.connector.worker.load(out.kv.loads, self.runner))
            load_failed = {r.request_id for r in failed}
            ended += failed
        return out, compiled + [self._ended(r, "kv_failed" if r.request_id in load_failed else "") for r in ended]

    def _pipelined_step(self, pipe: PipelineRunner) -> list[RequestOutput]:
        """With pipeline stages: launch the next micro-batch if fewer than the pipeline's depth
        are in flight, and collect the oldest when the pipeline is full or nothing more could
        be launched. Outputs come as micro-batches land."""
        outputs: list[RequestOutput] = []
        launched = False
        if len(self._in_flight) < pipe.depth:
            start = time.time()
            out, outputs = self._schedule()
            if not out.empty:
                self._in_flight.append((out, pipe.submit(out.scheduled), start))
                self.scheduler.launched(out)
                launched = True
        collected = bool(self._in_flight) and (not launched or len(self._in_flight) >= pipe.depth)
        if collected:
            out, mb, start = self._in_flight.popleft()
            samplers, result = pipe.collect(mb)
            outputs += self._landed(out, samplers, result, start)
        self.last_step_ran = launched or collected
        return outputs

    def _landed(self, out: SchedulerOutput, samplers: list[Request], result: SampleResult | None,
                start: float) -> list[RequestOutput]:
        """A step's samples into the requests: their outputs."""
        outputs: list[RequestOutput] = []
        sampled = {r.request_id: t for r, t in zip(samplers, result.token_ids, strict=True)} if result else {}
        if result is not None and result.errors:  # no token allowed: end them, sample nothing
            failures = {samplers[i].request_id: why for i, why in result.errors.items()}
            for rid in failures:
                del sampled[rid]
            for r in self.scheduler.fail(out, failures):
                log.warning("request %s: %s", r.request_id, r.error)
                outputs.append(self._ended(r))
        now = time.time()
        self.scheduler.update(out, sampled)
        held = self.scheduler.held
        for i, req in enumerate(samplers):
            if req.status is RequestStatus.FINISHED_ABORTED or req.request_id not in sampled:
                continue
            lp = top = None
            if result is not None and result.logprobs is not None and req.sampling.logprobs is not None:
                lp, top = [result.logprobs[i]], [result.top_logprobs[i]]  # type: ignore[index]
            kv_held = req.request_id in held
            reason = req.status.value if req.status.finished and not kv_held else None
            outputs.append(RequestOutput(req.request_id, [req.token_ids[-1]], reason, lp, top,
                                         req.num_prompt_tokens, req.num_cached_tokens, error=req.error,
                                         position=req.num_output_tokens - 1, kv_held=kv_held))
        if self.connector.scheduler.streaming:  # prompt chunks that landed: their KV may leave now
            for req, _ in out.scheduled:
                if req.status is RequestStatus.RUNNING and req.request_id not in sampled:
                    self.connector.scheduler.chunk_computed(req, self._landed_tokens(req), out.kv)
        self._streams.extend(out.kv.streams)
        self._saves.extend(out.kv.saves)
        self._record(start, now, out)
        return outputs

    def _landed_tokens(self, req: Request) -> int:
        """Tokens of `req` with KV in every layer: its computed count, less the chunks of it
        still in flight through the pipeline's stages (launched ones count as computed)."""
        ahead = sum(n for out, _, _ in self._in_flight for r, n in out.scheduled if r is req and r in out.advanced)
        return req.num_computed_tokens - ahead

    def check(self) -> None:
        """Raise PipelineBroken where a pipeline stage has died (a worker's loop asks every turn)."""
        if self.pipeline is not None:
            self.pipeline.check()

    def close(self) -> None:
        """Stop the pipeline's stages, if any (an engine without stages holds no process)."""
        if self.pipeline is not None:
            self.pipeline.close()

    def stage_stats(self) -> dict | None:
        """The pipeline stages' busy and idle time and bubble fractions (None without stages)."""
        return None if self.pipeline is None else self.pipeline.timeline.describe()

    @staticmethod
    def _ended(r: Request, retry: str = "") -> RequestOutput:
        """The output of a request that ended this step without a token."""
        return RequestOutput(r.request_id, [], r.status.value, num_prompt_tokens=r.num_prompt_tokens,
                             error=r.error, position=r.num_output_tokens, retry=retry)

    def save_kv(self) -> None:
        """Hand the KV of requests held this step to the connector (after their outputs are out,
        so that a first token never waits for its KV transfer)."""
        streams, self._streams = self._streams, []
        if streams:
            self.connector.worker.stream(streams, self.runner)
        saves, self._saves = self._saves, []
        if saves:
            self.connector.worker.save(saves, self.runner)

    def reclaim(self) -> None:
        """Free the blocks the connector has released (called between steps, even when idle)."""
        self.scheduler.reclaim()

    def _record(self, start: float, end: float, out: SchedulerOutput) -> None:
        c = self.counters
        c.steps += 1
        c.prefill_tokens += out.num_prefill_tokens
        c.decode_tokens += out.num_decode_tokens
        c.steps_with_prefill += out.num_prefill_tokens > 0
        c.preemptions += len(out.preempted)
        c.recent_steps.append(StepStats(start, end - start, out.num_prefill_tokens, out.num_decode_tokens,
                                        len(out.scheduled), len(out.preempted)))

    # --- what workers report ---------------------------------------------------------------
    def request_ids(self, *, running_only: bool = False) -> list[str]:
        """Ids of the running requests, or of every request this engine still holds anything of."""
        if running_only:
            return [r.request_id for r in self.scheduler.running]
        return list(self.scheduler.requests)

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(self.pool.num_available, self.pool.num_blocks, s.num_waiting_tokens,
                          len(s.running), len(s.waiting), self.runner.kv_cache_resident)

    def cache_stats(self) -> dict[str, int]:
        p = self.pool
        return {"free_blocks": p.num_free, "cached_blocks": p.num_cached, "used_blocks": p.num_used,
                "total_blocks": p.num_blocks}
