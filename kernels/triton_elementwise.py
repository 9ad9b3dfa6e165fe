"""Triton kernels for the model's elementwise work on a GPU: RMSNorm, the residual add fused into
the RMSNorm after it, rotary embedding in place, and SiLU-mul.

Eager PyTorch spends several kernel launches on each (RMSNorm alone is a cast, a square, a mean,
an add, a reciprocal square root and two products): a decode step of SmolLM2 is over a thousand
launches, and the host's cost per launch, not the GPU, sets its time (docs/gpu.md, "Speed:
launch-bound").
Here each is one launch. `TritonElementwise` has the methods, names and semantics of the compiled
CPU ops (kernels/csrc/cpu_elementwise.cpp), so `LlamaForCausalLM.use_fused_ops` takes either.

Each rounds where the PyTorch code it replaces rounds (the residual sum, the normalised row, the
products of rotary and SiLU-mul, in the activation dtype), so in float32 they agree with it to
float32 rounding, and in bfloat16 to a bfloat16 step where a sum's order tips a rounding. The
PyTorch code stays the oracle (tests/kernels/test_triton_elementwise.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_launch import for_device, pow2_at_least


@triton.jit
def _rms_norm_kernel(
    x_ptr, y_ptr, w_ptr, out_ptr, width, stride_x, stride_y, stride_out, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # x += y, rounded to x's dtype as x.add_(y) rounds it
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    normed = (xf * r).to(x_ptr.dtype.element_ty)  # the normalised row, in x's dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_table, half,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < half
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    # The tables are float32; PyTorch rounds them to the activation dtype before the products.
    c = tl.load(cos_ptr + pos * stride_table + i, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_table + i, mask=mask, other=0.0).to(dtype).to(tl.float32)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=mask, other=0.0).to(tl.float32)
    # torch.cat((x1 cos - x2 sin, x2 cos + x1 sin)), each product and sum rounded as eager rounds it
    a = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    b = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(base + i, a.to(dtype), mask=mask)
    tl.store(base + half + i, b.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, inter, stride_gu, stride_out,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu(gate), in the dtype
    tl.store(out_ptr + row * stride_out + cols, (silu * u).to(dtype), mask=mask)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x as [rows, width] with unit stride along the width (a view where it can be one)."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{what}: need a non-empty last dimension, got {tuple(x.shape)}")
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class TritonElementwise:
    """RMSNorm, residual-add RMSNorm, rotary and SiLU-mul as one Triton launch each, for CUDA
    tensors (CPU ones in Triton's interpreter, for tests)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += y in place, then return RMSNorm(x) * weight."""
        if y.shape != x.shape:
            raise ValueError(f"add_rms_norm_: y {tuple(y.shape)} must match x {tuple(x.shape)}")
        return self._norm(x, y, weight, eps)

    def _norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"RMSNorm weight {tuple(weight.shape)} must be [{x.shape[-1]}]")
        x2 = x.view(-1, x.shape[-1])  # in place: x's rows must be addressable as they are
        if x2.stride(-1) != 1:
            raise ValueError("RMSNorm runs on rows with unit stride")
        y2 = _rows(y, "add_rms_norm_") if y is not None else x2
        out = torch.empty_like(x2)
        if x2.shape[0]:
            kernel = for_device(_rms_norm_kernel, x.device)
            kernel[(x2.shape[0],)](
                x2, y2, weight, out, x2.shape[1], x2.stride(0), y2.stride(0), out.stride(0), float(eps),
                ADD=y is not None, BLOCK=pow2_at_least(x2.shape[1]), num_warps=4,
            )  # fmt: skip
        return out.view(x.shape)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
        """q [T, Hq, D] and k [T, Hk, D] rotated in place (rotate-half); cos/sin [P, D/2]."""
        if cos.shape != sin.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rotary_: cos and sin must be [P, D/2] tables of one layout")
        if positions.shape != q.shape[:1]:
            raise ValueError(f"rotary_: {positions.shape[0]} positions for {q.shape[0]} tokens")
        positions = positions.contiguous()
        for x in (q, k):
            t, heads, d = x.shape
            if d % 2 or cos.shape[-1] != d // 2 or x.stride(-1) != 1:
                raise ValueError(f"rotary_: x {tuple(x.shape)} against a table of {cos.shape[-1]} frequencies")
            if t == 0:
                continue
            kernel = for_device(_rotary_kernel, x.device)
            kernel[(t, heads)](
                x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), d // 2,
                BLOCK=pow2_at_least(d // 2), num_warps=1,
            )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [..., 2I] (gate first): [..., I]."""
        if gate_up.shape[-1] % 2:
            raise ValueError(f"silu_mul: the last dimension ({gate_up.shape[-1]}) must be even")
        gu = _rows(gate_up, "silu_mul")
        inter = gu.shape[1] // 2
        out = torch.empty(gu.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
        if gu.shape[0]:
            block = min(1024, pow2_at_least(inter))
            kernel = for_device(_silu_mul_kernel, gate_up.device)
            kernel[(gu.shape[0], triton.cdiv(inter, block))](
                gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4,
            )  # fmt: skip
        return out.view(*gate_up.shape[:-1], inter)
