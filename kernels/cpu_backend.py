"""The compiled CPU backend: paged decode attention in C++ (kernels/csrc/cpu_attention.cpp).

Decode reads each sequence's keys and values in place from the paged cache, one work item per
(sequence, KV head), parallel over torch's intra-op threads; with a sliding window only the
window's positions, never the blocks before it. store_kv is one compiled call per
layer (a memcpy per token, slots checked once) instead of the reference's masking and two
index_copy_ calls. A float32 prefill is blocked matmuls with the softmax between them
(kernels/csrc/cpu_prefill.cpp). A bfloat16 prefill runs on bfloat16 tiles where the head size is
a multiple of 32 and the CPU has AMX or AVX512-BF16 (kernels/csrc/cpu_prefill_tiles.cpp);
elsewhere it stays on SDPA. Both are faster than torch's SDPA where they run
(`python -m pdserve.bench.engine_overhead` against `--attention-backend reference`, prefills of
256 and 1,024 tokens; docs/cpu_kernels.md, "Prefill attention").
Dtypes other than float32 and bfloat16, or a cache whose dtype differs from q's, fall back to
the reference.
"""

from __future__ import annotations

import torch

from pdserve.kernels.cpu_linear import tiles_run
from pdserve.kernels.interface import check_shapes, check_window
from pdserve.kernels.reference import ReferenceBackend

COMPILED_DTYPES = (torch.float32, torch.bfloat16)


class CpuBackend(ReferenceBackend):
    name = "cpu"

    def __init__(self, ops: object) -> None:
        self.ops = ops
        # The bfloat16 prefill kernel's tiles are fast on AMX and on AVX512-BF16 (elsewhere a
        # portable loop emulates them).
        self.tiled_prefill = tiles_run(ops)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if not computes(key, value, k_cache):
            return super().store_kv(key, value, k_cache, v_cache, slot_mapping)
        self.ops.store_kv_(key, value, k_cache, v_cache, slot_mapping)  # type: ignore[attr-defined]

    def causal_attention(self, q, k, v, offset: int, scale: float, window: int = 0) -> torch.Tensor:
        if not computes(q, k, v) or not self.compiles_prefill(q.dtype, q.shape[-1]):
            return super().causal_attention(q, k, v, offset, scale, window)
        return self.ops.prefill_attention(q, k, v, offset, float(scale), check_window(window))  # type: ignore[attr-defined]

    def compiles_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """float32 always; bfloat16 where its tiles run natively (AMX or AVX512-BF16) and the head
        size is whole tile rows (32 bfloat16)."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.tiled_prefill and head_dim % 32 == 0)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, block_tables, scale, window: int = 0) -> torch.Tensor:
        check_shapes(q, k_cache, v_cache)
        if not computes(q, k_cache, v_cache):
            return super().decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window)
        return self.ops.decode_attention(  # type: ignore[attr-defined]
            q, k_cache, v_cache, seq_lens.to(torch.int32), block_tables.to(torch.int32).contiguous(), float(scale),
            check_window(window),
        )


def computes(first: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the compiled ops take these tensors: CPU, and one dtype they compute in."""
    return first.device.type == "cpu" and first.dtype in COMPILED_DTYPES and all(t.dtype == first.dtype for t in others)
