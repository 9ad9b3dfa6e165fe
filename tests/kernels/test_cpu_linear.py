"""The CPU projections (kernels/linear.py's PanelLinear and OneDnnLinear): the compiled panel
kernel (kernels/csrc/cpu_linear.cpp, float32's default on AVX2) and oneDNN's packed matmul
compute the plain matmul, at every row count the kernel tiles differently (0, 1, a partial tile,
whole tiles, several row blocks), over output widths that are not a multiple of the panel, on
strided rows; bad inputs raise; --cpu-linear picks the path, and a whole engine's greedy output
is the same on all three."""

from __future__ import annotations

import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kernels import cpu_linear
from pdserve.kernels.linear import (
    Linear,
    OneDnnLinear,
    PanelLinear,
    onednn_linear_available,
    use_linear_method,
)
from tests.helpers.engine_runs import greedy_tokens


def test_this_torch_build_packs_float32_linears_for_onednn():
    """The CPU build the project installs ships oneDNN: the packed path is the one that runs."""
    assert onednn_linear_available(torch.float32)


def test_panels_hold_twenty_four_output_columns_each_zero_padded():
    w = torch.arange(28 * 3, dtype=torch.float32).view(28, 3)
    panels = cpu_linear.pack_weight(w)
    assert panels.shape == (2, 3, 24) and panels.is_contiguous()
    assert torch.equal(panels[0], w[:24].t())
    assert torch.equal(panels[1, :, :4], w[24:].t())
    assert not panels[1, :, 4:].any()


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 13, 61, 200])
@pytest.mark.parametrize("out_features,in_features", [(160, 96), (17, 5), (33, 1025), (1, 1)])
def test_the_compiled_linear_computes_the_plain_matmul(ops, rows, out_features, in_features):
    torch.manual_seed(rows * 7 + out_features)
    lin = Linear(in_features, out_features)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(rows, in_features + 8)[:, :in_features]  # strided rows, as a slice of a fused projection
    with torch.inference_mode():
        use_linear_method(lin, PanelLinear(ops))
        got = lin(x)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, x @ lin.weight.t(), atol=1e-4 * in_features**0.5, rtol=1e-5)


def test_the_compiled_linear_in_bfloat16_is_within_bfloat16_rounding(ops):
    torch.manual_seed(3)
    w, x = torch.randn(50, 300), torch.randn(9, 300)
    got = cpu_linear.linear(ops, x.bfloat16(), cpu_linear.pack_weight(w.bfloat16()), 50)
    assert got.dtype == torch.bfloat16
    truth = x.bfloat16().double() @ w.bfloat16().double().t()
    torch.testing.assert_close(got.double(), truth, atol=0.1, rtol=1e-2)


def test_the_compiled_linear_keeps_leading_dimensions(ops):
    w, x = torch.randn(24, 8), torch.randn(2, 3, 8)
    got = cpu_linear.linear(ops, x, cpu_linear.pack_weight(w), 24)
    torch.testing.assert_close(got, x @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x,n,match",
    [
        (torch.randn(2, 7), 30, "features"),
        (torch.randn(2, 8, dtype=torch.float64), 30, "dtype"),
        (torch.randn(2, 8), 49, "does not fit"),  # 30 rows make 2 panels: 25 to 48 outputs
        (torch.randn(2, 8), 24, "does not fit"),
    ],
)
def test_the_compiled_linear_refuses_inputs_that_do_not_fit(ops, x, n, match):
    with pytest.raises(RuntimeError, match=match):
        ops.linear(x, cpu_linear.pack_weight(torch.randn(30, 8)), n)


def gate_up_weight(intermediate: int, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    torch.manual_seed(intermediate + in_features)
    return (torch.randn(2 * intermediate, in_features) / in_features**0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 48, 61, 200])
