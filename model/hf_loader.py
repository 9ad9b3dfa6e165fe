"""Read a Hugging Face Llama-family directory: `ModelConfig` from config.json and float32 weights
from its safetensors files (one file, or shards listed in model.safetensors.index.json)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pdserve.model.config import ModelConfig
from pdserve.text.model_files import ModelLoadError

logger = logging.getLogger(__name__)

# Mistral without a sliding window is a Llama under another name. Qwen2 is not: it has Q/K/V biases.
# ModelConfig.architecture uses the short family name, the same for a GGUF and a directory.
_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
SUPPORTED_ARCHITECTURES = tuple(_FAMILY)
# What engine/model.py implements; anything else would silently compute the wrong positions.
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_INDEX_FILE = "model.safetensors.index.json"


def read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(
            f"{path} has no config.json; it is not a Hugging Face model directory"
        ) from None
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {file}: {err}") from err
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file} does not hold a JSON object")
    return config


def hf_model_config(config: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a config.json dict; ModelLoadError for what the engine cannot run."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else config.get("model_type", "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ModelLoadError(f"{arch} with attention or MLP biases is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"activation {config['hidden_act']!r} is not supported (only silu)")
    window = config.get("sliding_window")
    max_pos = int(config.get("max_position_embeddings", 2048))
    if window is not None and window < max_pos:
        raise ModelLoadError(f"sliding-window attention (window {window}) is not supported")
    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        rope = _rope_parameters(config)
        return ModelConfig(
            architecture=_FAMILY[arch],
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rope_theta=float(rope.pop("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(rope),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"config.json is missing or has a bad value for {err}") from err


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def _rope_scaling(rope: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    kind = rope.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return None
    return tuple(rope.items())


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory: the shards its index names, or its *.safetensors."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"cannot read {index}: {err}") from err
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path} lacks the weight shards {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (PyTorch .bin files are not loaded: they are pickles)"
        )
    return files


def load_hf_state_dict(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors, float32, under their Hugging Face names."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            tensors = load_file(str(file), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            raise ModelLoadError(f"{file} is corrupt or truncated: {err}") from err
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints saved; recomputed
                continue
            state_dict[name] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # tied: the embedding is the output projection
    logger.info("loaded %d tensors from %s", len(state_dict), path)
    return state_dict


def load_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 state dict of a Hugging Face Llama-family directory."""
    path = Path(path)
    config = hf_model_config(read_config_json(path))
    return config, load_hf_state_dict(path, config)
