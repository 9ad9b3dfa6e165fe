"""The AMX tile linear (kernels/csrc/cpu_linear_tiles.cpp): the packed layout is the one TDPBF16PS
reads; the kernel computes x @ W.T to bfloat16 rounding at every row count it chunks differently
(one row, a partial A tile, a whole one, two, several chunks, two row blocks) and output widths that are not a
multiple of its 32-column groups, on strided rows; bad inputs raise. On a CPU without AMX the same
layout runs through the kernel's portable loop, so every check here runs on every machine; where
AMX runs, the runner's `auto` takes it for bfloat16, and engines with it agree with the PyTorch
layers."""

from __future__ import annotations

import pytest
import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kernels import cpu_linear
from pdserve.kernels import linear as linear_module
from pdserve.kernels.linear import (
    Linear,
    TileLinear,
    TileOneDnnLinear,
    onednn_linear_available,
    use_linear_method,
)
from pdserve.model.config import cpu_flags
from tests.helpers.engine_runs import greedy_tokens


def test_tiles_interleave_pairs_along_k_for_each_group_of_32_columns():
    n, k = 40, 64
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).bfloat16()
    tiles = cpu_linear.pack_tiles(w)
    assert tiles.shape == (2, 2, 16, 2, 32) and tiles.is_contiguous()
    for g, s, t, r, c, j in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 5, 3, 1), (1, 0, 0, 7, 7, 1), (0, 1, 0, 15, 15, 0)]:
        assert tiles[g, s, r, t, 2 * c + j] == w[32 * g + 16 * t + c, 32 * s + 2 * r + j]
    assert not tiles[1, :, :, 0, 16:].any() and not tiles[1, :, :, 1].any(), "columns past N are zero"


