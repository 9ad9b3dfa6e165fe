"""The attention operations that prefill and decode share, behind one interface.

Tensor layout (every backend, every device):

    q, key, value    [T, H, D]      T packed tokens of one step, H heads (Hq or Hkv), D head size
    k_cache/v_cache  [N, S, Hkv, D] N blocks of S = block_size slots, one pair per layer
    slot_mapping     [T] int64      slot = block_id * S + offset; a negative slot is skipped
    cu_seqlens_q     [B+1] int32    query tokens of sequence b are q[cu[b]:cu[b+1]]
    seq_lens         [B] int32      tokens of sequence b in the cache *including* this step's
    block_tables     [B, M] int32   block ids of each sequence in order; padding is ignored

Index ranges of one sequence b with q_len = cu[b+1] - cu[b] and ctx = seq_lens[b]:

    positions  0 ............ ctx-q_len-1 | ctx-q_len ........ ctx-1
               cached prefix (in cache)   | new tokens (query rows, also written to cache)

Query row i (absolute position p = ctx-q_len+i) attends to keys 0 .. p inclusive, or with a
sliding window W > 0 (Gemma 3's local layers; transformers' `kv_idx > q_idx - sliding_window`)
to the last W of them, itself included:

    keys       0 ....... p-W | p-W+1 ........ p | p+1 ...
               not attended  | attended (W keys) | future

`window=0` is plain causal attention, and so is any window of at least p+1 keys. A decode query
is row ctx-1 and sees positions max(0, ctx-W) .. ctx-1. Blocks wholly before the first query
row's window are not read: their table entries may be stale or -1, as after an engine freed them
(`window_first_block` in kernels/reference.py).
`store_kv` runs before attention, so every key a query needs is in the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    """One implementation of the three attention operations. Backends hold no state."""

    name: str = "abstract"

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write each token's key and value into its slot of the paged cache, in place."""

    @abstractmethod
    def prefill_attention(
        self,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """Causal variable-length attention of packed queries over cached prefix + new tokens,
        each query over its last `window` keys where window > 0 (see the module docstring).

        `key`/`value` are this step's new tokens (already stored in the cache); a backend may
        read them directly instead of from the cache. Returns [T, Hq, D] in q's dtype.
        """

    @abstractmethod
    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """One query token per sequence (q is [B, Hq, D]) against its paged KV, its last `window`
        positions only where window > 0. Returns [B, Hq, D]."""

    def compiles_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether this backend's prefills of this dtype and head size are exactly the compiled
        CPU op pdserve_cpu.prefill_attention, one prompt at a time (its prefix gathered from the
        cache), so that the compiled decoder layers may run them (model/llama.py). None but the
        compiled CPU backend's are."""
        return False


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError, before any launch, for layouts no backend supports."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"expected q [T,H,D] and cache [N,S,Hkv,D], got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head size of q ({d}) and cache ({k_cache.shape[3]}) differ")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")


def check_window(window: int) -> int:
    """The window, or ValueError for one that is not an int in 0 .. 2**31 - 1 (positions are
    int32 in the kernels; 0 is no window, and one past any context is plain causal attention)."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < 2**31:
        raise ValueError(f"sliding window must be an int in 0..2**31-1 (0: none), got {window!r}")
    return window
