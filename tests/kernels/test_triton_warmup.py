"""kernels/triton_warmup.py: the warm-up launches exactly the Triton kernel variants that the
model's own launches reach over every step shape a configuration allows, no more, no fewer.

A variant is what Triton compiles once: the kernel, its constexpr arguments and launch options,
and Triton's own specialization of every other argument (a pointer's dtype and 16-byte alignment,
an int's width and whether it is 1 or a multiple of 16). The launches are recorded, not run.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from pdserve.kernels import (
    triton_decode,
    triton_elementwise,
    triton_prefill,
    triton_store_kv,
    triton_warmup,
)
from pdserve.kernels.triton_backend import TritonBackend
from pdserve.kernels.triton_elementwise import TritonElementwise
from pdserve.kernels.triton_warmup import KernelShapes, Variant, int_class, variants, warm_up
from pdserve.model.attention_metadata import AttentionMetadata
from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaForCausalLM

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: Triton's interpreter
DTYPE = torch.bfloat16
BLOCK = 16
SEQS, BUDGET, WIDEST = 5, 20, 20  # max_num_seqs, token budget, blocks of the longest sequence

LLAMA = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16)
# Gemma 3's options: q/k norms, sandwich norms, GELU-tanh, a windowed layer with its own rotary.
GEMMA = ModelConfig("gemma3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=1, head_dim=32, qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh",
                    layer_windows=(5, 0), local_rope_theta=10000.0)


try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def specialization(arg) -> tuple:
        """Triton's own specialization of a launch argument."""
        return native_specialize_impl(BaseBackend, arg, False, True, True)
except ImportError:  # a Triton without it: its rule, as Triton 3 applies it

    def specialization(arg) -> tuple:
        if isinstance(arg, torch.Tensor):
            return f"*{arg.dtype}", "D" if arg.data_ptr() % 16 == 0 else ""
        if isinstance(arg, bool | float):
            return type(arg).__name__, None
        if isinstance(arg, int):
            return ("constexpr", 1) if arg == 1 else ("i32" if -2**31 <= arg < 2**31 else "i64",
                                                       "D" if arg % 16 == 0 else "")
        return type(arg).__name__, repr(arg)


def variant_key(kernel, args, kwargs) -> tuple:
    """What Triton compiles a launch as (its cache key, less the source and the device)."""
    name = getattr(kernel, "fn", kernel).__name__
    return name, tuple(specialization(a) for a in args), tuple(sorted(kwargs.items()))


@pytest.fixture
def launched(monkeypatch) -> set[tuple]:
    """Every Triton launch's variant key from here on; nothing runs."""
    keys: set[tuple] = set()

    def record(kernel, device):
        class Launcher:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: keys.add(variant_key(kernel, args, kwargs))
        return Launcher()

    for module in (triton_decode, triton_prefill, triton_store_kv, triton_elementwise):
        monkeypatch.setattr(module, "for_device", record)
    return keys


def shapes_of(m: ModelConfig) -> KernelShapes:
    return KernelShapes(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                        hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, dtype=DTYPE,
                        block_size=BLOCK, max_num_seqs=SEQS, token_budget=BUDGET, max_blocks_per_seq=WIDEST,
                        windows=tuple(sorted({m.window(i) for i in range(m.num_layers)})), qk_norm=m.qk_norm,
                        silu=m.hidden_act == "silu")


def model_of(m: ModelConfig) -> LlamaForCausalLM:
    """The model as a CUDA ModelRunner sets it up: Triton attention and elementwise kernels."""
    model = LlamaForCausalLM(m, TritonBackend(), max_positions=WIDEST * BLOCK)
    model.to(dtype=DTYPE)
    for rotary in (model.model.rotary, model.model.rotary_local):
        if rotary is not None:
            rotary.to(dtype=torch.float32)
    model.use_fused_ops(TritonElementwise())
    return model


