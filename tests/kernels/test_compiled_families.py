"""The compiled decoder layers (kernels/csrc/cpu_decoder_layer.cpp) on every family of
tests/helpers/tiny_models.py, in lockstep with the PyTorch layers (model/llama.py), their oracle:
q/k/v biases (Qwen2), per-head q/k norms (Qwen3, Gemma 3), sandwich norms, GeGLU, sliding windows
of 5 (under a block) and 37 (over several) with their own rotary tables (Gemma 3), over blocks of
4 and 16 tokens, float32 and bfloat16; decode-only steps, prompt chunks over a cached prefix,
steps that mix both, and prompts that start from another's cached blocks. Plus GELU-tanh-mul,
the elementwise op of GeGLU, against torch.

Tolerances: the compiled layers run the same compiled ops in the same order as the PyTorch layers
(use_fused_ops), so tokens and KV caches agree to the bit, except for Gemma's GeGLU: the PyTorch
MLP runs it in eager torch (F.gelu, whose tanh is Sleef's), the compiled layers through
gelu_tanh_mul (a float32 step or so from torch's on an activation; 92% equal, and 99% of bfloat16
results), carried through six layers: 1e-5 in float32 (3e-6 seen), one bfloat16 step of the
cache's values in bfloat16 (none seen). The tokens are equal in every case."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pdserve.config.engine import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kernels import cpu_linear
from pdserve.model.weights import load_model
from tests.helpers.engine_runs import StepRecorder, greedy_tokens
from tests.helpers.tiny_models import FAMILIES, make_tiny_dir

# Each family's tiny shape; Gemma 3's again with a window of 37 (over several blocks of 4); Qwen2's
# with head size 32, whose bfloat16 prefills are compiled (biases on the large-step packing too).
MODELS = [(family, {}) for family in FAMILIES] + [("gemma3", {"sliding_window": 37}), ("qwen2", {"hidden_size": 128})]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m[0] + "".join(f"-{k}{v}" for k, v in m[1].items()))
def family_model(request, tmp_path_factory):
    family, shape = request.param
    return family, load_model(str(make_tiny_dir(tmp_path_factory.mktemp(family), family, **shape)))


def lockstep(loaded, dtype: str, block_size: int, deterministic: bool = False):
    """Two engines fed the same prompts with a 16-token budget (prompts come in chunks over their
    cached prefix, decodes mix with chunks), then a second wave that shares a cached prefix with
    the first: one runs its steps through decoder_layers_, the other through the PyTorch layers.
    Returns the engines, each one's greedy tokens, and the compiled engine's recorded steps."""
    config = EngineConfig(model="tiny", num_kv_blocks=256 // block_size * 4, dtype=dtype, block_size=block_size,
                          max_num_batched_tokens=16, deterministic=deterministic)
    engines = [Engine(config, loaded=loaded) for _ in range(2)]
    for engine in engines:  # the runner keeps both rotary tables in float32
        local = engine.runner.model.model.rotary_local
        assert local is None or local.get_buffer("cos").dtype == torch.float32
    model = engines[0].runner.model
    compiled = model.compiled_layers
    assert compiled is not None and engines[0].runner.compiled_layers, "every family runs the compiled layers"
    recorder = StepRecorder(compiled.ops)
    model._compiled = dataclasses.replace(compiled, ops=recorder)
    engines[1].runner.model.use_compiled_layers(None)
    # 1, 12, 23 and 45 tokens: within and past a window of 5 and of 37, over several blocks.
    first = {f"a{i}": [7 + i] + list(range(20, 20 + 11 * i)) for i in range(3)} | {"a3": list(range(60, 105))}
    second = {f"b{i}": first["a3"][:40] + [90 + i, 3] for i in range(2)}  # a3's first blocks are cached
    outs = [{**greedy_tokens(e, first, 7), **greedy_tokens(e, second, 6)} for e in engines]
    assert all(len(v) in (6, 7) for v in outs[0].values())
    return engines, outs, recorder.steps, compiled


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_give_the_pytorch_layers_tokens_and_cache(family_model, dtype, block_size, deterministic):
    """Deterministic, every row of every step is a decode row (prompt rows too), on both sides."""
    family, loaded = family_model
    engines, outs, steps, compiled = lockstep(loaded, dtype, block_size, deterministic)
    assert outs[0] == outs[1]
    tol = {"atol": 0, "rtol": 0}
    if family == "gemma3":  # GeGLU: eager torch on one side (see the module's docstring)
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 2 ** -6, "rtol": 2 ** -7}
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, **tol)
    assert any(nd == rows for rows, nd in steps), "decode-only steps"
    if deterministic:
        assert all(nd == rows for rows, nd in steps) and any(rows > 3 for rows, _ in steps), "prompt rows as decodes"
        assert engines[0].scheduler.pool.cache_hits > 0, "the second wave starts from a cached prefix"
    elif compiled.prefills:
        assert any(nd == 0 for _, nd in steps), "prompt-only steps"
        assert any(0 < nd < rows for rows, nd in steps), "steps that mix decodes and prompt chunks"
        assert engines[0].scheduler.pool.cache_hits > 0, "the second wave starts from a cached prefix"


def test_a_long_prompt_runs_the_large_step_packing_as_the_pytorch_layers_do(family_model):
    """bfloat16 where the tiles run: a step of more rows than cpu_linear.TILE_MAX_ROWS reads
    oneDNN's packing (unpaired gate/up columns, the bias added after it too); decodes read the
    tiles."""
    family, loaded = family_model
    config = EngineConfig(model="tiny", num_kv_blocks=64, dtype="bfloat16", max_num_batched_tokens=512,
                          deterministic=False)
    engines = [Engine(config, loaded=loaded) for _ in range(2)]
    for engine in engines:  # the runner keeps both rotary tables in float32
        local = engine.runner.model.model.rotary_local
        assert local is None or local.get_buffer("cos").dtype == torch.float32
    compiled = engines[0].runner.model.compiled_layers
    assert compiled is not None
    # Where this CPU keeps no second packing (no tiles) or does not compile this head size's
    # bfloat16 prefill, the long prompt runs as every other step does: still compared below.
    engines[1].runner.model.use_compiled_layers(None)
    prompt = {"long": [(7 * i) % 5000 + 10 for i in range(cpu_linear.TILE_MAX_ROWS + 20)]}
    outs = [greedy_tokens(e, prompt, 4) for e in engines]
    assert outs[0] == outs[1]
    tol = {"atol": 2 ** -6, "rtol": 2 ** -7} if family == "gemma3" else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(engines[0].runner.kv_cache, engines[1].runner.kv_cache, **tol)


def test_the_options_reach_the_compiled_call_only_for_families_other_than_llama(family_model):
    """A Llama's call is the one it always was (six weights a layer, no options); the others pass
    eleven weights a layer and their windows, local rotary flags and activation."""
    family, loaded = family_model
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=64, dtype="float32"), loaded=loaded)
    model = engine.runner.model
    compiled = model.compiled_layers
    assert compiled is not None
    layers = model.config.num_layers
    if family == "llama":
        assert compiled.options == () and len(compiled.weights) == 6 * layers
        return
    windows, local_rope, activation = compiled.options
    assert len(compiled.weights) == 11 * layers
    assert windows == [model.config.window(i) for i in range(layers)]
    assert activation == (1 if family == "gemma3" else 0)
    assert any(local_rope) == (family == "gemma3")


def test_the_compiled_layers_refuse_options_that_do_not_fit_the_layers(ops):
    """One layer of the tiny Llama's shape: a window list, a local rotary flag or an activation
    that does not fit raises before any work."""
    x = torch.randn(1, 8)
    weights = [torch.ones(8), torch.ones(8)] + [torch.randn(8, 8)] * 4  # the checks come before their use
    step = (torch.tensor([0]), torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(1, 2, 1, 1, 1, 4), torch.zeros(1),
            1, torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32), 2, 1, 4, 8, 1e-5, 1.0, True)
    with pytest.raises(RuntimeError, match="windows: none, or one for each of 1 layers"):
        ops.decoder_layers_(x, weights, [], 0, torch.ones(8), *step, [5, 5])
    with pytest.raises(RuntimeError, match="pass local_cos and local_sin"):
        ops.decoder_layers_(x, weights, [], 0, torch.ones(8), *step, [5], [1])
    with pytest.raises(RuntimeError, match="activation must be 0"):
        ops.decoder_layers_(x, weights, [], 0, torch.ones(8), *step, [5], [0], 2)
    with pytest.raises(RuntimeError, match="a q norm and a k norm, or neither"):
        extras = [torch.empty(0), torch.ones(4), torch.empty(0), torch.empty(0), torch.empty(0)]
        ops.decoder_layers_(x, weights + extras, [], 0, torch.ones(8), *step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (9, 37), (300, 256)])
def test_gelu_tanh_mul_is_torchs_geglu_to_rounding(ops, dtype, shape):
    torch.manual_seed(0)
    rows, inter = shape
    gate_up = torch.cat([torch.randn(rows, inter) * 4, torch.randn(rows, inter)], dim=1)
    gate_up[0, : min(inter, 8)] = torch.tensor([-100.0, -12.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 100.0])[: min(inter, 8)]
    gate_up = gate_up.to(dtype)
    out = ops.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    # float32: a few float32 steps (tanh's own error, times |up| up to ~4); bfloat16: torch
    # rounds gelu's output, then the product, as the op does: at most one bfloat16 step apart.
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 2 ** -8}
    torch.testing.assert_close(out, want, **tol)
    if dtype == torch.bfloat16 and out.numel() > 10_000:
        assert (out == want).float().mean() > 0.98, "near-ties aside, the very same bfloat16"
    assert out.isfinite().all()


def test_gelu_tanh_mul_refuses_other_dtypes_and_odd_widths(ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.gelu_tanh_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        ops.gelu_tanh_mul(torch.randn(2, 7))
