"""The compiled CPU backend: paged decode attention in C++ (kernels/csrc/cpu_attention.cpp).

Decode reads each sequence's keys and values in place from the paged cache, one work item per
(sequence, KV head), parallel over torch's intra-op threads. store_kv is one compiled call per
layer (a memcpy per token, slots checked once) instead of the reference's masking and two
index_copy_ calls. A float32 prefill is blocked matmuls with the softmax between them
(kernels/csrc/cpu_prefill.cpp: 1.3-1.5x torch's SDPA on a 2-core AVX2 EPYC); bfloat16 stays on
SDPA, whose oneDNN kernels use AMX or AVX512-BF16 where the CPU has them.
Dtypes other than float32 and bfloat16, or a cache whose dtype differs from q's, fall back to
the reference.
"""

from __future__ import annotations

import torch

from pdserve.kernels.interface import check_shapes
from pdserve.kernels.reference import ReferenceBackend

COMPILED_DTYPES = (torch.float32, torch.bfloat16)


class CpuBackend(ReferenceBackend):
    name = "cpu"

    def __init__(self, ops: object) -> None:
        self.ops = ops

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if not computes(key, value, k_cache):
            return super().store_kv(key, value, k_cache, v_cache, slot_mapping)
        self.ops.store_kv_(key, value, k_cache, v_cache, slot_mapping)  # type: ignore[attr-defined]

    def causal_attention(self, q, k, v, offset: int, scale: float) -> torch.Tensor:
        # float32 only: in bfloat16, SDPA's oneDNN kernels use AMX / AVX512-BF16 where they exist.
        if q.dtype != torch.float32 or not computes(q, k, v):
            return super().causal_attention(q, k, v, offset, scale)
        return self.ops.prefill_attention(q, k, v, offset, float(scale))  # type: ignore[attr-defined]

    def decode_attention(self, q, k_cache, v_cache, seq_lens, block_tables, scale) -> torch.Tensor:
        check_shapes(q, k_cache, v_cache)
        if not computes(q, k_cache, v_cache):
            return super().decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale)
        return self.ops.decode_attention(  # type: ignore[attr-defined]
            q, k_cache, v_cache, seq_lens.to(torch.int32), block_tables.to(torch.int32).contiguous(), float(scale)
        )


def computes(first: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the compiled ops take these tensors: CPU, and one dtype they compute in."""
    return first.device.type == "cpu" and first.dtype in COMPILED_DTYPES and all(t.dtype == first.dtype for t in others)
