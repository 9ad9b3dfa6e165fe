"""The Triton attention backend: validates at the edge, then launches one kernel module per op.

Kernels compute in float32 accumulators and return q's dtype. CUDA tensors run compiled kernels;
CPU tensors run the same kernels in Triton's interpreter (see kernels/triton_launch.py), which is
how they are tested without a GPU.
"""

from __future__ import annotations

import torch

from pdserve.kernels import triton_decode, triton_prefill, triton_store_kv
from pdserve.kernels.interface import AttentionBackend, check_shapes, check_window

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256  # one [BLOCK, D] tile per operand must fit a GPU's shared memory


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(a).removeprefix("torch.") for a in allowed)
        raise ValueError(f"{name} has dtype {t.dtype}; the triton backend takes {names}")


def _check_device(*named: tuple[str, torch.Tensor]) -> None:
    device = named[0][1].device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"the triton backend runs on CUDA tensors (CPU only for tests), got {device}"
        )
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {named[0][0]} is on {device}")


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_shapes(q, k_cache, v_cache)
    _check_dtype("q", q, SUPPORTED_DTYPES)
    _check_dtype("k_cache", k_cache, SUPPORTED_DTYPES)
    _check_dtype("v_cache", v_cache, SUPPORTED_DTYPES)
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(
            f"head size {q.shape[2]} is above the triton backend's limit of {MAX_HEAD_DIM}"
        )


def _check_tables(seq_lens: torch.Tensor, block_tables: torch.Tensor, batch: int) -> None:
    _check_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    _check_dtype("block_tables", block_tables, INDEX_DTYPES)
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, M], got {tuple(block_tables.shape)}")


class TritonBackend(AttentionBackend):
    """Triton kernels for the three operations. Stateless: `decode_splits` only fixes the
    split-K factor (None: sized to the GPU) so that tests can force the merge path."""

    name = "triton"

    def __init__(self, decode_splits: int | None = None) -> None:
        if decode_splits is not None and not 1 <= decode_splits <= triton_decode.MAX_SPLITS:
            raise ValueError(
                f"decode_splits must be in 1..{triton_decode.MAX_SPLITS}, got {decode_splits}"
            )
        self.decode_splits = decode_splits

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        check_shapes(key, k_cache, v_cache)
        if value.shape != key.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        if key.shape[1] != k_cache.shape[2]:
            raise ValueError(f"key has {key.shape[1]} heads but the cache has {k_cache.shape[2]}")
        if slot_mapping.shape != (key.shape[0],):
            raise ValueError(
                f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}"
            )
        for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
            _check_dtype(name, t, SUPPORTED_DTYPES)
        _check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
        _check_device(
            ("key", key),
            ("value", value),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("slot_mapping", slot_mapping),
        )
        triton_store_kv.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def prefill_attention(
        self, q, key, value, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
        window: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        _check_cache(q, k_cache, v_cache)
        check_window(window)
        expected = (q.shape[0], k_cache.shape[2], q.shape[2])
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must be [T, Hkv, D] = {expected}, got {tuple(t.shape)}")
            _check_dtype(name, t, SUPPORTED_DTYPES)
        _check_dtype("cu_seqlens_q", cu_seqlens_q, INDEX_DTYPES)
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise ValueError(f"cu_seqlens_q must be [B+1], got {tuple(cu_seqlens_q.shape)}")
        _check_tables(seq_lens, block_tables, cu_seqlens_q.shape[0] - 1)
        _check_device(
            ("q", q), ("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
            ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_tables", block_tables),
        )  # fmt: skip
        return triton_prefill.prefill_attention(
            q, key, value, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, float(scale),
            window=window,
        )  # fmt: skip

    def decode_attention(
        self, q, k_cache, v_cache, seq_lens, block_tables, scale, window: int = 0
    ) -> torch.Tensor:
        _check_cache(q, k_cache, v_cache)
        check_window(window)
        _check_tables(seq_lens, block_tables, q.shape[0])
        _check_device(
            ("q", q),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("seq_lens", seq_lens),
            ("block_tables", block_tables),
        )
        return triton_decode.decode_attention(
            q, k_cache, v_cache, seq_lens, block_tables, float(scale),
            splits=self.decode_splits, window=window,
        )  # fmt: skip
