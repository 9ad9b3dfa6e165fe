"""Typed configuration: what the model is, and how an engine runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Llama-3 style frequency scaling; None when the model has none.
    rope_scaling: tuple[tuple[str, float | int | str], ...] | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine runs: device, dtype, KV cache size, scheduling budgets and policy."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: computed from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's context length (capped at 8192)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "chunked"
    waiting_served_ratio: float = 0.0
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}") from None
