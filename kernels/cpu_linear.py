"""The weight layout of the compiled CPU linear (kernels/csrc/cpu_linear.cpp).

W [N, K] is packed once, at load, into panels of 24 output columns, [ceil(N/24), K, 24], the last
one zero-padded: each panel then streams front to back while the kernel multiplies it with a
block of rows of x. `x @ W.T` on the plain weight is its oracle.
"""

from __future__ import annotations

import torch

PANEL = 24


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (any strides) -> contiguous [ceil(N/24), K, 24] panels in the same dtype."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def linear(ops: object, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] -> [..., N] through the compiled kernel (float32 or bfloat16 CPU tensors)."""
    if x.dim() == 2:
        return ops.linear(x, panels, out_features)  # type: ignore[attr-defined]
    flat = ops.linear(x.reshape(-1, x.shape[-1]), panels, out_features)  # type: ignore[attr-defined]
    return flat.view(*x.shape[:-1], out_features)
