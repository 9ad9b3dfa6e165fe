"""oneDNN-packed projections (model/llama.py Linear.pack_onednn): the same numbers as the plain
matmul, packed by default on the CPU, and off with PDSERVE_CPU_LINEAR=mkl; greedy output of a
whole engine is the same either way."""

from __future__ import annotations

import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.llama import CPU_LINEAR_ENV, Linear, onednn_linear_available
from pdserve.protocol.sampling import SamplingParams


def test_this_torch_build_packs_float32_linears_for_onednn():
    """The CPU build the project installs ships oneDNN: the packed path is the one that runs."""
    assert onednn_linear_available(torch.float32)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_packed_linear_computes_the_plain_matmul(rows):
    torch.manual_seed(rows)
    lin = Linear(96, 160)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(rows, 200)[:, :96]  # strided rows, as a slice of a fused projection
    with torch.inference_mode():
        plain = lin(x)
        lin.pack_onednn()
        packed = lin(x)
    assert lin.packed is not None and packed.shape == (rows, 160)
    torch.testing.assert_close(packed, x @ lin.weight.t(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-5)


def greedy(tiny, monkeypatch, mode):
    monkeypatch.setenv(CPU_LINEAR_ENV, mode)
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32"), loaded=tiny)
    prompts = {f"r{i}": [3 + i, 17, 42 + 5 * i, 9, 100 + i] for i in range(4)}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.scheduler.running or engine.scheduler.waiting:
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return engine, out


def test_the_engine_packs_on_cpu_by_default_and_mkl_turns_it_off(tiny, monkeypatch):
    packed_engine, packed = greedy(tiny, monkeypatch, "onednn")
    plain_engine, plain = greedy(tiny, monkeypatch, "mkl")
    assert packed_engine.runner.cpu_linear == "onednn"
    assert all(m.packed is not None for m in packed_engine.runner.model.modules() if isinstance(m, Linear))
    assert plain_engine.runner.cpu_linear == "mkl"
    assert all(m.packed is None for m in plain_engine.runner.model.modules() if isinstance(m, Linear))
    assert all(len(v) == 12 for v in packed.values())
    assert packed == plain
