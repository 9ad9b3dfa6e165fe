"""A request's KV blocks as one payload tensor: gather on the prefill side, scatter on decode.

    kv_cache  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)
    payload   [num_layers, 2, n,          block_size, num_kv_heads, head_dim]
              payload[:, :, i] == kv_cache[:, :, block_ids[i]]

A payload covers the first `num_computed_tokens` tokens of its request, so
n == ceil(num_computed_tokens / block_size); the tail of the last block is unspecified.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from kvtransfer.protocol import KVTransfer, ModelFingerprint

BlockIds = Sequence[int] | torch.Tensor


class KVPayloadError(ValueError):
    """Block ids or a payload that do not fit the KV cache they are used with."""


def _ids(kv_cache: torch.Tensor, block_ids: BlockIds, *, unique: bool) -> torch.Tensor:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise KVPayloadError(
            f"kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], got {list(kv_cache.shape)}"
        )
    ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1)
    num_blocks = kv_cache.shape[2]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise KVPayloadError(f"block ids must be in [0, {num_blocks}), got {ids.tolist()}")
    if unique and ids.unique().numel() != ids.numel():
        raise KVPayloadError(f"block ids must not repeat when written to, got {ids.tolist()}")
    return ids.to(kv_cache.device)


def gather_blocks(kv_cache: torch.Tensor, block_ids: BlockIds) -> torch.Tensor:
    """A new contiguous [L, 2, n, S, H, D] tensor holding `block_ids` in order (on kv_cache's device)."""
    return torch.index_select(kv_cache, 2, _ids(kv_cache, block_ids, unique=False)).contiguous()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: BlockIds, payload: torch.Tensor) -> None:
    """Copy `payload` block i into `kv_cache` block `block_ids[i]` (payload may live on another device)."""
    ids = _ids(kv_cache, block_ids, unique=True)
    expected = (*kv_cache.shape[:2], ids.numel(), *kv_cache.shape[3:])
    if tuple(payload.shape) != expected:
        raise KVPayloadError(
            f"payload is {list(payload.shape)}, expected {list(expected)} for {ids.numel()} blocks"
        )
    if payload.dtype != kv_cache.dtype:
        raise KVPayloadError(
            f"payload dtype {payload.dtype} differs from the cache's {kv_cache.dtype}"
        )
    kv_cache.index_copy_(2, ids, payload.to(kv_cache.device))


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
