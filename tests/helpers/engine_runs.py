"""Running an in-process Engine to completion in tests."""

from __future__ import annotations

import itertools
from collections import defaultdict

from pdserve.engine.engine import Engine
from pdserve.engine.llm import LLM
from pdserve.protocol.sampling import SamplingParams

_join_ids = itertools.count()


def greedy_tokens(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Add every prompt (greedy, exactly `max_tokens` each) and step until nothing runs or waits;
    returns each request's tokens."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.scheduler.running or engine.scheduler.waiting:
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def generate_joining(llm: LLM, prompts: list[list[int]], params: SamplingParams, first: int,
                     every: int = 2) -> list[list[int]]:
    """Drive the engine step by step: `first` prompts arrive together, then one joins every
    `every` steps, so later prompts land while earlier ones decode. Deterministic in steps."""
    return [tokens for tokens, _ in generate_joining_logprobs(llm, prompts, params, first, every)]


def generate_joining_logprobs(llm: LLM, prompts: list[list[int]], params: SamplingParams, first: int,
                              every: int = 2) -> list[tuple[list[int], list[float]]]:
    """generate_joining's runs with each request's tokens and their logprobs (`params` asking
    for logprobs; else the lists are empty)."""
    eng = llm.engine
    ids = [f"join-{next(_join_ids)}" for _ in prompts]
    tokens: dict[str, list[int]] = defaultdict(list)
    logprobs: dict[str, list[float]] = defaultdict(list)
    pending = list(zip(ids, prompts, strict=True))
    for rid, p in pending[:first]:
        eng.add_request(rid, p, params)
    pending = pending[first:]
    for step in range(10_000):
        if pending and step % every == 0:
            rid, p = pending.pop(0)
            eng.add_request(rid, p, params)
        if not eng.has_unfinished():
            break
        for out in eng.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs or [])
    assert not eng.has_unfinished(), "the engine did not drain"
    return [(tokens[rid], logprobs[rid]) for rid in ids]


class StepRecorder:
    """Stands in for torch.ops.pdserve_cpu in a model's CompiledLayers: records each step's
    (rows, decode rows) and runs the real decoder_layers_."""

    def __init__(self, ops) -> None:
        self.ops, self.steps = ops, []
        names = [a.name for a in ops.decoder_layers_.default._schema.arguments]
        self.num_decode_at = names.index("num_decode")

    def decoder_layers_(self, *args):
        self.steps.append((args[0].shape[0], args[self.num_decode_at]))
        return self.ops.decoder_layers_(*args)
