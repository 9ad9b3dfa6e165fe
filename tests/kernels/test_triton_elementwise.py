"""The Triton elementwise kernels (kernels/triton_elementwise.py) against the PyTorch code they
replace on a GPU: RMSNorm, residual-add RMSNorm (in place), rotary (in place, on q and k as the
strided views of one qkv projection) and SiLU-mul, in float32 and bfloat16. Without CUDA they run
in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before triton is first imported);
where a GPU exists they run compiled on it, and the model check runs there too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pdserve.kernels.triton_elementwise import TritonElementwise  # noqa: E402
from pdserve.model.llama import RMSNorm, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = TritonElementwise()
# float32: rounding order (and the GPU's exp) only; bfloat16: a step or two where a sum tips a rounding.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def norm_module(width: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(width, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) * 0.5 + 1)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 576), (3, 100)])
def test_rms_norm_matches_eager(dtype, rows, width):
    torch.manual_seed(rows * width)
    norm = norm_module(width, dtype)
    x = (torch.randn(rows, width) * 3).to(DEVICE, dtype)
    torch.testing.assert_close(OPS.rms_norm(x, norm.weight, norm.eps), norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_then_normalises(dtype):
    torch.manual_seed(1)
    norm = norm_module(576, dtype)
    x = torch.randn(7, 576).to(DEVICE, dtype)
    y = torch.randn(7, 576).to(DEVICE, dtype)
    x_eager = x.clone()
    want = norm.add_norm_(x_eager, y)
    got = OPS.add_rms_norm_(x, y, norm.weight, norm.eps)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(x, x_eager)  # the residual sum, rounded as x.add_(y) rounds it: to the bit
    else:  # Triton 3.9's interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest even
        torch.testing.assert_close(x, x_eager, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_strided_q_and_k_in_place_as_eager_does(dtype):
    """q and k are views of one [T, (Hq + 2 Hk) D] projection, as Attention.forward makes them."""
    from pdserve.model.config import ModelConfig

    torch.manual_seed(2)
    t, hq, hk, d = 6, 9, 3, 64
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=hq * d, intermediate_size=8, num_layers=1, num_heads=hq,
                         num_kv_heads=hk, head_dim=d, rope_theta=100000.0)
    rotary = RotaryEmbedding(config, max_positions=64).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 2, 17, 40, 63], device=DEVICE)

    def views(x):
        q, k, _ = x.split((hq * d, hk * d, hk * d), dim=-1)
        return q.view(t, hq, d), k.view(t, hk, d)

    want_q, want_k = rotary(positions, *views(qkv.clone()))
    v_before = qkv[:, (hq + hk) * d:].clone()
    q, k = views(qkv)
    OPS.rotary_(q, k, positions, rotary.get_buffer("cos"), rotary.get_buffer("sin"))
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v, beside them in the row, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 100), (3, 2048)])
def test_silu_mul_matches_eager(dtype, rows, inter):
    torch.manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter) * 3).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


def test_bad_shapes_are_refused_before_launch():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        OPS.rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="must match"):
        OPS.add_rms_norm_(x, torch.randn(2, 7, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="even"):
        OPS.silu_mul(torch.randn(2, 7, device=DEVICE))
    q = torch.randn(2, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        OPS.rotary_(q, q.clone(), torch.zeros(3, dtype=torch.long, device=DEVICE), torch.ones(4, 4, device=DEVICE),
                    torch.ones(4, 4, device=DEVICE))


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert OPS.rms_norm(x, torch.ones(64, device=DEVICE), 1e-5).shape == (0, 64)
    assert OPS.silu_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engine_on_cuda_runs_them_and_gives_eager_greedy_tokens(tiny, monkeypatch):
    """A CUDA engine uses them by default (--no-fused-ops turns them off) and, in float32,
    gives the eager model's greedy tokens and log-probs."""
    from pdserve.engine.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [tiny.tokenizer.encode(t) for t in ("Hi", "The quick brown fox jumps over the lazy dog", "1 2 3")]
    fused = LLM(loaded=tiny, device="cuda", dtype="float32")
    assert fused.engine.runner.fused_elementwise
    got = fused.generate(prompts, params, use_tqdm=False)
    eager = LLM(loaded=tiny, device="cuda", dtype="float32", fused_ops=False)
    assert not eager.engine.runner.fused_elementwise
    want = eager.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
