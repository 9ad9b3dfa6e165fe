"""Random paged-attention inputs with their dense truth, for the kernel tests and the benchmark.

`make_case` draws every sequence's keys and values densely, then lays them into a paged cache
through a shuffled block table, the way a block pool hands out blocks. Slots no sequence owns
hold NaN, so a kernel that reads outside a sequence's tokens produces NaN instead of passing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedCase:
    """One step's inputs in the interface's layout (kernels/interface.py) plus the dense K/V.

    Every token (prefix and new) is already in the cache, as after `store_kv`.
    """

    q: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] this step's new tokens
    value: torch.Tensor
    k_cache: torch.Tensor  # [N, S, Hkv, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, the new tokens' slots
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, M] int32, padded with -1
    dense_k: list[torch.Tensor]  # per sequence [ctx, Hkv, D]: prefix then new tokens
    dense_v: list[torch.Tensor]
    q_lens: list[int]
    prefix_lens: list[int]
    scale: float

    def to(self, dtype: torch.dtype) -> PagedCase:
        """The same case with every float tensor cast to `dtype` (indices unchanged)."""
        return PagedCase(
            q=self.q.to(dtype),
            key=self.key.to(dtype),
            value=self.value.to(dtype),
            k_cache=self.k_cache.to(dtype),
            v_cache=self.v_cache.to(dtype),
            slot_mapping=self.slot_mapping,
            cu_seqlens_q=self.cu_seqlens_q,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            dense_k=[k.to(dtype) for k in self.dense_k],
            dense_v=[v.to(dtype) for v in self.dense_v],
            q_lens=self.q_lens,
            prefix_lens=self.prefix_lens,
            scale=self.scale,
        )

    @property
    def decode_q(self) -> torch.Tensor:
        """q as decode takes it, [B, Hq, D]; only when every sequence has one new token."""
        if any(n != 1 for n in self.q_lens):
            raise ValueError(f"decode needs one query token per sequence, got q_lens {self.q_lens}")
        return self.q


def make_case(
    q_lens: list[int],
    prefix_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedCase:
    """A batch whose sequence b has prefix_lens[b] cached tokens and q_lens[b] new ones."""
    if len(q_lens) != len(prefix_lens):
        raise ValueError("q_lens and prefix_lens must have one entry per sequence")
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=0) + 1  # one column of padding beyond the longest
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(q_lens), width), -1, dtype=torch.int32)
    dense_k, dense_v, slots = [], [], []
    next_block = 0
    for b, ctx in enumerate(ctx_lens):
        ids = order[next_block : next_block + blocks_per_seq[b]]
        next_block += blocks_per_seq[b]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k, v = randn(ctx, num_kv_heads, head_dim), randn(ctx, num_kv_heads, head_dim)
        pos = torch.arange(ctx)
        seq_slots = (
            torch.tensor(ids, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        )
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = v
        dense_k.append(k)
        dense_v.append(v)
        slots.append(seq_slots[prefix_lens[b] :])

    new_k = [k[p:] for k, p in zip(dense_k, prefix_lens, strict=True)]
    new_v = [v[p:] for v, p in zip(dense_v, prefix_lens, strict=True)]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    dev = torch.device(device)
    return PagedCase(
        q=randn(cu[-1], num_kv_heads * group, head_dim).to(dev),
        key=torch.cat(new_k).to(dev),
        value=torch.cat(new_v).to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        slot_mapping=torch.cat(slots).to(dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        dense_k=[k.to(dev) for k in dense_k],
        dense_v=[v.to(dev) for v in dense_v],
        q_lens=list(q_lens),
        prefix_lens=list(prefix_lens),
        scale=head_dim**-0.5,
    )