@pytest.mark.parametrize("intermediate,in_features", [(24, 7), (48, 96), (96, 1025)])
def test_the_fused_gate_up_is_the_silu_mul_of_the_compiled_linear_to_the_bit(ops, dtype, rows, intermediate, in_features):
    """linear_silu_mul computes the same gate and up tiles as `linear` and applies the same
    SiLU-mul row, so it equals the two ops in sequence exactly, in float32 and in bfloat16 (where
    the gate and up round to bfloat16 first, as the separate ops' intermediate does), at every row
    count the kernel tiles differently and on strided rows."""
    w = gate_up_weight(intermediate, in_features, dtype)
    panels = cpu_linear.pack_weight(w)
    x = (torch.randn(rows, in_features + 8) * 3)[:, :in_features].to(dtype)
    got = cpu_linear.linear_silu_mul(ops, x, panels, intermediate)
    assert got.shape == (rows, intermediate) and got.dtype == dtype
    assert torch.equal(got, ops.silu_mul(ops.linear(x, panels, 2 * intermediate)))


def test_the_fused_gate_up_computes_the_eager_mlp_activation(ops):
    """Against the oracle: silu(x Wg^T) * (x Wu^T) from plain matmuls, leading dimensions kept."""
    w = gate_up_weight(72, 40)
    x = torch.randn(2, 5, 40) * 3
    got = cpu_linear.linear_silu_mul(ops, x, cpu_linear.pack_weight(w), 72)
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    assert got.shape == (2, 5, 72)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "w,intermediate,x,match",
    [
        (torch.randn(40, 8), 20, torch.randn(2, 8), "whole panels"),  # 20 is not a multiple of 24
        (torch.randn(96, 8), 24, torch.randn(2, 8), "whole panels"),  # 4 panels hold 48, not 2 x 24
        (torch.randn(48, 8), 24, torch.randn(2, 7), "features"),
        (torch.randn(48, 8), 24, torch.randn(2, 8, dtype=torch.float64), "dtype"),
    ],
)
def test_the_fused_gate_up_refuses_weights_and_inputs_that_do_not_fit(ops, w, intermediate, x, match):
    with pytest.raises(RuntimeError, match=match):
        ops.linear_silu_mul(x, cpu_linear.pack_weight(w), intermediate)


@pytest.mark.parametrize("intermediate", [48, 40])
def test_the_mlp_applies_silu_mul_in_the_gate_up_kernel_where_its_halves_are_whole_panels(
    ops, monkeypatch, intermediate
):
    """With panels and the fused ops, the MLP takes linear_silu_mul where the intermediate size is
    a multiple of 24 and the separate silu_mul elsewhere; both equal the eager MLP."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.llama import MLP

    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=32, intermediate_size=intermediate,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    mlp = MLP(cfg)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        torch.nn.init.normal_(lin.weight, std=0.2)
    x = torch.randn(6, 32)
    with torch.inference_mode():
        eager = mlp(x)
        assert use_linear_method(mlp, PanelLinear(ops)) == 2
        mlp.fused = ops
        calls = []
        fused = cpu_linear.linear_silu_mul
        monkeypatch.setattr(cpu_linear, "linear_silu_mul", lambda *a: calls.append(a) or fused(*a))
        got = mlp(x)
    assert len(calls) == (1 if intermediate % cpu_linear.PANEL == 0 else 0)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


def test_an_engine_whose_mlp_fuses_gives_the_tokens_of_the_plain_matmuls(tmp_path, monkeypatch):
    """A model whose intermediate size (144) is whole panels: its prefills run the MLP through
    linear_silu_mul and its decode steps through the compiled layers' fused gate/up, and its greedy
    tokens equal those of the plain matmuls with the eager SiLU-mul."""
    from pdserve.model.weights import load_model
    from tests.helpers.tiny_llama import make_tiny_llama_dir

    model = load_model(str(make_tiny_llama_dir(tmp_path, intermediate_size=144)))
    fused_engine, fused = greedy(model, monkeypatch, "pdserve")
    plain_engine, plain = greedy(model, monkeypatch, "mkl")
    assert fused_engine.runner.compiled_layers
    assert copies(fused_engine) == {"panels"}
    assert copies(plain_engine) == set()
    assert all(len(v) == 12 for v in fused.values())
    assert fused == plain


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_onednn_packed_linear_computes_the_plain_matmul(rows):
    torch.manual_seed(rows)
    lin = Linear(96, 160)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(rows, 200)[:, :96]
    with torch.inference_mode():
        plain = lin(x)
        use_linear_method(lin, OneDnnLinear())
        packed = lin(x)
    assert set(lin.copies) == {"onednn"} and packed.shape == (rows, 160)
    torch.testing.assert_close(packed, x @ lin.weight.t(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-5)


# oneDNN's matmuls exist in float32 everywhere and in bfloat16 only where the CPU computes it.
ONEDNN_DTYPES = [torch.float32] + ([torch.bfloat16] if onednn_linear_available(torch.bfloat16) else [])


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
@pytest.mark.parametrize("shape", [(5,), (383,), (384,), (777,), (1280,), (1300,), (3, 200)])
def test_the_compiled_onednn_linear_computes_onednns_matmul_whether_or_not_it_splits_the_rows(ops, dtype, shape):
    """pdserve_cpu.onednn_linear, which hands each thread its own block of rows from 384 to 1,280
    rows (2 threads, AMX CPUs), against oneDNN's own call on the same packed weight; leading
    dimensions kept, in and out of inference mode (the pool's threads take the caller's mode)."""
    torch.manual_seed(len(shape) + shape[0])
    weight, x = torch.randn(160, 96, dtype=dtype), torch.randn(*shape, 96, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 1e-2}
    torch.testing.assert_close(ops.onednn_linear(x, packed), onednn, **tol)
    with torch.inference_mode():
        ours = ops.onednn_linear(x, packed)
    assert ours.shape == (*shape, 160)
    torch.testing.assert_close(ours, onednn, **tol)


def test_the_compiled_onednn_linear_refuses_a_weight_that_does_not_fit(ops):
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(160, 96), 64)
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., 96\]"):
        ops.onednn_linear(torch.randn(4, 95), packed)


def greedy(tiny, monkeypatch, mode):
    config = EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32", cpu_linear=mode or "auto")
    engine = Engine(config, loaded=tiny)
    prompts = {f"r{i}": [3 + i, 17, 42 + 5 * i, 9, 100 + i] for i in range(4)}
    return engine, greedy_tokens(engine, prompts, 12)


def copies(engine) -> set[str]:
    """The packed copies the engine's Linears hold, checked to be the same for every one."""
    kinds = {frozenset(m.copies) for m in engine.runner.model.modules() if isinstance(m, Linear)}
    assert len(kinds) == 1, kinds
    return set(kinds.pop())


