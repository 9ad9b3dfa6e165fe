"""KV transports behind one interface: `make_sender(kind)` / `make_receiver(kind, address)`.

kinds: "tcp" (any host), "shm" (same host, CPU), "cuda_ipc" (same host, CUDA GPU).
"""

from __future__ import annotations

import torch

from pdserve.kvtransfer.transport.base import (
    KVReceiver,
    KVSender,
    PartArrived,
    ReceivedKV,
    StreamEnded,
    TransportError,
    TransportUnavailable,
)

KINDS = ("tcp", "shm", "cuda_ipc")


def available_kinds() -> tuple[str, ...]:
    """The kinds this machine can run (cuda_ipc only with a CUDA GPU)."""
    return KINDS if torch.cuda.is_available() else ("tcp", "shm")


def make_sender(kind: str, **options: object) -> KVSender:
    """A started sender; options: lease_s, and max_pool_bytes (shm) or device (cuda_ipc)."""
    if kind == "tcp":
        from pdserve.kvtransfer.transport.tcp import TcpKVSender as cls
    elif kind == "shm":
        from pdserve.kvtransfer.transport.shm import ShmKVSender as cls  # type: ignore[assignment]
    elif kind == "cuda_ipc":
        from pdserve.kvtransfer.transport.cuda_ipc import CudaIpcKVSender as cls  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown KV transport {kind!r}; choose one of {KINDS}")
    return cls(**options)  # type: ignore[arg-type]


def make_receiver(kind: str, address: str, **options: object) -> KVReceiver:
    """A receiver bound to `address` ("tcp://127.0.0.1:0" picks a free port; see `.address`).
    Options: fingerprint (refuse KV of another model layout), receiver_id (refuse KV for another
    worker), max_frame_bytes, max_mappings (shm)."""
    if kind == "tcp":
        from pdserve.kvtransfer.transport.tcp import TcpKVReceiver as cls
    elif kind == "shm":
        from pdserve.kvtransfer.transport.shm import ShmKVReceiver as cls  # type: ignore[assignment]
    elif kind == "cuda_ipc":
        from pdserve.kvtransfer.transport.cuda_ipc import CudaIpcKVReceiver as cls  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown KV transport {kind!r}; choose one of {KINDS}")
    return cls(address, **options)  # type: ignore[arg-type]


__all__ = [
    "KINDS",
    "KVReceiver",
    "KVSender",
    "PartArrived",
    "ReceivedKV",
    "StreamEnded",
    "TransportError",
    "TransportUnavailable",
    "available_kinds",
    "make_receiver",
    "make_sender",
]
