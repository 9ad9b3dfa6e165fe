"""KV through CUDA IPC (same host, GPU): the payload stays in GPU memory; a handle travels.

Sender: stages the payload as a contiguous CUDA tensor (the `gather_blocks` result itself when it
already is one), checksums it on the device (`wsum64`), and sends the fields of
`storage._share_cuda_()` one by one in a msgspec `CudaIpcLocation` (never pickle). It holds the
staging tensor until the ack or lease expiry; torch's IPC reference counting additionally keeps
the memory alive while the receiver still maps it.

Receiver: rebuilds the storage with `torch.UntypedStorage._new_shared_cuda(...)` (what
`torch.multiprocessing` does, minus the pickle) and views the payload in it. A handle cannot be
opened by the process that made it, so when sender and receiver share a process (tests, bench)
the receiver finds the staged tensor in a process-local table instead, as torch's own
`shared_cache` does.
"""

from __future__ import annotations

import secrets
import threading

import msgspec
import torch

from pdserve.engine.device import on_kv_stream
from pdserve.kvtransfer.payload import KVHeader, with_header
from pdserve.kvtransfer.tensors import describe, validate_header
from pdserve.kvtransfer.transport.base import TransportError, TransportUnavailable
from pdserve.kvtransfer.transport.tcp import ZmqKVReceiver, ZmqKVSender
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KVTransfer


class CudaIpcLocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`UntypedStorage._share_cuda_()`'s tuple, field by field, plus where the tensor starts."""

    process: bytes  # the sending process's random token (pids repeat across containers)
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    tensor_offset: int  # in elements, within the storage


_location_decoder = msgspec.msgpack.Decoder(CudaIpcLocation)
_PROCESS = secrets.token_bytes(8)


class _OwnRegions:
    """Payloads this process staged, by IPC location. CUDA refuses to open an IPC handle in the
    process that made it, so a receiver in the sender's own process (one process serving both
    ends, as the colocated benchmark and the in-process tests do) reads the staged tensor here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: dict[tuple[bytes, int, int], torch.Tensor] = {}

    def add(self, loc: CudaIpcLocation, t: torch.Tensor) -> None:
        with self._lock:
            self._staged[_key(loc)] = t

    def drop(self, loc: CudaIpcLocation) -> None:
        with self._lock:
            self._staged.pop(_key(loc), None)

    def get(self, loc: CudaIpcLocation) -> torch.Tensor | None:
        with self._lock:
            return self._staged.get(_key(loc))


_own_regions = _OwnRegions()


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise TransportUnavailable(
            "the cuda_ipc KV transport needs a CUDA GPU on this host (torch.cuda.is_available() is "
            "False); use kv_transport 'shm' (same host, CPU) or 'tcp'"
        )


def _key(loc: CudaIpcLocation) -> tuple[bytes, int, int]:
    return (loc.handle, loc.storage_offset_bytes, loc.tensor_offset)


class CudaIpcKVSender(ZmqKVSender):
    """Shares each payload's CUDA memory by IPC handle."""

    kind = "cuda_ipc"
    leases_region = True

    def __init__(
        self, *, lease_s: float = 5.0, device: int | None = None, name: str = "kv-sender-cuda-ipc",
        auth: FrameAuth | None = None,
    ) -> None:
        require_cuda()
        self.device = torch.device(
            "cuda", torch.cuda.current_device() if device is None else device
        )
        super().__init__(lease_s=lease_s, name=name, auth=auth)

    def _stage(self, meta: KVHeader, payload: torch.Tensor) -> tuple[KVHeader, list, object]:
        t = payload.detach()
        # The staging copy and the checksum run on the KV stream, not the engine's (the send's
        # event has already been waited for: the payload is complete).
        with on_kv_stream(t.device if t.device.type == "cuda" else self.device):
            if t.device.type != "cuda" or not t.is_contiguous():
                t = t.to(self.device).contiguous()
            header = describe(t)  # wsum64 on the device; also waits for the staging copy
            (device, handle, size, offset, rc_handle, rc_offset, event, event_sync) = (
                t.untyped_storage()._share_cuda_()
            )
        loc = CudaIpcLocation(
            process=_PROCESS,
            device=device,
            handle=handle,
            storage_size_bytes=size,
            storage_offset_bytes=offset,
            ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset,
            event_handle=event,
            event_sync_required=event_sync,
            tensor_offset=int(t.storage_offset()),
        )
        _own_regions.add(loc, t)
        return with_header(meta, tensor=header, location=msgspec.msgpack.encode(loc)), [], (loc, t)

    def _unstage(self, hold: object) -> None:
        loc: CudaIpcLocation = hold[0]  # type: ignore[index]
        _own_regions.drop(loc)


class CudaIpcKVReceiver(ZmqKVReceiver):
    """Opens the sender's CUDA memory and hands out views of it (on the sender's device)."""

    kind = "cuda_ipc"

    def __init__(self, address: str, **kwargs: object) -> None:
        require_cuda()
        super().__init__(address, **kwargs)  # type: ignore[arg-type]

    def _open(self, meta: KVTransfer, frames: list) -> tuple[torch.Tensor, object]:
        if meta.transport == "tcp":  # inline fallback from a sender on another host
            return ZmqKVReceiver._open(self, meta, frames)
        if frames:
            raise TransportError(
                f"a cuda_ipc KV transfer carries no payload frame, got {len(frames)}"
            )
        dtype = validate_header(meta.tensor)
        try:
            loc = _location_decoder.decode(meta.location)
        except msgspec.MsgspecError as exc:
            raise TransportError(f"the CUDA IPC location is not valid: {exc}") from None
        if not 0 <= loc.device < torch.cuda.device_count():
            raise TransportError(f"CUDA device {loc.device} does not exist on this host")
        end = loc.storage_offset_bytes + loc.tensor_offset * dtype.itemsize + meta.tensor.nbytes
        if (
            loc.tensor_offset < 0
            or loc.storage_offset_bytes < 0
            or end - loc.storage_offset_bytes > loc.storage_size_bytes
        ):
            raise TransportError(
                f"CUDA IPC region {loc.storage_size_bytes} bytes cannot hold the payload"
            )
        if loc.process == _PROCESS:
            staged = _own_regions.get(loc)
            if staged is None:
                raise TransportError("CUDA IPC handle from this process names no staged payload")
            return staged.view(dtype).view(meta.tensor.shape), None
        torch.cuda._lazy_init()
        # On the KV stream: the wait on the sender's event goes there, before the checksum.
        with on_kv_stream(torch.device("cuda", loc.device)):
            storage = torch.UntypedStorage._new_shared_cuda(
                loc.device,
                loc.handle,
                loc.storage_size_bytes,
                loc.storage_offset_bytes,
                loc.ref_counter_handle,
                loc.ref_counter_offset,
                loc.event_handle,
                loc.event_sync_required,
            )
        t = torch.empty(0, dtype=dtype, device=torch.device("cuda", loc.device))
        shape = meta.tensor.shape
        stride = [1] * len(shape)  # contiguous, as the sender staged it
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        t.set_(storage, loc.tensor_offset, shape, stride)
        return t, None
