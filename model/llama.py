"""The decoder of every supported family (model/families.py) over packed variable-length steps
(selective batching): a Llama, with the options ModelConfig names for the others (q/k/v biases,
per-head q/k norms, four norms a layer, GELU-tanh, scaled embeddings, sliding-window layers with
their own rotary base, soft-capped logits).

Every non-attention op (embeddings, RMSNorm, projections, gated MLP) runs on all T tokens of a
step concatenated; attention runs per sequence over its own paged KV through `kernels`.
Shapes: T packed tokens, H hidden size, Hq/Hkv heads, D head size, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_linear
from pdserve.kernels.huge_pages import copies_on_huge_pages, huge_page_share
from pdserve.kernels.interface import AttentionBackend
from pdserve.model.attention_metadata import AttentionMetadata
from pdserve.model.config import ModelConfig


class Linear(nn.Module):
    """y = x W^T, with W [out, in] stored transposed ([in, out] contiguous).

    On the CPU, MKL runs the small-batch matmuls of decode steps faster against this layout than
    F.linear against [out, in]; big prefill batches and CUDA do not care. Two packed CPU copies
    go further (the plain weight stays, for the other paths):
    - `pack_panels(ops)`: panels of 24 output columns for the compiled kernel
      (kernels/csrc/cpu_linear.cpp), which streams each weight once per block of rows: on AVX2
      CPUs faster than oneDNN from 1 to 256 rows.
    - `pack_onednn()`: oneDNN's blocked layout, read directly by its matmul (faster than MKL at
      decode sizes); the choice for bfloat16 where the CPU has AVX512-BF16 but no AMX, and for
      float32 on AVX-512 CPUs.
    - `pack_tiles(ops)`: AMX tiles for the compiled tile kernel (kernels/csrc/cpu_linear_tiles.cpp),
      bfloat16 only, which streams the weights of decode steps faster than oneDNN. With
      `onednn=True` the oneDNN copy is kept too, for steps of more than cpu_linear.TILE_MAX_ROWS
      rows (large prefills), where oneDNN is faster.
    `PDSERVE_CPU_LINEAR=<choice> python -m pdserve.bench.engine_overhead` measures each layout
    (docs/cpu_kernels.md, "Projections").
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gate_up_of: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features).t())
        # Added after the matmul, whichever layout runs it (Qwen2's q/k/v).
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.out_features = out_features
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.tiles: torch.Tensor | None = None
        self.ops: object | None = None
        # A gate/up projection's intermediate size (0 for any other): its tiles then pair the two
        # halves' groups, as the fused SiLU-mul kernel reads them (cpu_linear.pack_gate_up_tiles).
        self.gate_up_of = gate_up_of

    def pack_onednn(self, batch_hint: int = 64) -> None:
        """Keep a oneDNN-packed copy of the weight for the CPU matmul (the weight itself stays)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), batch_hint)

    def pack_panels(self, ops: object) -> None:
        """Keep a panel-packed copy for torch.ops.pdserve_cpu.linear (the weight itself stays)."""
        self.panels = cpu_linear.pack_weight(self.weight.detach())
        self.ops = ops

    def pack_tiles(self, ops: object, onednn: bool = False) -> None:
        """Keep a tile copy for torch.ops.pdserve_cpu.tile_linear (AMX or VDPBF16PS), and with
        `onednn` a oneDNN-packed one for steps of more than TILE_MAX_ROWS rows (the weight itself
        stays)."""
        if self.tiles_paired:
            self.tiles = cpu_linear.pack_gate_up_tiles(self.weight.detach(), self.gate_up_of)
        else:
            self.tiles = cpu_linear.pack_tiles(self.weight.detach())
        self.ops = ops
        if onednn:
            self.pack_onednn()

    @property
    def tiles_paired(self) -> bool:
        """Whether the tiles (once packed) pair the gate's and the up's groups."""
        return self.gate_up_of > 0 and cpu_linear.tiles_fuse_silu_mul(self.gate_up_of)

    @property
    def large_step_weight(self) -> torch.Tensor | None:
        """The packed copy that steps of more than cpu_linear.TILE_MAX_ROWS rows read instead of
        compiled_weight, where there is one (oneDNN's beside AMX tiles), else None."""
        return self.packed if self.tiles is not None and self.packed is not None else None

    @property
    def compiled_weight(self) -> torch.Tensor | None:
        """The packed copy the compiled decoder layers read (ops.h `project` tells the layouts by
        rank); AMX tiles where both they and oneDNN's copy exist."""
        for w in (self.panels, self.tiles, self.packed):
            if w is not None:
                return w
        return None

    def tiles_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The AMX tiles when forward(x) runs on them, else None."""
        rows = x.numel() // x.shape[-1]
        if self.packed is None or rows <= cpu_linear.TILE_MAX_ROWS:
            return self.tiles
        return None

    def forward(self, x: torch.Tensor, tile_order: bool = False) -> torch.Tensor:
        """x W^T (+ b); with `tile_order`, through paired gate/up tiles the columns stay in the
        tiles' pairs (as the compiled layers read them) instead of being put back in order."""
        y = self._matmul(x, tile_order)
        return y if self.bias is None else y.add_(self.bias)

    def _matmul(self, x: torch.Tensor, tile_order: bool) -> torch.Tensor:
        tiles = self.tiles_for(x)
        if tiles is not None:
            y = cpu_linear.tile_linear(self.ops, x, tiles, self.out_features)
            return cpu_linear.unpair_gate_up(y, self.gate_up_of) if self.tiles_paired and not tile_order else y
        if self.panels is not None:
            return cpu_linear.linear(self.ops, x, self.panels, self.out_features)
        if self.packed is not None:
            if self.ops is not None:  # the compiled op, which splits mid-sized steps' rows between threads
                return self.ops.onednn_linear(x, self.packed)  # type: ignore[attr-defined]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return x @ self.weight.t()


# The share of the packed weights' mapping on huge pages from which the tile kernels count them as
# there (the mapping's tail past its last whole huge page never is).
HUGE_PAGE_SHARE = 0.9

def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether this torch can run packed oneDNN linears in `dtype` on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = None  # torch.ops.pdserve_cpu once use_fused_ops() is called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 whatever the activation dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x += y in place (the residual add before this norm), then this norm of x: with the
        compiled ops one pass (`add_rms_norm_`), with the same numbers as the two ops."""
        if self.fused is not None:
            return self.fused.add_rms_norm_(x, y, self.weight, self.eps)
        return self(x.add_(y))


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies, with the model's frequency scaling (Llama 3's, or linear); with
    `local`, those of the windowed layers where they have their own base (plain RoPE there)."""
    d = config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta is not None else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = {} if local and config.local_rope_theta is not None else dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """Hugging Face's rotate-half convention; cos/sin tables precomputed for every position."""

    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(config, local))  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.fused = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.fused is not None:  # in place, in one pass over q and k
            self.fused.rotary_(q, k, positions, self.get_buffer("cos"), self.get_buffer("sin"))
            return q, k
        cos = self.get_buffer("cos")[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.get_buffer("sin")[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = layer
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.softmax_scale
        self.window = config.window(layer)
        h = config.hidden_size
        # One matmul for q, k and v: one pass over the activations instead of three.
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, h, bias=False)
        # Qwen3's and Gemma 3's RMSNorm over each head of q and k, before the rotary embedding.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata, kv_cache):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self.q_norm is not None and self.k_norm is not None:  # on [T * heads, D] rows (a copy)
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = kv_cache[self.layer, 0], kv_cache[self.layer, 1]
        self.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd, scale = meta.num_decode_tokens, self.scale
        # Only windowed layers pass a window: a backend without one still runs every other model.
        win = {"window": self.window} if self.window else {}
        if nd == t:
            out = self.backend.decode_attention(q, k_cache, v_cache, meta.decode_seq_lens, meta.decode_block_tables,
                                                scale, **win)
        elif nd == 0:
            out = self.backend.prefill_attention(
                q, k, v, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, meta.prefill_block_tables,
                scale, **win,
            )
        else:
            out = torch.empty_like(q)
            out[:nd] = self.backend.decode_attention(q[:nd], k_cache, v_cache, meta.decode_seq_lens,
                                                     meta.decode_block_tables, scale, **win)
            out[nd:] = self.backend.prefill_attention(
                q[nd:], k[nd:], v[nd:], k_cache, v_cache,
                meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, meta.prefill_block_tables, scale, **win,
            )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False,
                                   gate_up_of=config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.intermediate_size = config.intermediate_size
        self.act = config.hidden_act
        self.fused = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "gelu_tanh":  # GeGLU (Gemma): no fused kernel, eager
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.fused is not None:
            # SiLU-mul inside the gate/up projection's own kernel where forward(x) runs one that can.
            gate_up, inter = self.gate_up_proj, self.intermediate_size
            tiles = gate_up.tiles_for(x)
            if tiles is not None and cpu_linear.tiles_fuse_silu_mul(inter):
                return self.down_proj(cpu_linear.tile_linear_silu_mul(gate_up.ops, x, tiles, inter))
            if tiles is None and gate_up.panels is not None and cpu_linear.fuses_silu_mul(inter):
                return self.down_proj(cpu_linear.linear_silu_mul(gate_up.ops, x, gate_up.panels, inter))
            return self.down_proj(self.fused.silu_mul(gate_up(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Gemma 3: post_attention_layernorm normalises the attention's output, these two the MLP's
        # input and output.
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Whether this layer's rotary embedding is the model's local one (Gemma 3's windowed layers).
        self.local_rope = config.window(layer) > 0 and config.local_rope_theta is not None

    def forward(self, x, h, positions, rotary, meta, kv_cache):
        """x, the residual stream, gains the attention in place; h is x through input_layernorm.
        Returns the MLP's output: the caller adds it to x with the norm that follows (the next
        layer's input norm or the final one), as the attention's is added here."""
        a = self.self_attn(h, positions, rotary, meta, kv_cache)
        if self.sandwich:
            h = self.pre_feedforward_layernorm.add_norm_(x, self.post_attention_layernorm(a))
            return self.post_feedforward_layernorm(self.mlp(h))
        h = self.post_attention_layernorm.add_norm_(x, a)
        return self.mlp(h)

    def compiled_args(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple]:
        """This layer's (weights, large-step weights, dims) for ops.decoder_layers_, reading the
        packed weights (panels, AMX tiles or oneDNN's layout, whichever pack_cpu_linears made);
        the large-step weights are empty unless every projection keeps a second packing."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [w for w in (p.compiled_weight for p in projections) if w is not None]
        if len(packed) != len(projections):
            raise ValueError("use_compiled_layers needs every projection packed first (pack_cpu_linears)")
        large = [w for w in (p.large_step_weight for p in projections) if w is not None]
        if large and len(large) != len(projections):
            raise ValueError("use_compiled_layers needs a second packing for every projection or for none")
        weights = (self.input_layernorm.weight, self.post_attention_layernorm.weight, *packed)
        dims = (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size, self.input_layernorm.eps, attn.scale)
        return weights, tuple(large), dims


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        # The windowed layers' own rotary tables where they have their own base (Gemma 3).
        local = config.local_rope_theta is not None and any(config.layer_windows)
        self.rotary_local = RotaryEmbedding(config, max_positions, local=True) if local else None


# Our fused parameters and the Hugging Face tensors stacked (in this order) to make them.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def fuse_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours: q/k/v and gate/up stacked along the output dimension."""
    out = dict(state_dict)
    layer_prefixes = {k.rsplit("self_attn.", 1)[0] for k in state_dict if ".self_attn.q_proj." in k}
    for prefix in layer_prefixes:
        for fused, parts in FUSED.items():
            names = [prefix + p for p in parts]
            if all(n in out for n in names):
                out[prefix + fused] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


@dataclass(frozen=True, slots=True)
class CompiledLayers:
    """What ops.decoder_layers_ takes besides a step: every layer's weights (norms and packed
    projections, six a layer), the large-step packings (four a layer, or none), the layers'
    dimensions, whether steps with prompts run through it too (else decode-only ones), and whether
    the MLP may prefetch the next layer's KV (kv_prefetch)."""

    ops: object
    weights: list[torch.Tensor]
    large_weights: list[torch.Tensor]
    dims: tuple
    prefills: bool
    kv_prefetch: bool = True


class LlamaForCausalLM(nn.Module):
    """Weights load from Hugging Face names (either loader); q/k/v and gate/up are fused here."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, max_positions)
        # Tied embeddings get a transposed copy here: the embedding lookup wants rows, the LM
        # head's matmul wants the transposed layout (see Linear).
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self._compiled: CompiledLayers | None = None  # once use_compiled_layers() is called

    @property
    def compiled_layers(self) -> CompiledLayers | None:
        """What runs the layers in one compiled call (None: the PyTorch layers run every step)."""
        return self._compiled

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, H]; writes this step's K/V."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: rounded to the model's dtype first, as transformers does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        c = self._compiled
        if c is not None and (c.prefills or meta.num_decode_tokens == x.shape[0]):
            return c.ops.decoder_layers_(  # type: ignore[attr-defined]
                x, c.weights, c.large_weights, cpu_linear.TILE_MAX_ROWS, self.model.norm.weight, positions,
                self.model.rotary.cos, self.model.rotary.sin, kv_cache, meta.slot_mapping, meta.num_decode_tokens,
                meta.decode_seq_lens, meta.decode_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                meta.prefill_block_tables, *c.dims, c.kv_prefetch,
            )
        # Each residual add goes with the norm after it (RMSNorm.add_norm_); x, the embeddings'
        # output, is this step's own, updated in place.
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        after = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        h = (layers[0].input_layernorm if layers else self.model.norm)(x)
        local = self.model.rotary_local
        for layer, norm in zip(layers, after, strict=True):
            rotary = local if layer.local_rope and local is not None else self.model.rotary
            h = norm.add_norm_(x, layer(x, h, positions, rotary, meta, kv_cache))
        return h

    def use_fused_ops(self, ops) -> None:
        """Run RMSNorm, SiLU-mul and rotary through these compiled ops (kernels/csrc/
        cpu_elementwise.cpp: float32 and bfloat16 CPU tensors); the PyTorch code stays the oracle."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, MLP, RotaryEmbedding)):
                m.fused = ops

    @property
    def compiles_layers(self) -> bool:
        """Whether ops.decoder_layers_ implements this model's layers: a Llama's math (no biases,
        q/k norms, sandwich norms, windows, scaled embeddings or GELU); other families run their
        layers through the PyTorch modules (with the compiled ops each one calls)."""
        c = self.config
        return not (c.qkv_bias or c.qk_norm or c.sandwich_norms or c.hidden_act != "silu" or any(c.layer_windows))

    def use_compiled_layers(self, ops, kv_prefetch: bool = True) -> None:
        """Run every layer of a step in one compiled call, ops.decoder_layers_ (after use_fused_ops
        and pack_cpu_linears: it reads the packed weights): every decode-only step, and steps with
        prompts where the attention backend's prefills are the compiled op for this dtype and head
        size (AttentionBackend.compiles_prefill). The PyTorch layers stay the path of every other
        step and the oracle. `ops` None turns it off (the tests' lockstep oracle). `kv_prefetch`
        False keeps the MLP from prefetching the next layer's KV (the engine's --kv-prefetch)."""
        self._compiled = None
        if ops is None or not self.compiles_layers:
            return
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        args = [layer.compiled_args() for layer in layers]
        if len({dims for _, _, dims in args}) != 1:
            raise ValueError("use_compiled_layers runs layers of one shape")
        if len({bool(large) for _, large, _ in args}) > 1:
            raise ValueError("use_compiled_layers needs a second packing in every layer or in none")
        dims = args[0][2]
        backend = layers[0].self_attn.backend if layers else None
        prefills = backend is not None and backend.compiles_prefill(self.lm_head.weight.dtype, dims[2])
        self._compiled = CompiledLayers(
            ops, [w for weights, _, _ in args for w in weights], [w for _, large, _ in args for w in large], dims,
            prefills, kv_prefetch,
        )

    def pack_cpu_linears(self, layout: str, ops: object | None = None) -> int:
        """Pack every projection and the LM head (CPU only) in `layout`: "onednn", or for the
        compiled kernels (`ops`, torch.ops.pdserve_cpu) "panels", "tiles" (AMX, bfloat16) or
        "tiles+onednn" (tiles for small steps, oneDNN for large). Returns how many."""
        if layout not in ("onednn", "panels", "tiles", "tiles+onednn"):
            raise ValueError(f"layout {layout!r}: expected onednn, panels, tiles or tiles+onednn")
        if layout != "onednn" and ops is None:
            raise ValueError(f"layout {layout!r} needs the compiled ops")
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            if layout == "onednn":
                m.pack_onednn()
            elif layout == "panels":
                m.pack_panels(ops)
            else:
                m.pack_tiles(ops, onednn=layout == "tiles+onednn")
        # The compiled kernels' copies, streamed whole at every decode step: on huge pages.
        name = "tiles" if layout.startswith("tiles") else layout  # the attribute the layout fills
        if name != "onednn":  # oneDNN's packed copies are opaque tensors: they stay where they are
            copies = copies_on_huge_pages([getattr(m, name) for m in linears])
            for m, copy in zip(linears, copies, strict=True):
                setattr(m, name, copy)
            if name == "tiles":  # one mapping: on huge pages, the smallest steps leave their stream to the hardware
                on_huge = bool(copies) and huge_page_share(copies[0]) >= HUGE_PAGE_SHARE
                ops.set_tile_weights_on_huge_pages(on_huge)  # type: ignore[union-attr]
        return len(linears)

    def tiles_fit(self) -> bool:
        """Whether every Linear can be packed into AMX tiles (bfloat16, K a multiple of 32)."""
        return all(cpu_linear.tiles_fit(m.weight) for m in self.modules() if isinstance(m, Linear))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> logits [N, V] in the model's dtype; only the rows that sample are passed here.
        Not widened to float32: a plain greedy batch takes the argmax of these as they are (the
        same index), and the sampler widens its own copy where it edits or draws from them."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict in; raise ValueError naming missing/extra tensors."""
        state_dict = fuse_state_dict(state_dict)
        if self.config.norm_weight_offset:  # Gemma's norms multiply by 1 + w
            offset = self.config.norm_weight_offset
            state_dict = {k: v + offset if k.endswith("norm.weight") else v for k, v in state_dict.items()}
        if self.config.tie_word_embeddings:
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        own = self.state_dict()
        expected = set(own)
        missing = expected - state_dict.keys()
        extra = state_dict.keys() - own.keys() - {"lm_head.weight"}
        if missing or extra:
            raise ValueError(f"weights do not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if own[name].shape != tensor.shape:
                    raise ValueError(f"{name}: expected shape {tuple(own[name].shape)}, file has {tuple(tensor.shape)}")
                own[name].copy_(tensor)
