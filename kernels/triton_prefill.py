"""Triton kernel: causal variable-length prefill attention over a paged prefix plus new tokens.

    q                [T, Hq, D]       rows cu[b] .. cu[b+1]-1 are sequence b's new tokens
    key, value       [T, Hkv, D]      the same new tokens' keys and values
    k_cache/v_cache  [N, S, Hkv, D]   the cached prefix, through block_tables[b]
    seq_lens         [B]              ctx = prefix + q_len
    window           W                sliding window: W keys per row, itself included; 0: causal

Program (tile, b, h) owns query rows tile*BLOCK_M .. +BLOCK_M-1 of sequence b, head h, and
streams keys in BLOCK_N tiles with an online softmax (flash attention), so no score matrix
larger than [BLOCK_M, BLOCK_N] ever exists. Row i sits at position prefix+i and sees key
position k iff prefix+i-W < k <= prefix+i (W == 0: iff k <= prefix+i):

    keys  0 .. lo-1 | lo ........... prefix-1 | prefix .......... prefix+row
          skipped   | loop 1: paged cache     | loop 2: key/value args (new key j is position
                    |                         | prefix+j), only up to the tile's last row

where lo = max(prefix + tile*BLOCK_M + 1 - W, 0) is the first key of the tile's first row's
window (0 when W == 0), rounded down to a multiple of BLOCK_N: key tiles wholly before it are
never visited; inside the visited tiles each row masks the keys outside its own window.

Grid axis 0 is cdiv(T, BLOCK_M), a bound on every sequence's tile count that needs no host sync;
tiles past a sequence's end do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_launch import dot_precision, for_device, pow2_at_least, upcast_dot

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, group, head_dim, block_size, window,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcn, stride_kcs, stride_kch, stride_kcd,
    stride_vcn, stride_vcs, stride_vch, stride_vcd,
    stride_ot, stride_oh, stride_od,
    stride_bt_b, stride_bt_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // group
    q_start = tl.load(cu_seqlens_ptr + b).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + b + 1).to(tl.int32) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        ctx = tl.load(seq_lens_ptr + b).to(tl.int32)
        prefix = ctx - q_len
        rows = m0 + tl.arange(0, BLOCK_M)
        # Window 0 reaches the whole context, so row_lo <= 0 and lo == 0: the causal path.
        reach = tl.where(window > 0, window, ctx)
        row_lo = prefix + rows + 1 - reach  # each row's first visible key position
        lo = tl.maximum(prefix + m0 + 1 - reach, 0)
        d = tl.arange(0, BLOCK_D)
        row_ok = rows < q_len
        d_ok = d[None, :] < head_dim
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok,
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Loop 1: the cached prefix, gathered token by token through the block table so that
        # any block size (1 included) and any block order work.
        table = block_tables_ptr + b.to(tl.int64) * stride_bt_b
        for n0 in range((lo // BLOCK_N) * BLOCK_N, prefix, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = (pos >= lo) & (pos < prefix)
            blk = tl.load(table + (pos // block_size) * stride_bt_m, mask=ok, other=0).to(tl.int64)
            off = pos % block_size
            kv_mask = ok[:, None] & d_ok
            k = tl.load(
                k_cache_ptr
                + (blk * stride_kcn + off * stride_kcs + kvh * stride_kch)[:, None]
                + d[None, :] * stride_kcd,
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(ok[None, :] & (pos[None, :] >= row_lo[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row whose window starts past this tile has seen no key yet (m_new = -inf):
            # subtracting 0 instead keeps its alpha and p at 0 rather than NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr
                + (blk * stride_vcn + off * stride_vcs + kvh * stride_vch)[:, None]
                + d[None, :] * stride_vcd,
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m_i = m_new

        # Loop 2: this step's tokens, contiguous in key/value; stops at the tile's last row.
        hi = tl.minimum(q_len, m0 + BLOCK_M)
        lo_new = tl.maximum(lo - prefix, 0)
        for n0 in range((lo_new // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ok = (cols >= lo_new) & (cols < q_len)
            kv_rows = (q_start + cols).to(tl.int64)
            kv_mask = ok[:, None] & d_ok
            k = tl.load(
                key_ptr + kv_rows[:, None] * stride_kt + kvh * stride_kh + d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            visible = (
                ok[None, :]
                & (cols[None, :] <= rows[:, None])
                & (prefix + cols[None, :] >= row_lo[:, None])
            )
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                value_ptr + kv_rows[:, None] * stride_vt + kvh * stride_vh + d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m_i = m_new

        # Every row sees its own key, so l_i > 0 on the rows stored; rows past q_len may not.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok,
        )


def tile_sizes(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): flash-attention tiles that fit a GPU's shared memory."""
    if head_dim <= 128:
        return 64, 64, 4
    return 64, 32, 8


def prefill_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Launch the prefill kernel; shapes and `window` >= 0 are validated by the caller.
    Returns [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    group = num_heads // k_cache.shape[2]
    block_m, block_n, warps = tile_sizes(head_dim)
    kernel = for_device(_prefill_kernel, q.device)
    kernel[(triton.cdiv(num_tokens, block_m), batch, num_heads)](
        q, key, value, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
        scale * LOG2E, group, head_dim, k_cache.shape[1], window,
        *q.stride(), *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        *out.stride(), *block_tables.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=pow2_at_least(head_dim, 16),
        PRECISION=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype, kernel),
        num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out
