"""Read a Hugging Face model directory of a supported family (model/families.py): `ModelConfig`
from config.json and float32 weights from its safetensors files (one file, or shards listed in
model.safetensors.index.json)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pdserve.model.config import Keep, ModelConfig
from pdserve.model.families import SUPPORTED_ARCHITECTURES, hf_model_config
from pdserve.text.model_files import ModelLoadError

__all__ = ["SUPPORTED_ARCHITECTURES", "hf_model_config", "load_hf", "read_config_json"]

logger = logging.getLogger(__name__)

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


def load_hf_state_dict(path: Path, config: ModelConfig, keep: Keep | None = None) -> dict[str, torch.Tensor]:
    """All tensors (or those `keep(config, name)` says yes to: only they are read), float32,
    under their Hugging Face names."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    if name.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints saved; recomputed
                        continue
                    if keep is None or keep(config, name):
                        state_dict[name] = f.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError, ValueError) as err:
            raise ModelLoadError(f"{file} is corrupt or truncated: {err}") from err
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # tied: the embedding is the output projection
    logger.info("loaded %d tensors from %s", len(state_dict), path)
    return state_dict


def load_hf(path: str | Path, keep: Keep | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 state dict of a Hugging Face model directory."""
    path = Path(path)
    config = hf_model_config(read_config_json(path))
    return config, load_hf_state_dict(path, config, keep)
