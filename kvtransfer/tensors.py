"""Tensors as described raw bytes: headers, checksums and zero-copy views over received buffers.

A `TensorHeader.checksum` names its algorithm: ``"<algorithm>:<hex digest>"``. Three algorithms:

``xxh3``   (CPU tensors, the default there): xxHash's XXH3-64 over the raw bytes. On one core of
    the 2-core build machine (bench/kv_transfer_bench.py) 20-25 GB/s for 64 MiB, ~40 GB/s for
    16 MiB (in cache): the speed of a memory copy, so both ends of a transfer can afford it.
    python-xxhash releases the GIL while it hashes: another thread keeps its full loop rate
    while one hashes 64 MiB, so one call over the whole payload stalls no engine thread.
``crc32``  zlib's CRC-32 over the raw bytes (~4 GB/s): verified when a header names it, used by
    `describe` only when asked for.
``wsum64`` (CUDA tensors, the default there): computed on the tensor's own device so the payload
    never crosses PCIe just to be checked. The bytes are read as int32 words (int16 / uint8
    when the size is not a multiple of 4) laid out as rows of `_ROW` words, zero-padded; the
    digest is (total sum, sum of row sums weighted by row index + 1, sum of column sums weighted
    by column index + 1), each modulo 2**64. Integer sums wrap identically in any order, so
    the CPU and every GPU agree bit for bit; the weights catch moved or swapped words that a
    plain sum would miss. Slow on the CPU (~0.7 GB/s), fast on a GPU (bandwidth bound).

Each detects corruption and bugs (a flipped byte, a wrong block, a reused region); none is
cryptographic, so none stops an adversary. Authenticity comes from the header's MAC and the
channel (docs/security.md, "KV payload integrity").

`verify` recomputes whichever algorithm the header names, on whatever device the tensor is on.
"""

from __future__ import annotations

import math
import zlib

import torch
import xxhash

from pdserve.protocol.messages import TensorHeader

# What may travel: numeric types with a fixed item size. Names are torch's without "torch.".
ALLOWED_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
CHECKSUM_ALGORITHMS = ("xxh3", "crc32", "wsum64")
MAX_NDIM = 8
_ROW = 4096  # words per row of the wsum64 layout


class TensorFrameError(ValueError):
    """A header that does not describe the buffer it came with (or an unsupported dtype)."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ALLOWED_DTYPES:
        raise TensorFrameError(f"dtype {name} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    return name


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy; works for bfloat16 too)."""
    if not t.is_contiguous():
        raise TensorFrameError("tensor must be contiguous to be sent as raw bytes")
    return t.reshape(-1).view(torch.uint8)


def default_algorithm(t: torch.Tensor) -> str:
    return "xxh3" if t.device.type == "cpu" else "wsum64"


def checksum(t: torch.Tensor, algorithm: str | None = None) -> str:
    """``"<algorithm>:<hex>"`` over the tensor's raw bytes (see the module docstring)."""
    algorithm = algorithm or default_algorithm(t)
    raw = as_bytes(t)
    if algorithm in ("xxh3", "crc32") and raw.device.type != "cpu":
        raw = raw.cpu()
    if algorithm == "xxh3":
        return "xxh3:" + xxhash.xxh3_64_hexdigest(raw.numpy().data)
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(raw.numpy().data) & 0xFFFFFFFF:08x}"
    if algorithm == "wsum64":
        return "wsum64:" + "".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in _wsum64(raw))
    raise TensorFrameError(
        f"unknown checksum algorithm {algorithm!r}; known: {CHECKSUM_ALGORITHMS}"
    )


