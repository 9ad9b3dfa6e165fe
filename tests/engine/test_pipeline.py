"""Pipeline stages (engine/pipeline.py): the same greedy tokens as one stage and as transformers,
under every colocated policy, through KV hand-offs between stage counts, with the prefix cache;
the KV blocks across stages; a stage's death."""

from __future__ import annotations

import os
import signal
import time
from array import array

import pytest
import torch

from pdserve.config.engine import ConfigError, EngineConfig
from pdserve.config.names import CHUNKED, MIXED, PREFILL_FIRST, STATIC
from pdserve.engine.engine import Engine
from pdserve.engine.pipeline import (
    PipelineBroken,
    decode_step,
    encode_step,
    split_layers,
    stage_cores,
    step_body_size,
)
from pdserve.engine.runner import PackedStep
from pdserve.model.weights import load_model
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.engine_runs import greedy_tokens
from tests.helpers.kv_pair import Pair
from tests.helpers.tiny_llama import make_tiny_llama_dir
from tests.helpers.tiny_models import hf_model

PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 900 + 10 for j in range(20 + 9 * i)] for i in range(5)}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pp_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("pp"), num_layers=4, seed=3)


@pytest.fixture(scope="module")
def loaded(pp_dir):
    return load_model(str(pp_dir))


@pytest.fixture
def engines(pp_dir, loaded):
    """make(stages, **config) -> an Engine; every one is closed (its stages stopped) after the test."""
    made: list[Engine] = []

    def make(stages: int = 1, **kw) -> Engine:
        cfg = EngineConfig(**{"model": str(pp_dir), "dtype": "float32", "num_kv_blocks": 96,
                              "max_num_batched_tokens": 32, "pipeline_parallel_size": stages, "pp_pin": False, **kw})
        engine = Engine(cfg, loaded)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(scope="module")
def oracle(pp_dir):
    """transformers' greedy continuation of each prompt."""
    model = hf_model(pp_dir)
    out = {}
    with torch.no_grad():
        for rid, prompt in PROMPTS.items():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS, pad_token_id=0)
            out[rid] = ids[0, len(prompt):].tolist()
    return out


def test_split_layers():
    assert [(s.start, s.end) for s in split_layers(30, 2)] == [(0, 15), (15, 30)]
    # Uneven: the first stage (which also runs the LM head) takes the smaller share.
    assert [(s.start, s.end) for s in split_layers(7, 3)] == [(0, 2), (2, 4), (4, 7)]
    assert [(s.start, s.end) for s in split_layers(30, 2, "11,19")] == [(0, 11), (11, 30)]
    first, last = split_layers(4, 2)
    assert first.first and not first.last and last.last and not last.first
    for bad in ("10,10", "30", "0,30"):
        with pytest.raises(ValueError):
            split_layers(30, 2, bad)
    with pytest.raises(ValueError):
        split_layers(2, 3)
    with pytest.raises(ConfigError):
        EngineConfig(pipeline_parallel_size=2, pp_layer_split="1,2,3")
    with pytest.raises(ConfigError, match="CUDA"):  # said at start, not a failed first step
        EngineConfig(pipeline_parallel_size=2, device="cuda")


def test_stage_cores():
    assert stage_cores([0, 1], 2) == [[0], [1]]
    assert stage_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3, 4]]
    assert stage_cores([0], 2) == [None, None]  # fewer cores than stages: they share


def test_step_on_the_wire():
    step = PackedStep(array("q", [5, 6, 7]), array("q", [0, 1, 9]), array("q", [16, 17, 41]), array("i", [2, 10]),
                      array("i", [0, 1]), array("i", [1, 0, 2, 3]), 2, 1, array("q", [0, 2]), [])
    header, body = encode_step(9, step)
    assert body.numel() == step_body_size(header)
    back = decode_step(header, body)
    assert int(header[1]) == 9
    for name in ("positions", "slots", "seq_lens", "cu", "tables", "sample_rows"):
        assert list(getattr(back, name)) == list(getattr(step, name)), name
    assert (back.width, back.num_decode_rows, back.num_tokens) == (2, 1, 3)


@pytest.mark.parametrize("policy", [CHUNKED, MIXED, PREFILL_FIRST, STATIC])
def test_policies_match_one_stage_and_the_oracle(engines, oracle, policy):
    budget = 32 if policy == CHUNKED else 2048
    one = greedy_tokens(engines(1, policy=policy, max_num_batched_tokens=budget), PROMPTS, MAX_TOKENS)
    two_engine = engines(2, policy=policy, max_num_batched_tokens=budget)
    two = greedy_tokens(two_engine, PROMPTS, MAX_TOKENS)
    assert two == one
    assert two == oracle
    # Both stages did work, and every block came back.
    stats = two_engine.stage_stats()
    assert stats is not None and all(b > 0 for b in stats["busy_seconds"])
    assert two_engine.pool.num_used == 0 and two_engine.pool.num_available == two_engine.pool.num_blocks


