"""The projection seam (kernels/linear.py): every LinearMethod that runs here computes x W^T + b,
float32 and bfloat16, with and without a bias, at row counts the kernels chunk differently (1, 3,
8, 33) and above TILE_MAX_ROWS (400), each within its dtype's rounding of the float64 product
and the plain method to the bit; the bias is added after the matmul in the output dtype, to the
bit; a gate/up projection's act-mul is the eager formula (the fused kernels to the bit what the
projection then the compiled silu_mul give); the compiled layers read each method's own copy;
select_linear_method's choice for given CPU flags, compiled ops and oneDNN support."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.kernels import cpu_linear
from pdserve.kernels import linear as linear_module
from pdserve.kernels.huge_pages import huge_page_share
from pdserve.kernels.linear import (
    ACTIVATIONS,
    HUGE_PAGE_SHARE,
    Linear,
    LinearMethod,
    OneDnnLinear,
    PanelLinear,
    PlainLinear,
    TileLinear,
    TileOneDnnLinear,
    onednn_linear_available,
    select_linear_method,
    use_linear_method,
)

CPU = torch.device("cpu")
K = 64  # whole tile steps of 32
ROWS = [1, 3, 8, 33, 400]  # 400 > TILE_MAX_ROWS: tiles+onednn's large steps
METHODS = {"plain": PlainLinear, "onednn": OneDnnLinear, "panels": PanelLinear, "tiles": TileLinear,
           "tiles+onednn": TileOneDnnLinear}
DTYPES = [torch.float32, torch.bfloat16]


def runs_here(name: str, dtype: torch.dtype) -> bool:
    """Whether the method computes `dtype` on this CPU: the tiles bfloat16 only (everywhere the ops
    load: elsewhere than AMX and AVX512-BF16 through the portable loop, on the same layout), the
    oneDNN ones what this CPU's oneDNN computes (test_onednn_methods_take_what_onednn_computes)."""
    cls = METHODS[name]
    if issubclass(cls, TileLinear) and dtype != torch.bfloat16:
        return False
    return not issubclass(cls, (OneDnnLinear, TileOneDnnLinear)) or OneDnnLinear.supports(dtype, CPU, None)


# Every method in every dtype it computes here.
METHOD_DTYPES = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}") for name in METHODS for dtype in DTYPES
                 if runs_here(name, dtype)]
BF16_METHODS = [name for name in METHODS if runs_here(name, torch.bfloat16)]


def method_here(name: str, dtype: torch.dtype, ops) -> LinearMethod:
    assert runs_here(name, dtype), f"{name} does not compute {dtype} here: parametrize over runs_here"
    return METHODS[name](ops)


@pytest.mark.parametrize("dtype", DTYPES)
def test_onednn_methods_take_what_onednn_computes(dtype):
    """The oneDNN methods run exactly the dtypes this CPU's oneDNN computes (the cases above leave
    out the others), and the selection never picks them for another."""
    can = onednn_linear_available(dtype)
    assert OneDnnLinear.supports(dtype, CPU, None) == can
    picked = select_linear_method("onednn", dtype, CPU, None, weights_fit_tiles=False)
    assert isinstance(picked, OneDnnLinear) == can


def layer(method: LinearMethod, dtype: torch.dtype, out_features: int, bias: bool, gate_up_of: int = 0,
          seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(K, out_features, bias=bias, gate_up_of=gate_up_of)
    with torch.no_grad():
        torch.nn.init.normal_(lin.weight, std=K**-0.5)
        if bias:
            torch.nn.init.normal_(lin.bias)
    lin.to(dtype)
    assert use_linear_method(torch.nn.ModuleList([lin]), method) == 1
    return lin


def rows_of(rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, K + 32)[:, :K].to(dtype)  # strided rows, as a slice of a fused projection


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, lin: Linear) -> None:
    """got against x W^T + b in float64 from the same inputs: float32 accumulation, then one
    rounding of the product to the output dtype and one of the sum with the bias."""
    product = x.double() @ lin.weight.double().t()
    bias = lin.bias.double() if lin.bias is not None else torch.zeros(lin.out_features, dtype=torch.float64)
    eps = 2**-8 if got.dtype == torch.bfloat16 else 2**-24
    scale = x.double().abs() @ lin.weight.double().abs().t() + bias.abs()
    bound = 2.02 * eps * (product.abs() + bias.abs()) + 1e-5 * scale
    assert ((got.double() - (product + bias)).abs() <= bound).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name,dtype", METHOD_DTYPES)