def _wsum64(raw: torch.Tensor) -> list[int]:
    n = raw.numel()
    word = torch.int32 if n % 4 == 0 else torch.int16 if n % 2 == 0 else torch.uint8
    words = raw.view(word)
    full = words.numel() // _ROW * _ROW
    rows = [words[:full].view(-1, _ROW)]
    if full < words.numel():  # the last partial row, zero-padded (zeros add nothing)
        tail = torch.zeros(1, _ROW, dtype=word, device=raw.device)
        tail[0, : words.numel() - full] = words[full:]
        rows.append(tail)
    grid = torch.cat(rows) if len(rows) > 1 else rows[0]
    row_sums = grid.sum(dim=1, dtype=torch.int64)
    col_sums = grid.sum(dim=0, dtype=torch.int64)
    row_w = torch.arange(1, grid.shape[0] + 1, dtype=torch.int64, device=raw.device)
    col_w = torch.arange(1, _ROW + 1, dtype=torch.int64, device=raw.device)
    sums = torch.stack([row_sums.sum(), (row_sums * row_w).sum(), (col_sums * col_w).sum()])
    return sums.cpu().tolist()  # one device sync


def describe(
    t: torch.Tensor, *, algorithm: str | None = None, with_checksum: bool = True
) -> TensorHeader:
    """The header of a contiguous tensor: dtype name, shape, byte count and checksum.

    `with_checksum=False` gives a cheap header with ``checksum=""`` (a placeholder for a
    transport that fills in the real one off the engine thread).
    """
    return TensorHeader(
        dtype=dtype_name(t.dtype),
        shape=tuple(int(s) for s in t.shape),
        nbytes=t.numel() * t.element_size(),
        checksum=checksum(t, algorithm) if with_checksum else "",
    )


def validate_header(header: TensorHeader) -> torch.dtype:
    """Check a received header's own consistency; return its torch dtype."""
    dtype = ALLOWED_DTYPES.get(header.dtype)
    if dtype is None:
        raise TensorFrameError(f"dtype {header.dtype!r} is not allowed")
    if len(header.shape) > MAX_NDIM or any(d < 0 for d in header.shape):
        raise TensorFrameError(f"shape {header.shape} is not a valid tensor shape")
    expected = math.prod(header.shape) * dtype.itemsize
    if header.nbytes != expected:
        raise TensorFrameError(
            f"header says {header.nbytes} bytes but shape {header.shape} of {header.dtype} is {expected}"
        )
    return dtype


def tensor_from_buffer(
    header: TensorHeader, buffer: memoryview | bytes | bytearray
) -> torch.Tensor:
    """A zero-copy CPU tensor over `buffer` (a zmq Frame's buffer, a shm slice...).

    The tensor borrows the buffer: it is valid while the buffer's owner keeps it alive and
    unchanged. Raises TensorFrameError when the header and the buffer disagree.
    """
    dtype = validate_header(header)
    view = memoryview(buffer)
    if view.nbytes != header.nbytes:
        raise TensorFrameError(f"frame has {view.nbytes} bytes, header says {header.nbytes}")
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    # uint8 first, then reinterpret: torch.frombuffer cannot take every dtype (bfloat16) directly.
    return torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(dtype).view(header.shape)


def verify(header: TensorHeader, t: torch.Tensor) -> bool:
    """True when `t` has the header's dtype, shape and size and its checksum matches."""
    return verify_reason(header, t) is None


def verify_reason(header: TensorHeader, t: torch.Tensor) -> str | None:
    """None when `t` matches `header`; otherwise what differs, for a log line or a NACK."""
    try:
        name = dtype_name(t.dtype)
    except TensorFrameError as exc:
        return str(exc)
    if name != header.dtype or tuple(t.shape) != tuple(header.shape):
        return f"tensor is {name}{list(t.shape)}, header says {header.dtype}{list(header.shape)}"
    algorithm, sep, _ = header.checksum.partition(":")
    if not sep or algorithm not in CHECKSUM_ALGORITHMS:
        return f"checksum {header.checksum[:40]!r} names no known algorithm {CHECKSUM_ALGORITHMS}"
    actual = checksum(t, algorithm)
    if actual != header.checksum:
        return f"checksum mismatch: got {actual}, header says {header.checksum}"
    return None
