"""Choosing the attention backend (kernels/interface.py is the interface both nodes share).

`get_backend(device)` picks the implementation: the Triton kernels for CUDA tensors, the PyTorch
reference for everything else. `PDSERVE_ATTENTION_BACKEND=reference|triton` forces either (the
reference on a GPU to compare; Triton on the CPU under `TRITON_INTERPRET=1` to test).
"""

from __future__ import annotations

import os

import torch

from pdserve.kernels.interface import AttentionBackend
from pdserve.kernels.reference import ReferenceBackend

__all__ = ["get_backend"]

BACKEND_ENV = "PDSERVE_ATTENTION_BACKEND"


def get_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The attention backend for `device`; `name` (or the env variable) overrides the choice."""
    choice = name or os.environ.get(BACKEND_ENV) or ("triton" if torch.device(device).type == "cuda" else "reference")
    if choice == "reference":
        return ReferenceBackend()
    if choice == "triton":
        try:
            from pdserve.kernels.triton_backend import TritonBackend
        except ImportError as exc:  # triton missing, or the kernels not importable on this platform
            raise RuntimeError(f"attention backend 'triton' is unavailable: {exc}") from exc
        return TritonBackend()
    raise ValueError(f"unknown attention backend {choice!r}; choose 'reference' or 'triton'")
