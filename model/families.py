"""The model families pdserve runs, and how each one's files map onto a ModelConfig.

One decoder (model/llama.py) runs them all; a family is what its config and tensors say about
that decoder's options:

    family   Hugging Face architectures       GGUF       differs from Llama by
    llama    LlamaForCausalLM                 llama      -
    mistral  MistralForCausalLM               llama      a sliding window on every layer (optional)
    qwen2    Qwen2ForCausalLM                 qwen2      biases on q, k and v
    qwen3    Qwen3ForCausalLM                 qwen3      an RMSNorm on each head of q and k
    gemma3   Gemma3ForCausalLM                gemma3     q/k norms, norms as 1 + w, four norms a
                                                         layer, GELU-tanh, scaled embeddings and
                                                         queries, local sliding-window layers with
                                                         their own rotary base

A new family is an entry here (its config.json reader and GGUF names) and, where its math is
new, an option of ModelConfig that the decoder and the compiled layers implement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pdserve.model.config import ModelConfig
from pdserve.text.model_files import ModelLoadError

# What model/llama.py's rotary embedding implements; anything else would compute wrong positions.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# Activations as config.json names them -> the decoder's names.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class Family:
    """One family: the Hugging Face architectures it answers to, its GGUF `general.architecture`,
    and how its config.json becomes a ModelConfig (on top of the fields every family shares)."""

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architecture: str
    from_hf: Callable[[dict[str, Any], ModelConfig], ModelConfig]
    # Hugging Face's default for tie_word_embeddings where config.json leaves it out.
    ties_by_default: bool = False


def _llama(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelLoadError(f"{base.architecture} with attention or MLP biases is not supported")
    return replace(base, layer_windows=_windows(cfg, base, every_layer=True))


def _qwen2(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    # Qwen2's q/k/v biases are not in its config: the architecture always has them.
    return replace(base, qkv_bias=True, layer_windows=_windows(cfg, base))


def _qwen3(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    return replace(base, qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)),
                   layer_windows=_windows(cfg, base))


def _gemma3(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("attention logit soft-capping (Gemma 2) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") if isinstance(rope, dict) else None
    local_theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    if local and local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"Gemma 3 local rope {local.get('rope_type')!r} is not supported")
    cap = cfg.get("final_logit_softcapping")
    return replace(
        base, qk_norm=True, norm_weight_offset=1.0, sandwich_norms=True,
        embed_scale=math.sqrt(base.hidden_size),
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        layer_windows=_windows(cfg, base, pattern=int(cfg.get("sliding_window_pattern", 6))),
        local_rope_theta=float(local_theta), final_logit_softcap=float(cap) if cap else None,
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), "llama", _llama),
        Family("mistral", ("MistralForCausalLM",), "llama", _llama),
        Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", _qwen2),
        Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", _qwen3),
        Family("gemma3", ("Gemma3ForCausalLM",), "gemma3", _gemma3, ties_by_default=True),
    )
}
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES.values() for a in f.hf_architectures)
SUPPORTED_GGUF_ARCHITECTURES = tuple(dict.fromkeys(f.gguf_architecture for f in FAMILIES.values()))


def family_of_hf(architecture: str) -> Family:
    for family in FAMILIES.values():
        if architecture in family.hf_architectures:
            return family
    raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _windows(cfg: dict[str, Any], base: ModelConfig, every_layer: bool = False, pattern: int = 0) -> tuple[int, ...]:
    """Each layer's window from config.json: `layer_types` where it is there (transformers >= 4.53
    writes it), else the family's older rule: every layer (Mistral), every layer but each
    `pattern`-th (Gemma 3's sliding_window_pattern), or Qwen2's use_sliding_window from
    max_window_layers on. Empty where no layer has a window smaller than the context."""
    window = cfg.get("sliding_window")
    layers = base.num_layers
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelLoadError(f"layer_types must list one type for each of the {layers} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ModelLoadError(f"layer types {sorted(unknown)} are not supported")
        sliding = [t == "sliding_attention" for t in types]
        if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
            sliding = [False] * layers
    elif not window:
        sliding = [False] * layers
    elif every_layer:
        sliding = [True] * layers
    elif pattern:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:  # Qwen2/Qwen3's switch
        first = int(cfg.get("max_window_layers", layers))
        sliding = [bool(cfg.get("use_sliding_window")) and i >= first for i in range(layers)]
    if not any(sliding):
        return ()
    if not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"sliding layers need a positive sliding_window, got {window!r}")
    if window >= base.max_position_embeddings and all(sliding):
        return ()  # a window as long as the context is no window
    return tuple(window if s else 0 for s in sliding)


def hf_model_config(cfg: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a config.json dict; ModelLoadError for what the engine cannot run."""
    archs = cfg.get("architectures") or []
    family = family_of_hf(archs[0] if archs else cfg.get("model_type", "<none>"))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"activation {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        rope = global_rope_parameters(cfg)
        base = ModelConfig(
            architecture=family.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rope_theta=float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.ties_by_default)),
            rope_scaling=rope_scaling(rope),
            hidden_act=_ACTIVATIONS[act],
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"config.json is missing or has a bad value for {err}") from err
    return family.from_hf(cfg, base)


def global_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters of the global layers: transformers >= 5 writes `rope_parameters`
    (theta inside; keyed by layer type for Gemma 3), older files `rope_scaling`."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError("rope_parameters")
    if "full_attention" in rope:
        rope = rope["full_attention"] or {}
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def rope_scaling(rope: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    kind = rope.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return None
    return tuple(rope.items())
