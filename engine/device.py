"""Where an engine runs and how its inputs get there: the device (`--device cuda:N`), a step's
host-to-device upload, the KV stream, and the KV cache's size on that device.

    select_device("cuda:1")          # checks 1 < device_count, makes it the current device
    uploader = StepUploader(device)  # one pinned buffer, one non-blocking copy a step
    kv_stream(device)                # the stream KV checksums and transfers run on (None on CPU)
    kv_cache_blocks(config, model_config, dtype, weights_bytes)

A step's host inputs are packed into one buffer, each part at a 16-byte boundary:

    | input_ids int64 | positions int64 | seq_lens int32 |pad| block_tables int32 [B, M] |pad| ...
    0                 16k               16k'             16k''

so that every part's view keeps the alignment a fresh allocation has (Triton specializes a
kernel on whether each pointer is 16-byte aligned: an unaligned view would compile, and run, a
variant of its own).
"""

from __future__ import annotations

import contextlib
import threading
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.kv_cache import kv_block_bytes
from pdserve.model.config import ModelConfig

ALIGN = 16  # bytes: every part of a packed step starts at a multiple of this


def select_device(device: str) -> torch.device:
    """The torch device of `--device` ("cpu", "cuda" or "cuda:N"); for CUDA, check that it exists
    and make it this process's current device, so that everything that launches on the current
    device (Triton, cuBLAS handles, streams, the caching allocator) lands on it. ValueError with
    what to pass instead."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N ({exc})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device {device!r}: pdserve runs on cpu or cuda[:N]")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {device}: this machine has no CUDA device visible to torch; use --device cpu")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# --- one upload a step ---------------------------------------------------------------------


class HostPart(NamedTuple):
    """One of a step's host inputs: an array.array or a CPU tensor of `dtype` (int64 or int32),
    uploaded with `shape` (None: an array's length, a tensor's own shape)."""

    values: array | torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None


class PartSpan(NamedTuple):
    """Where a part lies in the packed buffer, in bytes, and what it is there."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _host_bytes(part: HostPart) -> torch.Tensor:
    """The part's bytes as a flat uint8 CPU tensor over its own memory (no copy where it is contiguous)."""
    values, itemsize = part.values, torch.empty((), dtype=part.dtype).element_size()
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or values.dtype != part.dtype:
            raise ValueError(f"a step input must be a CPU tensor of {part.dtype}, got {values.dtype} on {values.device}")
        return values.contiguous().reshape(-1).view(torch.uint8)
    if values.itemsize != itemsize:
        raise ValueError(f"array of typecode {values.typecode!r} ({values.itemsize} bytes) for {part.dtype}")
    if not values:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(values, dtype=torch.uint8)


_ITEMSIZE = {torch.int64: 8, torch.int32: 4, torch.int16: 2, torch.uint8: 1}


def _as_tensor(part: HostPart) -> torch.Tensor:
    """A part as a tensor of its dtype and shape over its own memory (the CPU path: no copy)."""
    values = part.values
    if isinstance(values, torch.Tensor):
        if values.dtype != part.dtype:
            raise ValueError(f"a step input must be a tensor of {part.dtype}, got {values.dtype}")
        tensor = values
    elif values.itemsize != _ITEMSIZE.get(part.dtype, -1):
        raise ValueError(f"array of typecode {values.typecode!r} ({values.itemsize} bytes) for {part.dtype}")
    else:
        tensor = torch.frombuffer(values, dtype=part.dtype) if values else torch.empty(0, dtype=part.dtype)
    return tensor if part.shape is None else tensor.view(part.shape)


def layout(parts: Sequence[HostPart]) -> tuple[list[PartSpan], int]:
    """Each part's span in the packed buffer (in order, each at a multiple of ALIGN) and the total."""
    spans, offset = [], 0
    for part in parts:
        itemsize = torch.empty((), dtype=part.dtype).element_size()
        values = part.values
        n = len(values) if isinstance(values, array) else values.numel()
        shape = part.shape if part.shape is not None else (n,) if isinstance(values, array) else tuple(values.shape)
        count = 1
        for d in shape:
            count *= d
        if count != n:
            raise ValueError(f"a step input of {n} values cannot take the shape {shape}")
        spans.append(PartSpan(offset, n * itemsize, part.dtype, tuple(shape)))
        offset += _aligned(n * itemsize)
    return spans, offset