def test_apply_computes_x_times_w_transposed_plus_the_bias(ops, name, dtype, bias, rows):
    method = method_here(name, dtype, ops)
    lin = layer(method, dtype, 100, bias, seed=rows)  # 100: a partial panel and a partial tile group
    x = rows_of(rows, dtype)
    with torch.inference_mode():
        got = lin(x)
    assert got.shape == (rows, 100) and got.dtype == dtype
    assert_within_rounding(got, x, lin)
    if name == "plain":
        want = x @ lin.weight.t()
        assert torch.equal(got, want + lin.bias if bias else want)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name,dtype", METHOD_DTYPES)
def test_the_bias_is_added_after_the_matmul_in_the_output_dtype(ops, name, dtype, rows):
    method = method_here(name, dtype, ops)
    with_bias = layer(method, dtype, 100, bias=True, seed=rows)
    bare = layer(method, dtype, 100, bias=False, seed=rows)
    with torch.no_grad():
        bare.weight.copy_(with_bias.weight)
    use_linear_method(bare, method)  # repacked from the copied weight
    x = rows_of(rows, dtype)
    with torch.inference_mode():
        assert torch.equal(with_bias(x), bare(x) + with_bias.bias)


@pytest.mark.parametrize("name", BF16_METHODS)
def test_apply_keeps_leading_dimensions(ops, name):
    method = method_here(name, torch.bfloat16, ops)
    lin = layer(method, torch.bfloat16, 96, bias=True)
    x = torch.randn(2, 3, K).bfloat16()
    with torch.inference_mode():
        got = lin(x)
        flat = lin(x.view(6, K))
    assert got.shape == (2, 3, 96) and torch.equal(got.view(6, 96), flat)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("intermediate", [96, 40])  # 96: whole panels and tile groups (fused); 40: neither
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("name,dtype", METHOD_DTYPES)
def test_act_mul_is_the_eager_formula_and_the_fused_kernels_equal_the_separate_ops(
    ops, name, dtype, act, intermediate, bias, rows
):
    """act(gate) * up of the projection's own output: SiLU within the dtype's rounding of the
    eager formula (a fused kernel rounds once where eager PyTorch rounds the SiLU too), and with
    the compiled silu_mul to the bit what the projection then silu_mul give; GeLU(tanh), which
    no projection kernel fuses, to the bit the eager formula without the compiled ops and to the
    bit the compiled gelu_tanh_mul with them."""
    method = method_here(name, dtype, ops)
    lin = layer(method, dtype, 2 * intermediate, bias, gate_up_of=intermediate, seed=rows + intermediate)
    x = rows_of(rows, dtype) * 2
    with torch.inference_mode():
        projected = lin(x)
        gate, up = projected.chunk(2, dim=-1)
        eager = ACTIVATIONS[act](gate) * up
        got = method.apply_act_mul(lin, x, intermediate, act)
        with_ops = method.apply_act_mul(lin, x, intermediate, act, elementwise=ops)
    assert got.shape == (rows, intermediate) and got.dtype == dtype
    tol = {"atol": 2**-7, "rtol": 2**-6} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    if act == "silu":
        torch.testing.assert_close(got, eager, **tol)
        assert torch.equal(with_ops, ops.silu_mul(projected))
    else:
        assert torch.equal(got, eager) and torch.equal(with_ops, ops.gelu_tanh_mul(projected))
        torch.testing.assert_close(with_ops, eager, **tol)


