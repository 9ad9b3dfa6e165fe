"""Tiny random-weight models of every supported family, as Hugging Face directories and as GGUF
files, built from a `transformers` config (the oracle) with no download.

    path = make_tiny_dir(tmp / "qwen3", "qwen3")        # config.json, safetensors, tokenizer
    gguf = write_gguf(path, tmp / "qwen3.gguf")          # the same weights as llama.cpp lays them out

Every model has SmolLM2's tokenizer (vocab 49,152) and chat template unless `tokenizer_config`
says otherwise, so the whole service runs on it. Norm weights and biases are random (not ones or
zeros) so that a misplaced norm or a lost bias shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.model.gguf_loader import open_gguf, read_metadata
from pdserve.text.model_files import default_gguf_path
from tests.helpers.tiny_llama import SMOLLM2_VOCAB_SIZE, default_tokenizer, write_default_tokenizer

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
CHAT_TOKEN_ROOM = 64  # vocabulary rows past SmolLM2's for a chat format's added tokens

# Per family: the transformers classes, and the shape options that exercise what differs.
_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "rope_theta": 100000.0},
    "qwen2": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "rope_theta": 1000000.0},
    # A head size that is not hidden / heads, as Qwen3's models have (q is 128 wide on a 64 model).
    "qwen3": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "intermediate_size": 128, "rope_theta": 1000000.0},
    # Six layers: five local (window 5, smaller than a block of 16), then a global one, as Gemma 3.
    "gemma3": {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 32, "intermediate_size": 128, "sliding_window": 5, "query_pre_attn_scalar": 32},
}


def _hf_classes(family: str):
    import transformers  # a test-only dependency

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]


def make_tiny_dir(path: Path, family: str, *, seed: int = 0, chat: str | None = None, **shape: Any) -> Path:
    """Write a random model of `family` (same weights for the same arguments) to `path` as a Hugging
    Face directory and return `path`. `shape` overrides the family's tiny shape (any config field,
    e.g. sliding_window=37 or tie_word_embeddings=True). `chat` names a chat format of
    tests/helpers/chat_templates ("qwen2_5", "qwen3", "gemma3"): its tokens are added to the
    vocabulary and its template, BOS/EOS and stop tokens go into the directory, as the family's
    real tokenizer files would have them; else SmolLM2's."""
    config_cls, model_cls = _hf_classes(family)
    tokenizer = default_tokenizer()
    # Room for a chat format's added tokens past SmolLM2's, as real vocabularies are padded.
    vocab = SMOLLM2_VOCAB_SIZE + (CHAT_TOKEN_ROOM if chat else 0)
    fields = {**_SHAPES[family], "vocab_size": vocab, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id, **shape}
    config = config_cls(**fields)
    with torch.random.fork_rng(devices=[]):  # seeding must not change the calling test's stream
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:  # Gemma's norms are used as 1 + w: small w; the others near 1
                    param.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(param))
                elif name.endswith(".bias"):
                    param.copy_(0.5 * torch.randn_like(param))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if chat is not None:
        _write_family_tokenizer(path, chat)
        return path
    write_default_tokenizer(path, fields["max_position_embeddings"])
    return path


def _write_family_tokenizer(path: Path, chat: str) -> None:
    """SmolLM2's vocabulary with the `chat` format's tokens added, and its tokenizer_config.json
    and generation_config.json's stop tokens (as the family's real files have them)."""
    from tokenizers import Tokenizer

    from tests.helpers import chat_templates

    backend = chat_templates.add_family_tokens(Tokenizer.from_str(default_tokenizer().backend.to_str()), chat)
    if backend.get_vocab_size() > SMOLLM2_VOCAB_SIZE + CHAT_TOKEN_ROOM:
        raise ValueError("the family's tokens do not fit the model's vocabulary")
    backend.save(str(path / "tokenizer.json"))
    config = chat_templates.tokenizer_config(chat, backend.token_to_id)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}
    generation |= chat_templates.generation_config(chat, backend.token_to_id)
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def hf_model(path: Path) -> torch.nn.Module:
    """The transformers model of a tiny directory, float32, eval mode: the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# Hugging Face tensor name (after "model.layers.N.") -> llama.cpp's, per family where it differs.
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_GGUF_GEMMA3_LAYER = _GGUF_LAYER | {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for its `llama` architecture (adjacent rotary pairs)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """The directory's model as a float32 GGUF file laid out as llama.cpp's converter writes it
    (tensor names, metadata keys, llama's q/k row permutation, Gemma's norms stored as 1 + w),
    with the default model's tokenizer metadata. Returns `out`."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    family = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
              "Gemma3ForCausalLM": "gemma3"}[cfg["architectures"][0]]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors |= load_file(str(file))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), family)
    a = family
    writer.add_uint32(f"{a}.context_length", cfg["max_position_embeddings"])
    writer.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    writer.add_uint32(f"{a}.block_count", cfg["num_hidden_layers"])
    writer.add_uint32(f"{a}.feed_forward_length", cfg["intermediate_size"])
    writer.add_uint32(f"{a}.attention.head_count", heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", head_dim)
    writer.add_uint32(f"{a}.attention.value_length", head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", cfg.get("rope_theta", 10000.0))
    writer.add_float32(f"{a}.rope.freq_base", theta)
    writer.add_uint32(f"{a}.vocab_size", cfg["vocab_size"])
    if family == "gemma3":
        writer.add_uint32(f"{a}.attention.sliding_window", cfg["sliding_window"])
    meta = read_metadata(open_gguf(default_gguf_path()))
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml."):
            _add_tokenizer_key(writer, key, value)
    layer_names = _GGUF_GEMMA3_LAYER if family == "gemma3" else _GGUF_LAYER
    for name, t in tensors.items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{layer_names[module]}.{kind}"
            if family == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _permute_rotary(t, heads if module == "self_attn.q_proj" else kv_heads)
        if family == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0
        writer.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer_key(writer, key: str, value: Any) -> None:
    import gguf

    if isinstance(value, list):
        kind = gguf.GGUFValueType.STRING if value and isinstance(value[0], str) else gguf.GGUFValueType.INT32
        writer.add_array(key, value) if kind == gguf.GGUFValueType.STRING else writer.add_key_value(
            key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_string(key, value)
