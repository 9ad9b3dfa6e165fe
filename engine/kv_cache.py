"""The paged KV cache's layout, and moving whole blocks in and out of it.

    kv_cache  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)
    payload   [num_layers, 2, n,          block_size, num_kv_heads, head_dim]
              payload[:, :, i] == kv_cache[:, :, block_ids[i]]

A request's payload covers its first `num_computed_tokens` tokens, so
n == ceil(num_computed_tokens / block_size); the tail of the last block is unspecified. The
ModelRunner's `read_blocks` / `write_blocks` (what the KV connectors call) are these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.model.config import ModelConfig

BlockIds = Sequence[int] | torch.Tensor


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * itemsize


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


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(first block id, position in `ids`, length) of each stretch of consecutive ids, or None
    where there are more than _MAX_RUNS (or the ids are on a GPU: reading them would sync)."""
    if ids.device.type != "cpu" or ids.numel() == 0:
        return None
    breaks = (torch.nonzero(ids[1:] - ids[:-1] != 1).reshape(-1) + 1).tolist()
    if len(breaks) >= _MAX_RUNS:
        return None
    bounds = [0, *breaks, ids.numel()]
    return [(int(ids[a]), a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


# A request's blocks mostly come from the pool in runs; a copy per run moves them at copy speed
# (128 MiB of bf16 KV: 8-15 ms on 2 Zen 4 cores, against 22-24 ms for index_select / index_copy_).
_MAX_RUNS = 16


def gather_blocks(kv_cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor | None = None) -> torch.Tensor:
    """A new contiguous [L, 2, n, S, H, D] tensor holding `block_ids` in order (on kv_cache's
    device), or `out` filled with it."""
    ids = _ids(kv_cache, block_ids, unique=False)
    runs = _runs(ids)
    if runs is None:
        if out is not None:  # straight into the caller's buffer (a shm segment): no copy after
            return torch.index_select(kv_cache, 2, ids, out=out)
        return torch.index_select(kv_cache, 2, ids).contiguous()
    if out is None:
        out = torch.empty((*kv_cache.shape[:2], ids.numel(), *kv_cache.shape[3:]), dtype=kv_cache.dtype,
                          device=kv_cache.device)
    elif out.shape != (*kv_cache.shape[:2], ids.numel(), *kv_cache.shape[3:]) or out.dtype != kv_cache.dtype:
        raise KVPayloadError(f"out is {out.dtype}{list(out.shape)}, the blocks {kv_cache.dtype}[{ids.numel()}]")
    for block, at, n in runs:
        out[:, :, at : at + n].copy_(kv_cache[:, :, block : block + n])
    return out


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
    payload = payload.to(kv_cache.device)
    runs = _runs(ids)
    if runs is None:
        kv_cache.index_copy_(2, ids, payload)
        return
    for block, at, n in runs:
        kv_cache[:, :, block : block + n].copy_(payload[:, :, at : at + n])