@pytest.mark.parametrize(
    "name,fused_op,intermediate,act,bias,rows,calls",
    [case for case in [
        ("panels", "linear_silu_mul", 96, "silu", False, 5, 1),
        ("panels", "linear_silu_mul", 40, "silu", False, 5, 0),  # halves are not whole panels
        ("panels", "linear_silu_mul", 96, "gelu_tanh", False, 5, 0),
        ("panels", "linear_silu_mul", 96, "silu", True, 5, 0),  # the kernel adds no bias
        ("tiles", "tile_linear_silu_mul", 96, "silu", False, 400, 1),
        ("tiles", "tile_linear_silu_mul", 40, "silu", False, 5, 0),
        ("tiles", "tile_linear_silu_mul", 96, "gelu_tanh", False, 5, 0),
        ("tiles+onednn", "tile_linear_silu_mul", 96, "silu", False, 384, 1),
        ("tiles+onednn", "tile_linear_silu_mul", 96, "silu", False, 385, 0),  # oneDNN's step
    ] if runs_here(case[0], torch.bfloat16)],
)
def test_the_fused_act_mul_kernel_runs_where_its_method_can_apply_it(
    ops, monkeypatch, name, fused_op, intermediate, act, bias, rows, calls
):
    method = method_here(name, torch.bfloat16, ops)
    lin = layer(method, torch.bfloat16, 2 * intermediate, bias, gate_up_of=intermediate)
    seen: list[int] = []
    real = getattr(cpu_linear, fused_op)
    monkeypatch.setattr(cpu_linear, fused_op, lambda *a: seen.append(1) or real(*a))
    with torch.inference_mode():
        method.apply_act_mul(lin, rows_of(rows, torch.bfloat16), intermediate, act, elementwise=ops)
    assert len(seen) == calls


@pytest.mark.parametrize("name", [n for n in ("tiles", "tiles+onednn") if runs_here(n, torch.bfloat16)])
def test_tile_order_keeps_a_gate_up_projections_columns_in_the_tiles_pairs(ops, name):
    method = method_here(name, torch.bfloat16, ops)
    lin = layer(method, torch.bfloat16, 192, bias=False, gate_up_of=96)
    x = rows_of(5, torch.bfloat16)
    with torch.inference_mode():
        paired = lin(x, tile_order=True)
        assert torch.equal(cpu_linear.unpair_gate_up(paired, 96), lin(x))
        assert not torch.equal(paired, lin(x))
        with pytest.raises(ValueError, match="without a bias"):
            layer(method, torch.bfloat16, 192, bias=True, gate_up_of=96)(x, tile_order=True)


def test_act_mul_refuses_an_unknown_activation_and_a_projection_of_another_width(ops):
    lin = layer(PlainLinear(), torch.float32, 192, bias=False, gate_up_of=96)
    with pytest.raises(ValueError, match="activation 'relu'"):
        lin.method.apply_act_mul(lin, torch.randn(2, K), 96, "relu")
    with pytest.raises(ValueError, match="intermediate size 80"):
        lin.method.apply_act_mul(lin, torch.randn(2, K), 80, "silu")


@pytest.mark.parametrize(
    "name,compiled_dim,large_dim",
    [case for case in [("plain", None, None), ("onednn", 2, None), ("panels", 3, None), ("tiles", 5, None),
                       ("tiles+onednn", 5, 2)] if runs_here(case[0], torch.bfloat16)],
)
def test_the_compiled_layers_read_the_methods_own_copy_which_ops_project_tells_apart_by_rank(
    ops, name, compiled_dim, large_dim
):
    method = method_here(name, torch.bfloat16, ops)
    lin = layer(method, torch.bfloat16, 96, bias=False)
    compiled, large = method.compiled_weight(lin), method.large_step_weight(lin)
    assert (None if compiled is None else compiled.dim()) == compiled_dim
    assert (None if large is None else large.dim()) == large_dim
    assert all(w is None or any(w is c for c in lin.copies.values()) for w in (compiled, large))


def test_a_new_linear_runs_plain_on_its_transposed_weight_with_a_bias_only_when_asked():
    lin = Linear(K, 96, bias=True)
    assert lin.weight.shape == (96, K) and lin.weight.t().is_contiguous()
    assert lin.bias is not None and lin.bias.shape == (96,)
    assert isinstance(lin.method, PlainLinear) and lin.copies == {}
    assert set(lin.state_dict()) == {"weight", "bias"}
    assert set(Linear(K, 96).state_dict()) == {"weight"} and Linear(K, 96).bias is None