def test_only_bfloat16_weights_with_k_a_multiple_of_32_pack_into_tiles():
    assert cpu_linear.tiles_fit(torch.zeros(8, 64, dtype=torch.bfloat16))
    assert not cpu_linear.tiles_fit(torch.zeros(8, 64))
    assert not cpu_linear.tiles_fit(torch.zeros(8, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.pack_tiles(torch.zeros(8, 48, dtype=torch.bfloat16))


def test_the_kernel_runs_on_amx_where_the_cpu_has_it_else_on_avx512_bf16_else_the_portable_loop(ops):
    flags = cpu_flags()
    expected = "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512_bf16" if "avx512_bf16" in flags else "portable"
    assert cpu_linear.tile_kernel(ops) == expected
    assert cpu_linear.tiles_run(ops) == (expected != "portable")
    assert cpu_linear.tile_kernel(None) == "none" and not cpu_linear.tiles_run(None)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 17, 32, 33, 70, 300])  # 300 x 1024: two L2 row blocks
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (200, 64), (17, 96), (1, 32), (96, 1024)])
def test_the_tile_linear_computes_the_plain_matmul_to_bfloat16_rounding(ops, rows, out_features, in_features):
    torch.manual_seed(rows * 7 + out_features)
    lin = Linear(in_features, out_features)
    torch.nn.init.normal_(lin.weight)
    lin.to(torch.bfloat16)
    x = torch.randn(rows, in_features + 32)[:, :in_features].bfloat16()  # strided rows
    with torch.inference_mode():
        use_linear_method(lin, TileLinear(ops))
        got = lin(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    truth = x.double() @ lin.weight.double().t()  # the bfloat16 inputs, exactly
    # float32 accumulation, then one rounding to bfloat16 (2^-8 relative)
    scale = x.double().abs() @ lin.weight.double().abs().t()
    assert ((got.double() - truth).abs() <= truth.abs() * 2**-8 + scale * 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_a_few_rows_give_the_bits_they_give_among_eight_even_two_bytes_off_a_pair(ops, rows):
    """One row packs as a pair with a zero row and runs the two-row kernel, and 2 to 4 rows pack
    only as wide as they need (2 or 4 pairs a k pair, not 8), from wherever they start (here one
    element into a row, so their pairs sit 2 bytes off 4): the same bits as the same rows among 8."""
    torch.manual_seed(3 + rows)
    weight = torch.randn(96, 64).bfloat16()
    packed = cpu_linear.pack_tiles(weight)
    eight = torch.randn(8, 65).bfloat16()[:, 1:]
    few = eight[:rows]
    assert few.data_ptr() % 4 == 2
    with torch.inference_mode():
        alone = ops.tile_linear(few, packed, 96)
        among = ops.tile_linear(eight, packed, 96)[:rows]
    assert torch.equal(alone, among)
    truth = few.double() @ weight.double().t()
    scale = few.double().abs() @ weight.double().abs().t()
    assert ((alone.double() - truth).abs() <= truth.abs() * 2**-8 + scale * 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
def test_a_step_computes_the_same_bits_whether_or_not_the_weights_count_as_on_huge_pages(ops, rows):
    """On huge pages, chunks of up to 4 rows leave their weight's stream to the hardware prefetcher
    (cpu_linear_tiles.cpp, on the VDPBF16PS tiles); a prefetch changes no number."""
    torch.manual_seed(rows)
    w, x = torch.randn(200, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    tiles = cpu_linear.pack_tiles(w)
    before = ops.tile_weights_on_huge_pages()
    outs = []
    try:
        for on in (False, True):
            ops.set_tile_weights_on_huge_pages(on)
            assert ops.tile_weights_on_huge_pages() == on
            outs.append(cpu_linear.tile_linear(ops, x, tiles, 200))
    finally:
        ops.set_tile_weights_on_huge_pages(before)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0].float(), x.float() @ w.float().t(), atol=0.25, rtol=2**-6)


def test_the_tile_linear_keeps_leading_dimensions(ops):
    w, x = torch.randn(48, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    got = cpu_linear.tile_linear(ops, x, cpu_linear.pack_tiles(w), 48)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().t()), atol=0.1, rtol=2**-7)


@pytest.mark.parametrize(
    "x,n,match",
    [
        (torch.randn(2, 32).bfloat16(), 32, "does not fit"),  # 40 columns make 2 groups: 33 to 64 outputs
        (torch.randn(2, 32).bfloat16(), 65, "does not fit"),
        (torch.randn(2, 32), 40, "bfloat16"),
        (torch.randn(2, 64).bfloat16(), 40, "features"),
        (torch.randn(2, 2, 32).bfloat16(), 40, r"\[M, K\]"),
    ],
)
def test_the_tile_linear_refuses_inputs_that_do_not_fit(ops, x, n, match):
    with pytest.raises(RuntimeError, match=match):
        ops.tile_linear(x, cpu_linear.pack_tiles(torch.randn(40, 32).bfloat16()), n)


def test_the_tile_linear_refuses_a_weight_not_in_the_tile_layout(ops):
    with pytest.raises(RuntimeError, match="pack_tiles"):
        ops.tile_linear(torch.randn(2, 32).bfloat16(), torch.randn(40, 32).bfloat16(), 40)


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 33, 300])  # 300 x 1024: two L2 row blocks
@pytest.mark.parametrize("intermediate,in_features", [(32, 64), (96, 1024)])
def test_the_tile_gate_up_with_silu_mul_equals_the_projection_then_the_op_to_the_bit(ops, rows, intermediate,
                                                                                    in_features):
    """The fused kernel, on the gate/up tiles packed in pairs, rounds gate and up to bfloat16 as
    the projection's output is rounded and applies the op's own row function: the same bits as
    tile_linear on the weight packed as it lies (the gate's columns, then the up's) then silu_mul,
    strided rows."""
    torch.manual_seed(rows + intermediate)
    w = torch.randn(2 * intermediate, in_features).bfloat16()
    x = torch.randn(rows, in_features + 32)[:, :in_features].bfloat16()
    assert cpu_linear.tiles_fuse_silu_mul(intermediate)
    got = cpu_linear.tile_linear_silu_mul(ops, x, cpu_linear.pack_gate_up_tiles(w, intermediate), intermediate)
    assert got.shape == (rows, intermediate) and got.dtype == torch.bfloat16
    want = ops.silu_mul(cpu_linear.tile_linear(ops, x, cpu_linear.pack_tiles(w), 2 * intermediate))
    assert torch.equal(got, want)
    gate, up = (x.float() @ w.float().t()).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, atol=0.1, rtol=2**-6)