@pytest.mark.parametrize("avx512", [False, True])
def test_auto_runs_the_compiled_linear_on_avx2_and_onednn_on_avx512_in_float32(tiny, monkeypatch, avx512):
    from pdserve.kernels import linear

    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "avx512f"} if avx512 else {"avx2"}))
    engine, out = greedy(tiny, monkeypatch, None)
    if avx512:
        assert engine.runner.cpu_linear == "onednn"
        assert copies(engine) == {"onednn"}
    else:
        assert engine.runner.cpu_linear == "pdserve"
        assert copies(engine) == {"panels"}
    assert engine.runner.compiled_layers, "either packing runs decode steps through the compiled layer"
    assert all(len(v) == 12 for v in out.values())


def test_each_linear_choice_gives_the_same_tokens(tiny, monkeypatch):
    default_engine, default = greedy(tiny, monkeypatch, "pdserve")
    onednn_engine, onednn = greedy(tiny, monkeypatch, "onednn")
    plain_engine, plain = greedy(tiny, monkeypatch, "mkl")
    assert default_engine.runner.cpu_linear == "pdserve"
    assert copies(default_engine) == {"panels"}
    assert onednn_engine.runner.cpu_linear == "onednn"
    assert copies(onednn_engine) == {"onednn"}
    assert plain_engine.runner.cpu_linear == "mkl"
    assert copies(plain_engine) == set()
    assert all(len(v) == 12 for v in default.values())
    assert default == onednn == plain


def test_an_unknown_linear_choice_is_refused_by_name(tiny, monkeypatch):
    with pytest.raises(ValueError, match="--cpu-linear must be one of .*'blas'"):
        Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32", cpu_linear="blas"), loaded=tiny)


def test_the_engine_start_line_names_the_resolved_dtype_and_the_linear_path(tiny, monkeypatch, caplog):
    with caplog.at_level("INFO", logger="pdserve.engine.engine"):
        Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32", cpu_linear="mkl"), loaded=tiny)
    assert "dtype=float32 linears=mkl" in caplog.text