@pytest.mark.parametrize("dtype,name", [(torch.float32, "panels"), (torch.bfloat16, "tiles")])
def test_use_linear_method_packs_every_linear_into_one_mapping_and_drops_the_earlier_copies(ops, dtype, name):
    model = torch.nn.ModuleDict({"a": Linear(K, 96), "b": Linear(K, 192, gate_up_of=96),
                                 "c": torch.nn.Sequential(Linear(96, K))}).to(dtype)
    for m in model.modules():
        if isinstance(m, Linear):
            torch.nn.init.normal_(m.weight.data, std=0.1)
    use_linear_method(model, PlainLinear())
    before = ops.tile_weights_on_huge_pages()
    try:
        method = method_here(name, dtype, ops)
        assert use_linear_method(model, method) == 3
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.method is method and set(m.copies) == {name} for m in linears)
        copies = [m.copies[name] for m in linears]
        span = sum(c.numel() * c.element_size() + 4096 for c in copies)
        first = min(c.data_ptr() for c in copies)
        assert all(0 <= c.data_ptr() - first < span for c in copies)
        if name == "tiles":  # the tile kernels are told whether the stream can be left to the hardware
            assert ops.tile_weights_on_huge_pages() == (huge_page_share(copies[0]) >= HUGE_PAGE_SHARE)
        with torch.inference_mode():
            for m in linears:
                x = torch.randn(3, m.in_features).to(dtype)
                assert_within_rounding(m(x), x, m)
    finally:
        ops.set_tile_weights_on_huge_pages(before)


def fake_ops(kernel: str) -> object:
    """Compiled ops whose tile kernel is `kernel` ("amx", "avx512_bf16", "portable")."""
    return SimpleNamespace(tile_kernel=lambda: kernel)


AVX512, AVX2 = frozenset({"avx2", "avx512f"}), frozenset({"avx2"})
BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    "choice,dtype,kernel,fit,onednn,flags,expected",
    [
        # auto: tiles for bfloat16 where they run natively and fit, oneDNN's copy beside them
        ("auto", BF16, "avx512_bf16", True, True, AVX512, TileOneDnnLinear),
        ("auto", BF16, "amx", True, False, AVX512, TileLinear),
        # ... else oneDNN for bfloat16 and on AVX-512, else the panels, else oneDNN or plain
        ("auto", BF16, "avx512_bf16", False, True, AVX512, OneDnnLinear),
        ("auto", BF16, "portable", True, True, AVX2, OneDnnLinear),
        ("auto", BF16, "portable", True, False, AVX2, PanelLinear),
        ("auto", F32, "avx512_bf16", True, True, AVX512, OneDnnLinear),
        ("auto", F32, "portable", True, True, AVX2, PanelLinear),
        ("auto", F32, None, True, True, AVX2, OneDnnLinear),
        ("auto", F32, None, True, False, AVX2, PlainLinear),
        # a named choice, and its fallbacks
        ("tiles", BF16, "amx", True, True, AVX512, TileOneDnnLinear),
        ("amx", BF16, "avx512_bf16", True, False, AVX512, TileLinear),
        ("pdserve", F32, "portable", True, True, AVX512, PanelLinear),
        ("pdserve", F32, None, True, True, AVX512, OneDnnLinear),
        ("onednn", F32, "portable", True, True, AVX2, OneDnnLinear),
        ("onednn", F32, "portable", True, False, AVX2, PlainLinear),
        ("mkl", BF16, "amx", True, True, AVX512, PlainLinear),
    ],
)
def test_select_picks_the_method_for_the_cpu_the_ops_and_onednn(monkeypatch, choice, dtype, kernel, fit, onednn,
                                                                 flags, expected):
    monkeypatch.setattr(linear_module, "onednn_linear_available", lambda d: onednn)
    ops = None if kernel is None else fake_ops(kernel)
    method = select_linear_method(choice, dtype, CPU, ops, weights_fit_tiles=fit, flags=flags)
    assert type(method) is expected
    assert method.cpu_linear == {PlainLinear: "mkl", OneDnnLinear: "onednn", PanelLinear: "pdserve",
                                 TileLinear: "tiles", TileOneDnnLinear: "tiles"}[expected]
    if ops is not None and expected is not PlainLinear and expected is not OneDnnLinear:
        assert method.ops is ops


