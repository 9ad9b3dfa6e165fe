"""A tiny random-weight Llama saved as a complete Hugging Face model directory.

Tests use it where the real model would be slow: it has SmolLM2's tokenizer (vocab 49152) and
chat template, so everything from the chat endpoint down runs on it, and transformers can load
it as an oracle. Typical use, once per session in a test module:

    @pytest.fixture(scope="session")
    def tiny_dir(tmp_path_factory):
        return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from pdserve.model.gguf_loader import open_gguf, read_metadata
from pdserve.text.model_files import default_gguf_path
from pdserve.text.tokenizer import Tokenizer

SMOLLM2_VOCAB_SIZE = 49152


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer, read from its GGUF once per process."""
    return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(default_gguf_path())))


def make_tiny_llama_dir(
    path: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rope_theta: float = 100000.0,
    rope_scaling: dict[str, Any] | None = None,
    rms_norm_eps: float = 1e-5,
) -> Path:
    """Write a random Llama (same weights for the same arguments) with SmolLM2's tokenizer to
    `path` and return `path`. `rope_scaling` is a transformers dict, e.g. {"rope_type": "llama3", ...}."""
    from transformers import LlamaConfig, LlamaForCausalLM  # a test-only dependency

    tokenizer = default_tokenizer()
    vocab_size = vocab_size or SMOLLM2_VOCAB_SIZE
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size must be at least the tokenizer's {tokenizer.vocab_size}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers edits it
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    # fork_rng: seeding here must not change the random stream of the test that calls us.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:  # not all ones, so a misplaced norm shows in the logits
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_default_tokenizer(path, max_position_embeddings)
    return path


def write_default_tokenizer(path: Path, max_position_embeddings: int) -> None:
    """SmolLM2's tokenizer.json and a tokenizer_config.json with its special tokens and chat
    template, as a Hugging Face directory holds them."""
    tokenizer = default_tokenizer()
    tokenizer.save(path / "tokenizer.json")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token,
        "add_bos_token": False,
        "model_max_length": max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
