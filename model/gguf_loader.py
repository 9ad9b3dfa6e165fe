"""Read a llama.cpp GGUF file: `ModelConfig` from its metadata, float32 weights under Hugging Face
names, and the metadata the tokenizer is built from.

Every tensor is dequantized once at load time (Q4_1, Q8_0, F16, ... -> float32), so the model code
sees plain dense weights whatever the file's quantization.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from pdserve.model.config import Keep, ModelConfig
from pdserve.model.families import SUPPORTED_GGUF_ARCHITECTURES
from pdserve.text.model_files import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = SUPPORTED_GGUF_ARCHITECTURES

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3's four norms a layer: llama.cpp's ffn_norm is the MLP's input norm there, and the
# attention's output norm has its own name.
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Only llama.cpp's `llama` architecture interleaves q and k rows for its rotary embedding; the
# others keep Hugging Face's rotate-half order.
_PERMUTED_ROTARY = ("llama",)
# llama.cpp's converter stores Gemma's norm weights as the 1 + w they are used as; the state
# dict holds Hugging Face's w (the decoder adds ModelConfig.norm_weight_offset back).
_NORM_SHIFT = {"gemma3": 1.0}


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """What one GGUF file holds, converted: config, float32 state dict (HF names), raw metadata."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a llama.cpp tensor; ModelLoadError for one the family has not."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match[2] in names:
        return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"
    if gguf_name == "rope_freqs.weight":
        raise ModelLoadError(
            "This GGUF scales RoPE frequencies with a rope_freqs tensor (Llama 3.1 style), which "
            "the GGUF loader does not support; load the model's Hugging Face directory instead."
        )
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation so Hugging Face's rotate_half RoPE applies.

    llama.cpp's converter reorders each head's rows from [first half | second half] to
    interleaved pairs (its RoPE rotates adjacent elements); this is the inverse, as in
    transformers' GGUF loader. weight: [num_heads * head_dim, hidden].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    permuted = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return permuted.transpose(1, 2).reshape(weight.shape).contiguous()


def open_gguf(path: str | Path) -> GGUFReader:
    """Open and parse a GGUF file's header; a file that is not one is a ModelLoadError."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err.strerror or err}") from err
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are {magic!r}).")
    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors...
        raise ModelLoadError(
            f"{path} is corrupt or truncated ({type(err).__name__}: {err}). Re-download or "
            "re-copy the file."
        ) from err


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key as plain Python values (str, int, float, bool, lists)."""
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except Exception as err:
        raise ModelLoadError(f"the GGUF metadata is corrupt: {err}") from err


def gguf_model_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """A ModelConfig from `{arch}.*` metadata keys."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in GGUF file; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"the GGUF file lacks the metadata key {arch}.{name}")
        return value

    _check_rope_scaling(meta, arch)
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise ModelLoadError("per-layer KV head counts in GGUF are not supported")
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rotary_dim = int(key("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelLoadError(
            f"partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported"
        )
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ModelLoadError(f"the GGUF file states no vocabulary size ({arch}.vocab_size)")
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_rope_scaling(meta, arch),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )
    if arch != "gemma3":
        return config
    layers = config.num_layers
    window = int(key("attention.sliding_window"))
    pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern", 6))  # llama.cpp's fixed 6
    cap = meta.get(f"{arch}.final_logit_softcapping")
    return replace(
        config, norm_weight_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        # llama.cpp scales queries by the key length; Gemma 3 27B's query_pre_attn_scalar (168)
        # is hidden / heads instead, which GGUF does not state: that model would need its own key.
        attention_scale=head_dim**-0.5,
        layer_windows=tuple(window if (i + 1) % pattern else 0 for i in range(layers)),
        local_rope_theta=10000.0,  # llama.cpp's fixed base for Gemma 3's local layers
        final_logit_softcap=float(cap) if cap else None,
    )


def _check_rope_scaling(meta: dict[str, Any], arch: str) -> None:
    # The decoder implements plain RoPE, linear scaling and Llama-3 scaling; GGUF states the
    # last as a rope_freqs tensor (refused in hf_tensor_name).
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ModelLoadError(
            f"GGUF rope scaling {kind!r} is not supported; load the model's Hugging Face "
            "directory if it uses Llama-3 scaling"
        )


def _rope_scaling(meta: dict[str, Any], arch: str) -> tuple[tuple[str, Any], ...] | None:
    if meta.get(f"{arch}.rope.scaling.type", "none") != "linear":
        return None
    return (("rope_type", "linear"), ("factor", float(meta[f"{arch}.rope.scaling.factor"])))


def load_gguf(path: str | Path, keep: Keep | None = None) -> GGUFModel:
    """Read config, weights (float32, HF names, Q/K un-permuted) and metadata from a GGUF file;
    only the tensors `keep(config, name)` says yes to are dequantized, where given."""
    reader = open_gguf(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = gguf_model_config(meta, names)
    state_dict: dict[str, torch.Tensor] = {}
    arch = config.architecture
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if keep is not None and not keep(config, name):
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        try:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as err:
            raise ModelLoadError(
                f"tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which cannot "
                f"be dequantized here: {err}"
            ) from err
        except Exception as err:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is corrupt or truncated ({err})"
            ) from err
        # Copy out of the memory map so the file can close and the tensor is writable.
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        if arch in _PERMUTED_ROTARY and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            weight = unpermute_rotary(weight, config.num_heads)
        elif arch in _PERMUTED_ROTARY and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            weight = unpermute_rotary(weight, config.num_kv_heads)
        elif arch in _NORM_SHIFT and name.endswith("norm.weight"):
            weight -= _NORM_SHIFT[arch]
        state_dict[name] = weight
    logger.info("loaded %d tensors from %s", len(state_dict), path)
    return GGUFModel(config=config, state_dict=state_dict, metadata=meta)
