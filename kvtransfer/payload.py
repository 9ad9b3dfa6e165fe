"""Checks on a KV transfer: does its payload fit its own header, and the receiver's model?"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from pdserve.protocol.messages import KVPart, KVTransfer, ModelFingerprint, TensorHeader

# What a payload travels under: a whole transfer (or its tail), or a part streamed before it.
KVHeader = TypeVar("KVHeader", KVTransfer, KVPart)


def fingerprint_mismatch(a: ModelFingerprint, b: ModelFingerprint) -> str | None:
    """None when both describe the same KV layout; else the first differing field, for a NACK."""
    for field in a.__struct_fields__:
        va, vb = getattr(a, field), getattr(b, field)
        if va != vb:
            return f"model fingerprint differs in {field}: {va!r} != {vb!r}"
    return None


def fingerprint_matches(a: ModelFingerprint, b: ModelFingerprint) -> bool:
    return fingerprint_mismatch(a, b) is None


def payload_shape_mismatch(meta: KVTransfer) -> str | None:
    """None when `meta.tensor` is the payload its own fingerprint and token count imply."""
    fp, header = meta.fingerprint, meta.tensor
    if meta.num_computed_tokens < 1:
        return f"num_computed_tokens must be positive, got {meta.num_computed_tokens}"
    if fp.block_size < 1:
        return f"fingerprint block_size must be positive, got {fp.block_size}"
    n = -(-meta.num_computed_tokens // fp.block_size)
    if not 0 <= meta.first_block < n or meta.parts < 0 or (meta.parts == 0) != (meta.first_block == 0):
        return f"first_block {meta.first_block} after {meta.parts} parts does not fit {n} blocks"
    return _blocks_mismatch(fp, header, n - meta.first_block,
                            f"blocks {meta.first_block}..{n} of {meta.num_computed_tokens} tokens")


def part_shape_mismatch(part: KVPart) -> str | None:
    """None when a streamed part's payload is blocks [first_block, ...) of its stream, every layer."""
    fp, shape = part.fingerprint, part.tensor.shape
    if fp.block_size < 1:
        return f"fingerprint block_size must be positive, got {fp.block_size}"
    k = shape[2] if len(shape) == 6 else 0
    if k < 1 or part.first_block < 0 or part.first_block + k > part.total_blocks:
        return f"part of shape {list(shape)} at block {part.first_block} does not fit {part.total_blocks} blocks"
    return _blocks_mismatch(fp, part.tensor, k, f"part {part.seq}")


def blocks_shape(fp: ModelFingerprint, blocks: int) -> tuple[int, ...]:
    """The payload of `blocks` KV blocks of the fingerprint's model: [L, 2, blocks, S, Hkv, D]."""
    return (fp.num_layers, 2, blocks, fp.block_size, fp.num_kv_heads, fp.head_dim)


def _blocks_mismatch(fp: ModelFingerprint, header: TensorHeader, blocks: int, what: str) -> str | None:
    expected = blocks_shape(fp, blocks)
    if tuple(header.shape) != expected:
        return f"payload shape {list(header.shape)} does not match {list(expected)} ({what}, blocks of {fp.block_size})"
    if header.dtype != fp.dtype:
        return f"payload dtype {header.dtype} differs from the fingerprint's {fp.dtype}"
    return None


def with_header(meta: KVHeader, **changes: object) -> KVHeader:
    """`meta` with some fields replaced (transports fill in tensor, transport, location, lease)."""
    return msgspec.structs.replace(meta, **changes)
