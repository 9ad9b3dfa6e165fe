"""Checks on a KV transfer: does its payload fit its own header, and the receiver's model?"""

from __future__ import annotations

import msgspec

from pdserve.protocol.messages import KVTransfer, ModelFingerprint


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
    expected = (fp.num_layers, 2, n, fp.block_size, fp.num_kv_heads, fp.head_dim)
    if tuple(header.shape) != expected:
        return (
            f"payload shape {list(header.shape)} does not match {list(expected)} "
            f"({meta.num_computed_tokens} tokens in blocks of {fp.block_size})"
        )
    if header.dtype != fp.dtype:
        return f"payload dtype {header.dtype} differs from the fingerprint's {fp.dtype}"
    return None


def with_header(meta: KVTransfer, **changes: object) -> KVTransfer:
    """`meta` with some fields replaced (transports fill in tensor, transport, location, lease)."""
    return msgspec.structs.replace(meta, **changes)
