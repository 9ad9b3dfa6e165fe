"""bench/engine_overhead.py's W1 line: the offline burst runs every request to its last token
through the engine's own scheduling, and its roofline is the prompts' FLOPs over the GEMM rate
plus one decode step of the whole batch per output token after the first, each bound by the
larger of its bytes over the bandwidth and its FLOPs over the GEMM rate."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import engine_overhead
from pdserve.bench.engine_overhead import Burst, burst_roofline, burst_time, step_cost
from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32", max_num_seqs=8), loaded=tiny)


def test_the_burst_runs_every_request_to_its_last_token(engine):
    finished = []
    step = engine.step

    def counting_step():
        outs = step()
        finished.extend(o.request_id for o in outs if o.finished)
        return outs

    engine.step = counting_step
    try:
        seconds = burst_time(engine, Burst(requests=3, prompt=20, output=5))
    finally:
        del engine.step
    assert seconds > 0 and sorted(finished) == ["w1-0", "w1-1", "w1-2"]
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_the_roofline_is_the_prompts_flops_then_a_decode_step_per_later_token(engine):
    burst = Burst(requests=4, prompt=32, output=6)
    prefill, decode = burst_roofline(engine, burst, gemm=1e12, bandwidth=1e11)
    assert prefill == pytest.approx(4 * step_cost(engine, 32, 1, 0, decode=False)[0] / 1e12)
    # A machine with unbounded bandwidth: every decode step bound by its FLOPs; with an unbounded
    # GEMM rate, by its bytes, which grow with the context a token a step.
    compute = sum(step_cost(engine, 4, 4, 32 + k, decode=True)[0] for k in range(1, 6)) / 1e12
    memory = sum(step_cost(engine, 4, 4, 32 + k, decode=True)[1] for k in range(1, 6)) / 1e11
    assert burst_roofline(engine, burst, gemm=1e12, bandwidth=float("inf"))[1] == pytest.approx(compute)
    assert burst_roofline(engine, burst, gemm=float("inf"), bandwidth=1e11) == (0.0, pytest.approx(memory))
    assert max(compute, memory) <= decode <= compute + memory
    assert burst_roofline(engine, Burst(requests=4, prompt=32, output=1), 1e12, 1e11)[1] == 0.0


def test_the_command_prints_and_writes_the_w1_line(tiny_dir, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    engine_overhead.main(["--model", str(tiny_dir), "--dtype", "float32", "--repeats", "1", "--prefill", "16",
                          "--w1", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "W1 offline (3 prompts of 256 tokens, 64 out" in printed
    w1 = json.loads(out.read_text())["w1"]
    assert w1["requests"] == 3 and w1["engine_s"] > 0 and w1["roofline_prefill_s"] > 0 and w1["roofline_decode_s"] > 0
