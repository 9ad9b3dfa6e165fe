"""Every Triton kernel variant a configuration can reach, compiled before a worker reports ready.

Triton compiles a kernel once per variant: its constexpr arguments (tile sizes, the split count,
flags), num_warps and num_stages, the dtypes of its pointers, and how it specializes the rest
(an int equal to 1 or a multiple of 16, a pointer on a 16-byte boundary). A step that meets a new
variant waits for its compilation (a second or more, on the engine loop). The model, dtype and
block size fix almost everything; what a step changes, and so what the warm-up enumerates:

    kernel              what the step changes                      enumerated as
    store_kv            its token count T (an int argument)        T = 1, 16, 2  (1 | 16k | other)
    decode, stage 1     SPLITS = step_splits(batch, table width);  every reachable (SPLITS, class
                        the block table's width (a stride)         of the width) pair, per window
    decode, stage 2     SPLITS                                     (the same launches)
    prefill             the block table's width                    width 1, 16, 2, per window
    RMSNorm, rotary,    nothing: a row count is only a grid size   one launch each (with and
    SiLU-mul                                                       without the residual add; the
                                                                   q/k norm's width)

The batch ranges over 1 .. min(max_num_seqs, token budget), the width over 1 .. the blocks of the
longest sequence, the windows over the layers' (0: full attention). Each variant is launched once
on tensors laid out as the model lays them out (q, k and v views of one qkv projection, a layer's
view of the KV cache, fresh index tensors); tests/kernels/test_triton_warmup.py checks that the
set of variants launched here is exactly the set the model launches over every step shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdserve.kernels import triton_decode
from pdserve.kernels.triton_backend import TritonBackend
from pdserve.kernels.triton_elementwise import TritonElementwise

log = logging.getLogger(__name__)

DIVISOR = 16  # Triton specializes an int argument on being a multiple of this (and on being 1)


@dataclass(frozen=True, slots=True)
class KernelShapes:
    """What fixes the variants: the model's widths, the serving dtype, the engine's limits."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    token_budget: int  # the scheduler's max_num_batched_tokens (as the policy set it)
    max_blocks_per_seq: int  # the widest block table: min(cdiv(max_model_len, block_size), KV blocks)
    windows: tuple[int, ...] = (0,)  # the layers' distinct windows (0: full attention)
    qk_norm: bool = False
    silu: bool = True  # the MLP's activation is SiLU (GELU-tanh has no Triton kernel)
    attention: bool = True  # the attention backend is Triton's
    fused_ops: bool = True  # RMSNorm, rotary and SiLU-mul run as Triton kernels
    decode_splits: int | None = None  # TritonBackend.decode_splits (None: sized to the device)


@dataclass(frozen=True, slots=True)
class Variant:
    """One launch that compiles one variant: its op and the step shape that reaches it."""

    op: str  # store_kv, decode, prefill, rms_norm, add_rms_norm, qk_norm, rotary, silu_mul
    tokens: int = 1
    batch: int = 1
    width: int = 1  # the block table's width, in blocks
    window: int = 0


def int_class(n: int) -> str:
    """How Triton tells ints apart when it specializes a kernel: 1, a multiple of 16, other."""
    return "1" if n == 1 else "16" if n % DIVISOR == 0 else ""


def _class_representatives(limit: int) -> list[int]:
    """One int of each class in 1 .. limit, the smallest: 1, 2, 16."""
    return [n for n in (1, 2, DIVISOR) if n <= limit]


def _decode_variants(s: KernelShapes, device: torch.device, window: int) -> Iterator[Variant]:
    """The first (batch, width) reaching each (SPLITS, width class) pair. SPLITS grows with the
    width up to a cap that the batch sets, so each batch stops DIVISOR widths past its cap (by
    then every width class has been seen at it)."""
    seen: set[tuple[int, str]] = set()
    max_batch = min(s.max_num_seqs, s.token_budget)

    def splits(batch: int, width: int) -> int:
        if s.decode_splits is not None:
            return s.decode_splits
        return triton_decode.step_splits(batch, s.num_kv_heads, width, s.block_size, window, device)

    for batch in range(1, max_batch + 1):
        cap, capped_at = splits(batch, s.max_blocks_per_seq), None
        for width in range(1, s.max_blocks_per_seq + 1):
            n = splits(batch, width)
            if (n, int_class(width)) not in seen:
                seen.add((n, int_class(width)))
                yield Variant("decode", tokens=batch, batch=batch, width=width, window=window)
            if n == cap:
                capped_at = capped_at or width
                if width >= capped_at + DIVISOR:
                    break


