"""Per-step attention metadata: how the packed tokens of one step split into sequences.

The model runner packs a step as   [ decode tokens (1 per sequence) | prefill tokens (chunks) ]
                                     0 ........... num_decode_tokens-1 | num_decode_tokens ... T-1
so that every layer can call one decode kernel and one prefill kernel on two contiguous slices.
A deterministic engine (ModelRunner.deterministic) has no prefill part: each prompt row is a
decode of its own, over its sequence's block table with length position + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner; read by every attention layer; never mutated."""

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_seq_lens: torch.Tensor  # [Bd] int32
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    prefill_cu_seqlens_q: torch.Tensor  # [Bp+1] int32, offsets relative to num_decode_tokens
    prefill_seq_lens: torch.Tensor  # [Bp] int32
    prefill_block_tables: torch.Tensor  # [Bp, M] int32

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.prefill_cu_seqlens_q[-1]) if self.prefill_cu_seqlens_q.numel() else 0
