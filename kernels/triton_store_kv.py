"""Triton kernel: write one step's keys and values into the paged KV cache through slot_mapping.

    key, value       [T, Hkv, D]      row t goes to slot_mapping[t]
    k_cache/v_cache  [N, S, Hkv, D]   slot = block * S + offset; a negative slot is skipped

Each program copies BLOCK_T tokens, all heads, as one [BLOCK_T, BLOCK_H, BLOCK_D] tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_launch import for_device, pow2_at_least


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, num_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcn, stride_kcs, stride_kch, stride_kcd,
    stride_vcn, stride_vcs, stride_vch, stride_vcd,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    keep = t_ok & (slot >= 0)
    slot = tl.where(keep, slot, 0)  # keeps the address arithmetic of skipped rows in range
    blk = slot // block_size
    off = slot % block_size
    t64 = t.to(tl.int64)

    mask = keep[:, None, None] & (h < num_heads)[None, :, None] & (d < head_dim)[None, None, :]
    hd_k = h[None, :, None] * stride_kh + d[None, None, :] * stride_kd
    hd_v = h[None, :, None] * stride_vh + d[None, None, :] * stride_vd
    k = tl.load(key_ptr + t64[:, None, None] * stride_kt + hd_k, mask=mask)
    v = tl.load(value_ptr + t64[:, None, None] * stride_vt + hd_v, mask=mask)

    dst_k = blk * stride_kcn + off * stride_kcs
    dst_v = blk * stride_vcn + off * stride_vcs
    hd_kc = h[None, :, None] * stride_kch + d[None, None, :] * stride_kcd
    hd_vc = h[None, :, None] * stride_vch + d[None, None, :] * stride_vcd
    tl.store(
        k_cache_ptr + dst_k[:, None, None] + hd_kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask
    )
    tl.store(
        v_cache_ptr + dst_v[:, None, None] + hd_vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the store kernel; shapes are validated by the caller (TritonBackend)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_h = pow2_at_least(num_heads)
    block_d = pow2_at_least(head_dim)
    # About 4k elements a program: enough work per launch, little register pressure.
    block_t = max(1, min(16, 4096 // (block_h * block_d)))
    grid = (triton.cdiv(num_tokens, block_t),)
    kernel = for_device(_store_kv_kernel, key.device)
    kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens, num_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