def test_three_stages_uneven(engines, oracle):
    engine = engines(3, pp_layer_split="1,2,1")
    assert greedy_tokens(engine, PROMPTS, MAX_TOKENS) == oracle


def test_micro_batches_overlap(engines):
    """Two micro-batches are in flight: a step launches while the previous is in stage 1, and
    the decodes split between them."""
    engine = engines(2)
    pipe = engine.pipeline
    assert pipe is not None
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    in_flight_at_collect = []
    collect = pipe.collect

    def counting(mb):
        in_flight_at_collect.append(len(engine._in_flight) + 1)  # the one being collected is out already
        # A request is never awaiting a sample in two micro-batches.
        sampling = [s.request for out, _, _ in engine._in_flight for s in out.scheduled if s.request not in out.advanced]
        assert len(sampling) == len(set(sampling))
        return collect(mb)

    pipe.collect = counting  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    assert max(in_flight_at_collect) == 2
    decode_steps = [s for s in engine.counters.recent_steps if s.num_prefill_tokens == 0]
    assert decode_steps and max(s.batch_size for s in decode_steps) <= -(-len(PROMPTS) // 2)


def test_prefix_cache_hit(engines, oracle):
    engine = engines(2)
    first = greedy_tokens(engine, {"a": PROMPTS["r4"]}, MAX_TOKENS)
    again = greedy_tokens(engine, {"b": PROMPTS["r4"]}, MAX_TOKENS)
    assert first["a"] == again["b"] == oracle["r4"]
    assert engine.counters.prefill_tokens < 2 * len(PROMPTS["r4"])  # the second prompt hit the cache


def test_blocks_across_stages(engines):
    one, two = engines(1), engines(2)
    for engine in (one, two):
        engine.add_request("x", PROMPTS["r3"], SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    ids = list(range(4))  # the prompt's blocks: freed (cached), their KV still there
    assert torch.equal(two.runner.read_blocks(ids), one.runner.read_blocks(ids))
    payload = torch.randn_like(one.runner.read_blocks([10, 11, 12]))
    two.runner.write_blocks([12, 10, 11], payload)
    assert torch.equal(two.runner.read_blocks([12, 10, 11]), payload)
    with pytest.raises(ValueError):  # a payload of the wrong layer count moves nothing
        two.runner.write_blocks([1], payload[:2])


@pytest.mark.parametrize("prefill_stages,decode_stages", [(2, 1), (1, 2), (2, 2)])
def test_handoff_across_stage_counts(pp_dir, loaded, engines, oracle, prefill_stages, decode_stages):
    cfg = EngineConfig(model=str(pp_dir), dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32, pp_pin=False)
    pair = Pair(loaded, cfg, prefill_stages=prefill_stages, decode_stages=decode_stages)
    try:
        for rid, prompt in PROMPTS.items():
            pair.submit(rid, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        pair.run()
        assert pair.tokens == oracle
        assert pair.decode.pool.num_used == 0 and pair.prefill.pool.num_used == 0
        # The longer prompts span several chunks: their KV streamed in parts as each chunk landed
        # (through the prefill's stages, read from the one that computed each layer).
        assert pair.receiver.stats().get("parts_received", 0) > 0
    finally:
        pair.close()


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_a_dead_stage_breaks_the_pipeline(engines):
    engine = engines(2)
    engine.add_request("x", PROMPTS["r1"], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    stage = engine.pipeline._procs[0]  # type: ignore[union-attr]
    assert stage.pid in _children(os.getpid())
    os.kill(stage.pid, signal.SIGKILL)
    with pytest.raises(PipelineBroken):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            engine.check()
            engine.step()
    engine.close()
    assert stage.poll() is not None
    assert stage.pid not in _children(os.getpid())


def test_an_abort_while_micro_batches_are_in_flight_frees_everything(engines):
    """Requests aborted with their steps still in later stages: those steps land and are dropped,
    every block comes back, and the engine serves on."""
    engine = engines(2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    engine.step()
    assert engine._in_flight  # a micro-batch is in stage 1
    engine.abort(list(PROMPTS))
    while engine._in_flight:
        assert not any(o.new_token_ids for o in engine.step())
    assert engine.pool.num_used == 0 and not engine.scheduler.in_flight and not engine.scheduler.awaiting
    assert greedy_tokens(engine, {"after": PROMPTS["r2"]}, MAX_TOKENS)["after"] == greedy_tokens(
        engines(1), {"x": PROMPTS["r2"]}, MAX_TOKENS)["x"]
