"""Choosing the attention backend (kernels/interface.py is the interface both nodes share).

`get_backend(device)` picks the implementation: the Triton kernels for CUDA tensors; on the CPU
the compiled C++ kernels (kernels/cpu_backend.py), or the PyTorch reference where they cannot be
built (kernels/cpu_ops.py says why, once). `--attention-backend cpu|reference|triton` forces one (the reference anywhere, to compare; Triton on the CPU under
`TRITON_INTERPRET=1`, to test).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.kernels.interface import AttentionBackend
from pdserve.kernels.reference import ReferenceBackend

__all__ = ["get_backend"]


def get_backend(device: torch.device | str, name: str | None = None, *, cpu_kernels: str = "auto",
                require_cpu_kernels: bool = False, kernel_cache: str | None = None) -> AttentionBackend:
    """The attention backend for `device`; `name` overrides the choice. The compiled CPU kernels
    load as `cpu_ops.load(cpu_kernels, require=require_cpu_kernels, cache_dir=kernel_cache)`."""
    choice = name
    if choice is None:
        choice = "triton" if torch.device(device).type == "cuda" else "cpu-or-reference"
    if choice in ("cpu", "cpu-or-reference"):
        from pdserve.kernels import cpu_ops
        from pdserve.kernels.cpu_backend import CpuBackend

        ops = cpu_ops.load(cpu_kernels, require=require_cpu_kernels,
                           cache_dir=Path(kernel_cache) if kernel_cache else None)
        if ops is not None:
            return CpuBackend(ops)
        if choice == "cpu":
            raise RuntimeError("attention backend 'cpu' is unavailable: its C++ kernels did not build (see the log)")
        return ReferenceBackend()
    if choice == "reference":
        return ReferenceBackend()
    if choice == "triton":
        try:
            from pdserve.kernels.triton_backend import TritonBackend
        except ImportError as exc:  # triton missing, or the kernels not importable on this platform
            raise RuntimeError(f"attention backend 'triton' is unavailable: {exc}") from exc
        return TritonBackend()
    raise ValueError(f"unknown attention backend {choice!r}; choose 'cpu', 'reference' or 'triton'")