def variants(s: KernelShapes, device: torch.device) -> list[Variant]:
    """Every variant `s` can reach on `device`, each with a step shape that reaches it."""
    out: list[Variant] = []
    windows = sorted(set(s.windows))
    if s.attention:
        out += [Variant("store_kv", tokens=t) for t in _class_representatives(s.token_budget)]
        for window in windows:
            out += _decode_variants(s, device, window)
            if s.token_budget >= 2:  # a one-token chunk runs as a decode
                out += [Variant("prefill", tokens=2, width=w, window=window)
                        for w in _class_representatives(s.max_blocks_per_seq)]
    if s.fused_ops:
        out += [Variant("rms_norm"), Variant("add_rms_norm"), Variant("rotary")]
        if s.qk_norm:
            out.append(Variant("qk_norm"))
        if s.silu:
            out.append(Variant("silu_mul"))
    return out


class _Step:
    """A step's tensors as the model has them: q, k, v views of one qkv projection of T rows
    (contiguous q and k after a q/k norm), one layer's K and V caches of one block."""

    def __init__(self, s: KernelShapes, device: torch.device, tokens: int) -> None:
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = torch.zeros(tokens, q_size + 2 * kv_size, dtype=s.dtype, device=device)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        if s.qk_norm:  # the norms' outputs are new contiguous [T * heads, D] tensors
            q, k = q.reshape(-1, s.head_dim).contiguous(), k.reshape(-1, s.head_dim).contiguous()
        self.q = q.view(tokens, s.num_heads, s.head_dim)
        self.k = k.view(tokens, s.num_kv_heads, s.head_dim)
        self.v = v.view(tokens, s.num_kv_heads, s.head_dim)
        kv = torch.zeros(2, 1, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)
        self.k_cache, self.v_cache = kv[0], kv[1]
        self.device = device

    def ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def table(self, batch: int, width: int) -> torch.Tensor:
        """Every entry block 0: only the width (a stride) matters to the variant."""
        return torch.zeros(batch, width, dtype=torch.int32, device=self.device)


def launch(v: Variant, s: KernelShapes, device: torch.device, backend: TritonBackend,
           ops: TritonElementwise) -> None:
    """Run variant `v` once on `device` (through the backend's and the ops' own launch code)."""
    step = _Step(s, device, v.tokens)
    scale = s.head_dim ** -0.5
    if v.op == "store_kv":
        slots = torch.zeros(v.tokens, dtype=torch.int64, device=device)
        backend.store_kv(step.k, step.v, step.k_cache, step.v_cache, slots)
    elif v.op == "decode":
        backend.decode_attention(step.q, step.k_cache, step.v_cache, step.ints([1] * v.batch),
                                 step.table(v.batch, v.width), scale, window=v.window)
    elif v.op == "prefill":
        backend.prefill_attention(step.q, step.k, step.v, step.k_cache, step.v_cache, step.ints([0, v.tokens]),
                                  step.ints([v.tokens]), step.table(1, v.width), scale, window=v.window)
    elif v.op in ("rms_norm", "add_rms_norm", "qk_norm"):
        width = s.head_dim if v.op == "qk_norm" else s.hidden_size
        x = torch.zeros(v.tokens, width, dtype=s.dtype, device=device)
        weight = torch.ones(width, dtype=s.dtype, device=device)
        if v.op == "add_rms_norm":
            ops.add_rms_norm_(x, torch.zeros_like(x), weight, 1e-5)
        else:
            ops.rms_norm(x, weight, 1e-5)
    elif v.op == "rotary":
        table = torch.zeros(1, s.head_dim // 2, dtype=torch.float32, device=device)  # the model's are float32
        positions = torch.zeros(v.tokens, dtype=torch.int64, device=device)
        ops.rotary_(step.q, step.k, positions, table, table.clone())
    elif v.op == "silu_mul":
        ops.silu_mul(torch.zeros(v.tokens, 2 * s.intermediate_size, dtype=s.dtype, device=device))
    else:
        raise ValueError(f"unknown warm-up op {v.op!r}")


def warm_up(s: KernelShapes, device: torch.device, backend: TritonBackend | None = None,
            ops: TritonElementwise | None = None) -> list[Variant]:
    """Compile (run once) every variant `s` reaches on `device`, then wait for the device;
    returns them. `backend` and `ops`: the engine's own (its decode_splits)."""
    backend = backend or TritonBackend(s.decode_splits)
    ops = ops or TritonElementwise()
    start = time.monotonic()
    todo = variants(s, device)
    for v in todo:
        launch(v, s, device, backend, ops)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("Triton warm-up: %d kernel variants on %s in %.1f s", len(todo), device, time.monotonic() - start)
    return todo