def ints(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def run_step(model: LlamaForCausalLM, kv_cache: torch.Tensor, decodes: int, prefill: int, width: int) -> None:
    """One step of `decodes` single-token sequences and a prompt chunk of `prefill` tokens, every
    block table `width` wide, each index tensor fresh as the runner uploads them."""
    tokens = decodes + prefill
    meta = AttentionMetadata(
        slot_mapping=ints([0] * tokens, torch.int64), num_decode_tokens=decodes,
        decode_seq_lens=ints([1] * decodes), decode_block_tables=torch.zeros(decodes, width, dtype=torch.int32),
        prefill_cu_seqlens_q=ints([0, prefill] if prefill else [0]),
        prefill_seq_lens=ints([prefill] if prefill else []),
        prefill_block_tables=torch.zeros(1 if prefill else 0, width, dtype=torch.int32),
    )
    model(ints([1] * tokens, torch.int64), ints([0] * tokens, torch.int64), meta, kv_cache)


def every_step(m: ModelConfig) -> None:
    """Run every step shape the limits allow (decode-only, prefill-only, mixed) and widths."""
    model = model_of(m)
    kv_cache = torch.zeros(m.num_layers, 2, WIDEST, BLOCK, m.num_kv_heads, m.head_dim, dtype=DTYPE)
    for width in range(1, WIDEST + 1):
        for decodes in range(1, SEQS + 1):
            run_step(model, kv_cache, decodes, 0, width)
        for decodes, prefill in itertools.product(range(SEQS), range(2, BUDGET + 1)):
            if decodes + prefill <= BUDGET and prefill <= width * BLOCK:
                run_step(model, kv_cache, decodes, prefill, width)


@pytest.mark.parametrize("model", [LLAMA, GEMMA], ids=["llama", "gemma3"])
def test_the_warm_up_launches_exactly_the_variants_every_step_shape_reaches(launched, model):
    every_step(model)
    reached = set(launched)
    launched.clear()
    warm_up(shapes_of(model), CPU)
    assert launched == reached
    assert {name for name, _, _ in reached} >= {"_store_kv_kernel", "_decode_split_kernel", "_prefill_kernel",
                                                 "_rms_norm_kernel", "_rotary_kernel"}


def test_with_a_gpus_split_counts_too(launched, monkeypatch):
    """num_splits as on a GPU of 132 SMs: more split counts, each compiled before serving."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    real = triton_decode.num_splits
    monkeypatch.setattr(triton_decode, "num_splits", lambda b, h, n, device: real(b, h, n, torch.device("cuda")))
    every_step(LLAMA)
    reached = set(launched)
    launched.clear()
    warm_up(shapes_of(LLAMA), CPU)
    assert launched == reached
    splits = {dict(kw)["SPLITS"] for name, _, kw in launched if name == "_decode_split_kernel"}
    assert len(splits) > 2


def test_each_variant_is_launched_once():
    todo = variants(shapes_of(LLAMA), CPU)
    assert len(todo) == len(set(todo))
    assert [v.tokens for v in todo if v.op == "store_kv"] == [1, 2, 16]
    assert {int_class(v.width) for v in todo if v.op == "prefill"} == {"1", "", "16"}


def vars_of(s: KernelShapes) -> dict:
    return {f: getattr(s, f) for f in s.__slots__}


def test_without_triton_attention_or_fused_ops_nothing_of_theirs_is_warmed():
    none = KernelShapes(**{**vars_of(shapes_of(LLAMA)), "attention": False, "fused_ops": False})
    assert variants(none, CPU) == []
    ops_only = KernelShapes(**{**vars_of(shapes_of(LLAMA)), "attention": False})
    assert {v.op for v in variants(ops_only, CPU)} == {"rms_norm", "add_rms_norm", "rotary", "silu_mul"}


def test_a_fixed_split_count_is_the_only_one_warmed():
    fixed = KernelShapes(**{**vars_of(shapes_of(LLAMA)), "decode_splits": 3})
    decodes = [v for v in variants(fixed, CPU) if v.op == "decode"]
    assert len(decodes) == 3  # one per class of table width


def test_the_warm_up_runs_every_variant_of_a_tiny_configuration():
    """The launches are valid: every variant runs (on the GPU; on the CPU in Triton's interpreter)."""
    tiny = KernelShapes(num_heads=2, num_kv_heads=1, head_dim=16, hidden_size=32, intermediate_size=32,
                        dtype=torch.float32, block_size=4, max_num_seqs=2, token_budget=3, max_blocks_per_seq=2)
    done = warm_up(tiny, DEVICE)
    assert Variant("decode", tokens=1, batch=1, width=1) in done and {v.op for v in done} >= {"prefill", "silu_mul"}


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown warm-up op"):
        triton_warmup.launch(Variant("softmax"), shapes_of(LLAMA), CPU, TritonBackend(), TritonElementwise())
