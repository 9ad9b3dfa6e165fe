"""Run our model outside the engine: every position's logits for one prompt, paged from block 0."""

from __future__ import annotations

import torch

from pdserve.config.engine import EngineConfig
from pdserve.engine.runner import ModelRunner
from pdserve.model.attention_metadata import AttentionMetadata


def full_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] for every position of one prompt, as a single prefill."""
    n = len(token_ids)
    bs = runner.block_size
    blocks = list(range(-(-n // bs)))
    table = torch.tensor([blocks], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        num_decode_tokens=0,
        decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32),
        prefill_block_tables=table,
    )
    hidden = runner.model(torch.tensor(token_ids), torch.arange(n), meta, runner.kv_cache)
    return runner.model.compute_logits(hidden)


def make_runner(loaded, num_blocks: int = 64, **kw) -> ModelRunner:
    cfg = EngineConfig(**{"dtype": "float32", **kw})  # the oracle runs in float32
    return ModelRunner(cfg, loaded.config, loaded.state_dict, max_model_len=2048, num_blocks=num_blocks)
