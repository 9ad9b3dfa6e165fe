"""Triton kernels: paged decode attention, one query token per sequence, split along the sequence.

    q                [B, Hq, D]       head h reads KV head h // G, G = Hq / Hkv
    k_cache/v_cache  [N, S, Hkv, D]
    seq_lens         [B]              keys 0 .. seq_lens[b]-1 (the new token's key is stored)
    block_tables     [B, M]           token p of sequence b lives in block block_tables[b, p // S]
    window           W                keys p with seq_len-W <= p (sliding window); 0: all keys

Stage 1, grid (B, Hkv, SPLITS): program (b, kvh, s) loads each K/V tile once for all G query
heads of KV head kvh (a [G, D] x [D, BLOCK_N] product) over its slice of the keys it needs:

    tokens 0 ... first-1 | first .. lo-1 .. first+per-1 | first+per ... | ... seq_len-1
           not visited   | split 0, keys < lo masked    | split 1       | split SPLITS-1
                                                                          (maybe empty)

where lo = max(seq_len - W, 0) (0 when W == 0) is the window's first key, first = lo rounded
down to a multiple of BLOCK_N, and per = cdiv(cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N.
Each split writes its slice's normalized output and log-sum-exp (base 2). Stage 2, grid
(B, Hq), merges the slices by their weights. Splitting lets a small batch of long sequences
fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_launch import dot_precision, for_device, pow2_at_least, upcast_dot

LOG2E = 1.4426950408889634
BLOCK_N = 64
MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, group, head_dim, block_size, window,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vn, stride_vs, stride_vh, stride_vd,
    stride_bt_b, stride_bt_m,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # Window 0 reaches the whole sequence: lo = first = 0, the causal path.
    reach = tl.where(window > 0, window, seq_len)
    lo = tl.maximum(seq_len - reach, 0)
    first = (lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < head_dim
    heads = kvh * group + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = (pos >= lo) & (pos < end)  # lo masks part of the first tile only
        blk = tl.load(table + (pos // block_size) * stride_bt_m, mask=ok, other=0).to(tl.int64)
        off = pos % block_size
        kv_mask = ok[:, None] & d_ok[None, :]
        # Masked rows read as zeros, so never-written (NaN) slots cannot leak into p @ v.
        k = tl.load(
            k_cache_ptr
            + (blk * stride_kn + off * stride_ks + kvh * stride_kh)[:, None]
            + d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G, N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr
            + (blk * stride_vn + off * stride_vs + kvh * stride_vh)[:, None]
            + d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Every tile holds a key of the window (lo < first + BLOCK_N), so m_i is finite after it.
    # An empty split (short sequence) leaves l_i == 0: output 0 with weight exp2(-inf) = 0.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    part = part_o_ptr + b.to(tl.int64) * stride_pb + split * stride_ps
    tl.store(
        part + heads[:, None] * stride_ph + d[None, :] * stride_pd,
        out,
        mask=g_ok[:, None] & d_ok[None, :],
    )
    tl.store(
        part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls,
        lse,
        mask=g_ok,
    )


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, head_dim,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < SPLITS
    d_ok = d < head_dim
    lse = tl.load(
        part_lse_ptr + b * stride_lb + h * stride_lh + s * stride_ls, mask=s_ok, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: every split empty, output 0
    w = tl.exp2(lse - m)
    o = tl.load(
        part_o_ptr
        + b * stride_pb
        + h * stride_ph
        + s[:, None] * stride_ps
        + d[None, :] * stride_pd,
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # pyright: ignore[reportOperatorIssue]
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Enough sequence slices that B * Hkv * splits programs cover the GPU about twice."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4  # the interpreter runs serially; a few splits still exercise the merge
    wanted = triton.cdiv(2 * sms, max(batch * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_len, BLOCK_N), MAX_SPLITS))


def step_splits(batch: int, num_kv_heads: int, table_width: int, block_size: int, window: int,
                device: torch.device) -> int:
    """The split count of a step: num_splits over the longest sequence the step can hold, which
    the block table's width bounds without reading seq_lens on the host."""
    max_len = table_width * block_size
    if window > 0:  # a window spans at most W keys from a tile-aligned start
        max_len = min(max_len, window + BLOCK_N - 1)
    return num_splits(batch, num_kv_heads, max_len, device)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    splits: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Launch both stages; shapes and `window` >= 0 are validated by the caller.
    Returns [B, Hq, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if splits is None:
        splits = step_splits(batch, num_kv_heads, block_tables.shape[1], block_size, window, q.device)
    part_o = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    block_d = pow2_at_least(head_dim, 16)  # tl.dot needs every extent >= 16
    split_kernel = for_device(_decode_split_kernel, q.device)
    split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, seq_lens, block_tables, part_o, part_lse,
        scale * LOG2E, group, head_dim, block_size, window,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *part_o.stride(), *part_lse.stride(),
        SPLITS=splits, BLOCK_G=pow2_at_least(group, 16), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype, split_kernel),
        num_warps=4,
    )  # fmt: skip
    reduce_kernel = for_device(_decode_reduce_kernel, q.device)
    reduce_kernel[(batch, num_heads)](
        part_o, part_lse, out, head_dim,
        *part_o.stride(), *part_lse.stride(), *out.stride(),
        SPLITS=splits, BLOCK_S=pow2_at_least(splits), BLOCK_D=pow2_at_least(head_dim),
        num_warps=1 if head_dim <= 64 else 2,
    )  # fmt: skip
    return out