@pytest.mark.parametrize("intermediate", [32, 96])
def test_gate_up_tiles_in_pairs_project_the_columns_of_the_plain_tiles_once_unpaired(ops, intermediate):
    """pack_gate_up_tiles lays gate group p beside up group p; through tile_linear its columns
    come in those pairs, and unpair_gate_up puts them back: the plain packing's bits."""
    torch.manual_seed(intermediate)
    w = torch.randn(2 * intermediate, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    paired = cpu_linear.pack_gate_up_tiles(w, intermediate)
    plain = cpu_linear.pack_tiles(w)
    assert paired.shape == plain.shape and paired.is_contiguous()
    assert torch.equal(paired[1], plain[intermediate // 32])  # the up's first group, second in memory
    y = cpu_linear.tile_linear(ops, x, paired, 2 * intermediate)
    assert torch.equal(cpu_linear.unpair_gate_up(y, intermediate), cpu_linear.tile_linear(ops, x, plain, 2 * intermediate))
    with pytest.raises(ValueError, match="whole groups"):
        cpu_linear.pack_gate_up_tiles(torch.randn(80, 64).bfloat16(), 40)
    with pytest.raises(ValueError, match="2 x 32 rows"):
        cpu_linear.pack_gate_up_tiles(torch.randn(96, 64).bfloat16(), 32)


def test_the_tile_gate_up_with_silu_mul_refuses_halves_that_are_not_whole_groups(ops):
    assert not cpu_linear.tiles_fuse_silu_mul(40)
    tiles = cpu_linear.pack_tiles(torch.randn(80, 32).bfloat16())  # 3 groups: 80 does not split into two of 32s
    with pytest.raises(RuntimeError, match="whole groups"):
        ops.tile_linear_silu_mul(torch.randn(2, 32).bfloat16(), tiles, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.tile_linear_silu_mul(torch.randn(2, 32), cpu_linear.pack_tiles(torch.randn(64, 32).bfloat16()), 32)


def test_the_mlp_takes_the_fused_tile_gate_up_where_tiles_run(ops, monkeypatch):
    """A bfloat16 MLP on tiles, with the compiled elementwise ops: the fused gate/up kernel runs,
    and the MLP computes what the unfused path computes, to the bit."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.llama import MLP

    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    torch.manual_seed(3)
    mlp = MLP(cfg)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        torch.nn.init.normal_(lin.weight, std=0.2)
    mlp.to(torch.bfloat16)
    assert use_linear_method(mlp, TileLinear(ops)) == 2
    mlp.fused = ops
    calls: list[int] = []
    real = cpu_linear.tile_linear_silu_mul
    monkeypatch.setattr(cpu_linear, "tile_linear_silu_mul", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        got = mlp(x)
        want = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(x)))
    assert calls == [1] and torch.equal(got, want)


def tiles_method(ops, onednn: bool) -> TileLinear:
    """The tiles, with oneDNN's copy beside them for large steps where `onednn`."""
    return TileOneDnnLinear(ops) if onednn else TileLinear(ops)


def test_steps_of_more_than_tile_max_rows_go_to_onednn_where_it_is_there_and_the_rest_to_the_tiles(ops, monkeypatch):
    """With oneDNN's bfloat16 copy (where this CPU's oneDNN computes bfloat16) large steps take it;
    without, the tiles take every step."""
    torch.manual_seed(5)
    onednn = onednn_linear_available(torch.bfloat16)
    lin = Linear(64, 96)
    torch.nn.init.normal_(lin.weight)
    lin.to(torch.bfloat16)
    use_linear_method(lin, tiles_method(ops, onednn))
    assert set(lin.copies) == ({"tiles", "onednn"} if onednn else {"tiles"})
    calls: list[int] = []
    real = cpu_linear.tile_linear
    monkeypatch.setattr(cpu_linear, "tile_linear", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    limit = cpu_linear.TILE_MAX_ROWS
    sizes = (1, limit, limit + 1, 3 * limit)
    with torch.inference_mode():
        for rows in sizes:
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(lin(x).float(), x.float() @ lin.weight.float().t(), atol=0.1, rtol=2**-7)
    assert calls == ([1, limit] if onednn else list(sizes))


def test_onednn_after_the_tiles_computes_what_it_computed_before(ops):
    """Both use AMX's per-thread tile configuration: each loads its own before its first tile
    instruction, so oneDNN's results do not change after the tiles (and the attention's AMX
    scores) reconfigured and released the tiles on the same threads."""
    torch.manual_seed(9)
    lin = Linear(64, 96)
    torch.nn.init.normal_(lin.weight)
    lin.to(torch.bfloat16)
    use_linear_method(lin, tiles_method(ops, onednn_linear_available(torch.bfloat16)))
    big, small = torch.randn(4 * cpu_linear.TILE_MAX_ROWS, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        first = lin(big)
        small_out = lin(small)
        again = lin(big)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    torch.testing.assert_close(small_out.float(), small.float() @ lin.weight.float().t(), atol=0.1, rtol=2**-7)


PROMPTS = {f"r{i}": [3 + i, 17, 42 + 5 * i, 9, 100 + i] * (i + 1) for i in range(4)}


def greedy(tiny, dtype, steps=10, cpu_linear="auto"):
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype=dtype, cpu_linear=cpu_linear), loaded=tiny)
    return engine, greedy_tokens(engine, PROMPTS, steps)


def test_auto_takes_the_tiles_for_bfloat16_where_they_run_and_they_agree_with_the_pytorch_layers(tiny, monkeypatch):
    """With the tiles reported native (on a CPU without AMX or AVX512-BF16, the portable loop computes the same layout), `auto`
    packs every linear into tiles in bfloat16; decode steps go through the compiled layers on the
    tiles, and tokens and KV cache equal those of the PyTorch layers on the same tiles."""
    monkeypatch.setattr(linear_module, "tiles_run", lambda ops: ops is not None)
    compiled, out = greedy(tiny, "bfloat16")
    assert compiled.runner.cpu_linear == "tiles" and compiled.runner.compiled_layers
    lins = [m for m in compiled.runner.model.modules() if isinstance(m, Linear)]
    # oneDNN's copy is kept for large prefills where it is there, unless the engine is
    # deterministic (its rows depend on the row count: the tiles run every step).
    onednn = onednn_linear_available(torch.bfloat16) and not compiled.runner.deterministic
    assert all(set(m.copies) == ({"tiles", "onednn"} if onednn else {"tiles"}) for m in lins)
    eager = Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype="bfloat16"), loaded=tiny)
    eager.runner.model.use_compiled_layers(None)
    eager_out = greedy_tokens(eager, PROMPTS, 10)
    assert all(len(v) == 10 for v in out.values())
    assert out == eager_out
    torch.testing.assert_close(compiled.runner.kv_cache, eager.runner.kv_cache, atol=0, rtol=0)


def test_auto_keeps_float32_off_the_tiles(tiny, monkeypatch):
    monkeypatch.setattr(linear_module, "tiles_run", lambda ops: ops is not None)
    engine, out = greedy(tiny, "float32", steps=3)
    assert engine.runner.cpu_linear in ("pdserve", "onednn")
    assert all(len(v) == 3 for v in out.values())


@pytest.mark.parametrize("name", ["tiles", "amx"])
def test_asking_for_the_tiles_where_they_cannot_run_falls_back_with_a_warning(tiny, monkeypatch, caplog, name):
    monkeypatch.setattr(linear_module, "tiles_run", lambda ops: False)
    with caplog.at_level("WARNING"):
        engine, out = greedy(tiny, "bfloat16", steps=3, cpu_linear=name)
    assert engine.runner.cpu_linear == "pdserve"
    assert f"--cpu-linear={name}" in caplog.text
    assert all(len(v) == 3 for v in out.values())


def test_a_decode_batch_of_twenty_runs_the_compiled_layers_as_the_pytorch_layers_do(tiny, monkeypatch):
    """20 sequences of different lengths (1 to 3 KV blocks) decoding together: steps of 16 rows or
    more, where the MLP's projections also prefetch the next layer's KV for the decode rows
    (cpu_decoder_layer.cpp, on the VDPBF16PS tiles) and, above 8 rows, the next group's weight.
    Prefetches change no number: the compiled layers give the PyTorch layers' tokens and cache."""
    monkeypatch.setattr(linear_module, "tiles_run", lambda ops: ops is not None)
    prompts = {f"s{i}": [5 + i, 11, 40 + 3 * i] + list(range(60, 60 + 2 * i)) for i in range(20)}
    engines = [Engine(EngineConfig(model="tiny", num_kv_blocks=128, dtype="bfloat16"), loaded=tiny) for _ in range(2)]
    assert all(e.runner.cpu_linear == "tiles" for e in engines) and engines[0].runner.compiled_layers
    engines[1].runner.model.use_compiled_layers(None)
    outs = [greedy_tokens(e, prompts, 8) for e in engines]
    assert all(len(v) == 8 for v in outs[0].values())
    assert outs[0] == outs[1]
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, atol=0, rtol=0)