@pytest.mark.parametrize(
    "choice,dtype,kernel,onednn,expected",
    [
        ("tiles", BF16, "portable", True, PanelLinear),
        ("amx", F32, "amx", True, PanelLinear),
        ("tiles", BF16, None, True, OneDnnLinear),
        ("tiles", BF16, None, False, PlainLinear),
    ],
)
def test_asking_for_tiles_that_cannot_run_falls_back_with_a_warning(monkeypatch, caplog, choice, dtype, kernel,
                                                                     onednn, expected):
    monkeypatch.setattr(linear_module, "onednn_linear_available", lambda d: onednn)
    ops = None if kernel is None else fake_ops(kernel)
    with caplog.at_level("WARNING", logger="pdserve.kernels.linear"):
        method = select_linear_method(choice, dtype, CPU, ops, weights_fit_tiles=True, flags=AVX512)
    assert type(method) is expected
    assert f"--cpu-linear={choice}" in caplog.text


@pytest.mark.parametrize("choice", ["auto", "tiles", "onednn", "pdserve"])
def test_off_the_cpu_every_choice_runs_plain(choice):
    method = select_linear_method(choice, BF16, torch.device("cuda"), fake_ops("amx"), weights_fit_tiles=True)
    assert type(method) is PlainLinear


def test_select_refuses_an_unknown_choice_by_name():
    with pytest.raises(ValueError, match="'blas'"):
        select_linear_method("blas", F32, CPU, None, weights_fit_tiles=False, flags=AVX2)


@pytest.mark.parametrize("cls", [PanelLinear, TileLinear, TileOneDnnLinear])
def test_the_methods_of_the_compiled_kernels_refuse_to_be_made_without_the_ops(cls):
    with pytest.raises(ValueError, match="compiled CPU ops"):
        cls(None)


# --deterministic's methods (batch_invariant_method): every row the same bit for bit at any row count.
INVARIANT = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}") for name, dtype in
             [("panels", F32), ("panels", BF16), ("tiles", BF16)] if runs_here(name, dtype)]


@pytest.mark.parametrize("k", [64, 576, 1536])  # at 576 and 1,536 oneDNN's rows depend on the row count
@pytest.mark.parametrize("name,dtype", INVARIANT)
def test_the_batch_invariant_methods_give_each_row_what_it_gets_alone(ops, name, dtype, k):
    torch.manual_seed(k)
    lin = Linear(k, 100, bias=True)  # 100 columns: a partial panel and a partial tile group
    with torch.no_grad():
        torch.nn.init.normal_(lin.weight, std=k**-0.5)
        torch.nn.init.normal_(lin.bias)
    lin.to(dtype)
    use_linear_method(torch.nn.ModuleList([lin]), METHODS[name](ops))
    x = torch.randn(450, k).to(dtype)  # more rows than TILE_MAX_ROWS
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
        for rows in (1, 2, 3, 5, 8, 9, 17, 33, 100, 385, 450):
            assert torch.equal(lin(x[:rows]), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize(
    "choice,dtype,kernel,expected",
    [
        ("auto", BF16, "avx512_bf16", TileLinear),  # the tiles alone: no oneDNN copy above TILE_MAX_ROWS
        ("tiles", BF16, "amx", TileLinear),
        ("auto", BF16, "portable", PanelLinear),  # no native tiles (AVX2): the panels, in bfloat16 too
        ("tiles", BF16, "portable", PanelLinear),
        ("auto", F32, "amx", PanelLinear),
        ("pdserve", BF16, "amx", PanelLinear),
    ],
)
def test_deterministic_selection_takes_the_tiles_alone_or_the_panels(monkeypatch, choice, dtype, kernel, expected):
    monkeypatch.setattr(linear_module, "onednn_linear_available", lambda d: True)
    method = select_linear_method(choice, dtype, CPU, fake_ops(kernel), weights_fit_tiles=True, flags=AVX512,
                                  batch_invariant=True)
    assert type(method) is expected


@pytest.mark.parametrize("choice", ["onednn", "mkl"])
def test_deterministic_selection_refuses_a_method_whose_rows_depend_on_the_batch(choice):
    with pytest.raises(ValueError, match=f"--deterministic.*not {choice}"):
        select_linear_method(choice, BF16, CPU, fake_ops("amx"), weights_fit_tiles=True, batch_invariant=True)


@pytest.mark.parametrize("device,ops", [("cuda", "amx"), ("cpu", None)])
def test_deterministic_selection_refuses_where_no_compiled_kernel_runs(device, ops):
    with pytest.raises(ValueError, match="--deterministic needs the compiled CPU kernels"):
        select_linear_method("auto", BF16, torch.device(device), None if ops is None else fake_ops(ops),
                             weights_fit_tiles=True, batch_invariant=True)
