"""The model's shape (ModelConfig), read from GGUF metadata or config.json, and dtype names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a decoder of one of the supported families (model/families.py), read from GGUF
    metadata or a Hugging Face config.json. The defaults are a Llama's; each family sets what
    differs (Qwen2: q/k/v biases; Qwen3: per-head q/k norms; Gemma 3 all the rest)."""

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
    # Biases on the q, k and v projections (Qwen2).
    qkv_bias: bool = False
    # An RMSNorm over each head of q and of k before the rotary embedding (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Norm weights as stored are used as `offset + weight` (Gemma's 1 + w); folded in at load.
    norm_weight_offset: float = 0.0
    # Norms on the attention's and the MLP's outputs before their residual adds, and the MLP's
    # input norm its own tensor (Gemma 3's four norms a layer).
    sandwich_norms: bool = False
    # The MLP's activation on its gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
    hidden_act: str = "silu"
    # What the embeddings are multiplied by (Gemma: the square root of the hidden size).
    embed_scale: float = 1.0
    # The attention's softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    # Each layer's sliding window (0: global attention); empty: every layer global.
    layer_windows: tuple[int, ...] = ()
    # The rotary base of the windowed layers where it differs from rope_theta (Gemma 3's local
    # layers: plain RoPE at 10,000, while the global layers use rope_theta and rope_scaling).
    local_rope_theta: float | None = None
    # tanh soft-capping of the final logits (Gemma 2 style); None: none.
    final_logit_softcap: float | None = None

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this CPU (its first `flags` line), empty where unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16): there a
    bfloat16 matmul runs at about twice the float32 rate; elsewhere it is emulated and slower."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has 512-bit vectors (AVX-512F), which oneDNN's matmuls use and pdserve's
    8-wide panel kernel does not."""
    return "avx512f" in cpu_flags(cpuinfo)


def resolve_dtype(name: str, device: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """A config's dtype with "auto" made concrete for `device`: bfloat16 on CUDA and on CPUs that
    compute it natively, float32 on every other CPU. Other names pass through."""
    if name != "auto":
        return name
    if device.startswith("cuda") or cpu_has_native_bf16(cpuinfo):
        return "bfloat16"
    return "float32"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name (config/names.py lists them)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


# Which tensors of a model to read (its config, a Hugging Face tensor name): a pipeline stage's own.
Keep = Callable[[ModelConfig, str], bool]