def pack(parts: Sequence[HostPart], spans: Sequence[PartSpan], buffer: torch.Tensor) -> None:
    """Copy every part's bytes to its span of `buffer` (uint8, at least the layout's total)."""
    for part, span in zip(parts, spans, strict=True):
        if span.nbytes:
            buffer[span.offset:span.offset + span.nbytes].copy_(_host_bytes(part))


def unpack(buffer: torch.Tensor, spans: Sequence[PartSpan]) -> list[torch.Tensor]:
    """Views of `buffer` (uint8, on any device), one per span, with its dtype and shape."""
    return [buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in spans]


class StepUploader:
    """A step's host inputs to the device in one copy. On CUDA they are packed into one pinned
    host buffer (kept, grown when a step needs more) and copied with one non-blocking copy on
    the current stream; the views it returns live in one device buffer. On the CPU the inputs
    are returned as they are: views of the arrays' own memory, nothing copied (`packed=True`
    runs the CUDA path's packing there too, for tests).

    The pinned buffer is written again only once the previous copy out of it has finished (an
    event recorded after each copy): a step packed while the last one's copy is in flight waits."""

    def __init__(self, device: torch.device, packed: bool | None = None) -> None:
        self.device = device
        self.packed = device.type == "cuda" if packed is None else packed
        self._pin = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    @property
    def host_buffer(self) -> torch.Tensor | None:
        """The packing buffer (None before the first packed upload)."""
        return self._host

    def upload(self, parts: Sequence[HostPart]) -> list[torch.Tensor]:
        """One tensor on the device per part, in order, of the part's dtype and shape."""
        if not self.packed:  # the CPU: each part as it is (a decode step's few microseconds matter)
            return [_as_tensor(p) for p in parts]
        spans, total = layout(parts)
        host = self._buffer(total)
        pack(parts, spans, host)
        device_buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        device_buffer.copy_(host[:total], non_blocking=True)
        if self._pin:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return unpack(device_buffer, spans)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the buffer is done
            self._copied = None
        if self._host is None or self._host.numel() < nbytes:
            size = max(nbytes, 2 * self._host.numel() if self._host is not None else 64 << 10)
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        return self._host


# --- the KV stream -------------------------------------------------------------------------

_kv_streams: dict[int, torch.cuda.Stream] = {}
_kv_streams_lock = threading.Lock()


def kv_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream KV checksums and transfers run on for `device` (one per device and process,
    made on first use), so that they never queue behind, or hold up, the engine's steps on the
    current stream; None on the CPU."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    with _kv_streams_lock:
        stream = _kv_streams.get(index)
        if stream is None:
            stream = _kv_streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))
        return stream


@contextlib.contextmanager
def on_kv_stream(device: torch.device) -> Iterator[None]:
    """Run the block's device work on `kv_stream(device)` (on the CPU: as it is). That stream is
    not ordered after the engine's: what the block reads must be complete first (an event)."""
    stream = kv_stream(device)
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


# --- the KV cache's size -------------------------------------------------------------------


def weights_bytes(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """What a state dict's tensors take on the device once cast to the serving `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() for t in state_dict.values()) * itemsize


def kv_cache_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, weights_bytes: int) -> int:
    """How many KV blocks the engine allocates. In order: --num-kv-blocks; --kv-cache-memory-gb
    where given (off CUDA it always is: 1 GB unless set, EngineConfig); else, on CUDA, --gpu-memory-utilization of the
    device's memory, less what is already in use on it (other processes, this one's context) and
    less the weights, which are not on the device yet (`weights_bytes`): so each of several
    workers sharing a GPU takes at most its fraction (`pdserve up` splits the fraction among the
    workers it puts on one GPU). ValueError when that leaves no room for one block."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model_config, config.block_size, dtype)
    if config.kv_cache_memory_gb is not None:
        return max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
    free, total = torch.cuda.mem_get_info(torch.device(config.device))
    budget = int(total * config.gpu_memory_utilization) - (total - free) - weights_bytes
    blocks = budget // per_block
    if blocks < 1:
        gib = 2**30
        raise ValueError(
            f"--gpu-memory-utilization {config.gpu_memory_utilization} of {config.device} ({total / gib:.1f} GiB) "
            f"leaves no room for a KV block of {per_block / 2**20:.1f} MiB: {(total - free) / gib:.1f} GiB is in use "
            f"already and the weights take {weights_bytes / gib:.1f} GiB. Raise it, or set --kv-cache-memory-gb "
            "or --num-kv-blocks")
    return blocks
