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
from torch import nn

from pdserve.kernels import cpu_linear
from pdserve.kernels.interface import AttentionBackend
from pdserve.kernels.linear import Linear, act_mul
from pdserve.model.attention_metadata import AttentionMetadata
from pdserve.model.config import ModelConfig


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
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, cache_index: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        # This layer's index in its stage's KV cache (its own index where one stage holds them all).
        self.cache_index = layer if cache_index is None else cache_index
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
        k_cache, v_cache = kv_cache[self.cache_index, 0], kv_cache[self.cache_index, 1]
        self.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd, scale = meta.num_decode_tokens, self.scale
        if nd == t:
            out = self.backend.decode_attention(q, k_cache, v_cache, meta.decode_seq_lens, meta.decode_block_tables,
                                                scale, window=self.window)
        elif nd == 0:
            out = self.backend.prefill_attention(
                q, k, v, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, meta.prefill_block_tables,
                scale, window=self.window,
            )
        else:
            out = torch.empty_like(q)
            out[:nd] = self.backend.decode_attention(q[:nd], k_cache, v_cache, meta.decode_seq_lens,
                                                     meta.decode_block_tables, scale, window=self.window)
            out[nd:] = self.backend.prefill_attention(
                q[nd:], k[nd:], v[nd:], k_cache, v_cache,
                meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, meta.prefill_block_tables, scale, window=self.window,
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
        gate_up = self.gate_up_proj
        if self.fused is not None:  # the activation inside the gate/up kernel where its method has one
            return self.down_proj(gate_up.method.apply_act_mul(gate_up, x, self.intermediate_size, self.act, self.fused))
        return self.down_proj(act_mul(gate_up(x), self.act))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, cache_index: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, backend, cache_index)
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

    def compiled_args(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple, tuple[int, bool]]:
        """This layer's (weights, large-step weights, dims, (window, local rope)) for
        ops.decoder_layers_, reading the packed weights (panels, AMX tiles or oneDNN's layout,
        whichever use_linear_method made); the large-step weights are empty unless every projection
        keeps a second packing. The weights are a Llama's six (input norm, post-attention norm,
        qkv, o, gate/up, down), and for any other family five more, an empty tensor for each it
        lacks: the qkv bias, the q and k norms, the pre- and post-feedforward norms
        (cpu_decoder_layer.cpp)."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [w for w in (p.compiled_weight for p in projections) if w is not None]
        if len(packed) != len(projections):
            raise ValueError("use_compiled_layers needs every projection packed first (use_linear_method)")
        large = [w for w in (p.large_step_weight for p in projections) if w is not None]
        if large and len(large) != len(projections):
            raise ValueError("use_compiled_layers needs a second packing for every projection or for none")
        weights = (self.input_layernorm.weight, self.post_attention_layernorm.weight, *packed)
        sandwich = (self.pre_feedforward_layernorm, self.post_feedforward_layernorm) if self.sandwich else (None, None)
        extras = (attn.qkv_proj.bias, attn.q_norm, attn.k_norm, *sandwich)
        if any(e is not None for e in extras):
            none = self.input_layernorm.weight.new_empty(0)
            weights += tuple(none if e is None else e if isinstance(e, torch.Tensor) else e.weight for e in extras)
        dims = (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size, self.input_layernorm.eps, attn.scale)
        return weights, tuple(large), dims, (attn.window, self.local_rope)


@dataclass(frozen=True, slots=True)
class StageLayers:
    """The part of the model one pipeline stage holds (engine/pipeline.py): layers [start, end),
    the embedding where it is the first stage, the final norm where it is the last. The LM head
    goes with the sampler, and the sampler with the requests' state (penalties, seeds, grammar
    matchers): on the first stage, which schedules."""

    start: int
    end: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> StageLayers:
        return cls(0, num_layers, num_layers)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def owns(self, name: str, tied_embeddings: bool) -> bool:
        """Whether a Hugging Face-named tensor belongs to this stage."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layers
        if name.startswith("model.embed_tokens."):
            return self.first  # and the LM head's, where the embeddings are tied
        if name.startswith("model.norm."):
            return self.last
        if name.startswith("lm_head."):
            return self.first
        return True


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int,
                 stage: StageLayers | None = None) -> None:
        super().__init__()
        stage = stage or StageLayers.whole(config.num_layers)
        # A stage keeps the layers' indices (and so their weights' names): the others are empty.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if stage.first else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, i - stage.start) if i in stage.layers else nn.Identity()
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.last else None
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
    projections, six a layer; eleven for families other than a Llama, DecoderLayer.compiled_args),
    the large-step packings (four a layer, or none), the layers' dimensions, whether steps with
    prompts run through it too (else decode-only ones), whether the MLP may prefetch the next
    layer's KV (kv_prefetch), and `options`, the arguments after kv_prefetch: empty for a Llama,
    else (windows, local_rope, activation) per cpu_decoder_layer.cpp (one window and one 0/1 local
    rope flag per layer; 0 SiLU, 1 GELU-tanh); the call appends the local rotary tables where the
    model has them."""

    ops: object
    weights: list[torch.Tensor]
    large_weights: list[torch.Tensor]
    dims: tuple
    prefills: bool
    kv_prefetch: bool = True
    options: tuple = ()


class LlamaForCausalLM(nn.Module):
    """Weights load from Hugging Face names (either loader); q/k/v and gate/up are fused here."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int,
                 stage: StageLayers | None = None) -> None:
        super().__init__()
        self.config = config
        self.stage = stage or StageLayers.whole(config.num_layers)
        self.model = LlamaModel(config, backend, max_positions, self.stage)
        # Tied embeddings get a transposed copy here: the embedding lookup wants rows, the LM
        # head's matmul wants the transposed layout (see Linear).
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False) if self.stage.first else None
        # What a stage before the last passes decoder_layers_ for the final norm: its output is
        # dropped, the residual stream (updated in place) goes to the next stage.
        self.register_buffer("no_norm", None if self.stage.last else torch.ones(config.hidden_size), persistent=False)
        self._compiled: CompiledLayers | None = None  # once use_compiled_layers() is called
        self._embed_scales: dict[torch.dtype, float] = {}

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """config.embed_scale rounded to `dtype` (exact in it: multiplying by it rounds as a tensor
        of that dtype would), worked out once per dtype."""
        scale = self._embed_scales.get(dtype)
        if scale is None:
            scale = self._embed_scales[dtype] = float(torch.tensor(self.config.embed_scale, dtype=dtype))
        return scale

    @property
    def compiled_layers(self) -> CompiledLayers | None:
        """What runs the layers in one compiled call (None: the PyTorch layers run every step)."""
        return self._compiled

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, H]; writes this step's K/V (of this
        stage's layers). A stage after the first takes the residual stream `hidden` [T, H] instead
        of input_ids (and updates it in place); a stage before the last returns the residual
        stream, not normed, for the next stage."""
        if hidden is not None:
            x = hidden
        else:
            assert self.model.embed_tokens is not None, "a stage after the first takes the hidden states"
            x = self.model.embed_tokens(input_ids)
            if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the model's dtype, as transformers does
                x.mul_(self._embed_scale(x.dtype))
        norm = self.model.norm
        c = self._compiled
        if c is not None and (c.prefills or meta.num_decode_tokens == x.shape[0]):
            local = self.model.rotary_local  # only a family's options go before its tables
            tables = () if local is None or not c.options else (local.cos, local.sin)
            h = c.ops.decoder_layers_(  # type: ignore[attr-defined]
                x, c.weights, c.large_weights, cpu_linear.TILE_MAX_ROWS,
                norm.weight if norm is not None else self.get_buffer("no_norm"), positions,
                self.model.rotary.cos, self.model.rotary.sin, kv_cache, meta.slot_mapping, meta.num_decode_tokens,
                meta.decode_seq_lens, meta.decode_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                meta.prefill_block_tables, *c.dims, c.kv_prefetch, *c.options, *tables,
            )
            return h if norm is not None else x
        # Each residual add goes with the norm after it (RMSNorm.add_norm_); x, the embeddings'
        # output, is this step's own, updated in place.
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        after: list[RMSNorm | None] = [*(layer.input_layernorm for layer in layers[1:]), norm]
        h = layers[0].input_layernorm(x) if layers else x
        local = self.model.rotary_local
        for layer, after_norm in zip(layers, after, strict=True):
            rotary = local if layer.local_rope and local is not None else self.model.rotary
            out = layer(x, h, positions, rotary, meta, kv_cache)
            h = after_norm.add_norm_(x, out) if after_norm is not None else x.add_(out)
        if not layers and norm is not None:
            h = norm(x)
        return h if norm is not None else x

    def use_fused_ops(self, ops) -> None:
        """Run RMSNorm, SiLU-mul and rotary through these compiled ops (kernels/csrc/
        cpu_elementwise.cpp: float32 and bfloat16 CPU tensors); the PyTorch code stays the oracle."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, MLP, RotaryEmbedding)):
                m.fused = ops

    @property
    def compiles_layers(self) -> bool:
        """Whether ops.decoder_layers_ implements this model's layers: every family's (q/k/v
        biases, q/k norms, sandwich norms, sliding windows and their rotary tables, SiLU or
        GELU-tanh; embed_scale and the logits' softcap are applied outside the layers)."""
        return self.config.hidden_act in ("silu", "gelu_tanh")

    def use_compiled_layers(self, ops, kv_prefetch: bool = True) -> None:
        """Run every layer of a step in one compiled call, ops.decoder_layers_ (after use_fused_ops
        and use_linear_method: it reads the packed weights): every decode-only step, and steps with
        prompts where the attention backend's prefills are the compiled op for this dtype and head
        size (AttentionBackend.compiles_prefill). The PyTorch layers stay the path of every other
        step and the oracle. `ops` None turns it off (the tests' lockstep oracle). `kv_prefetch`
        False keeps the MLP from prefetching the next layer's KV (the engine's --kv-prefetch)."""
        self._compiled = None
        if ops is None or not self.compiles_layers:
            return
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        args = [layer.compiled_args() for layer in layers]
        if len({dims for _, _, dims, _ in args}) != 1:
            raise ValueError("use_compiled_layers runs layers of one shape")
        if len({bool(large) for _, large, _, _ in args}) > 1:
            raise ValueError("use_compiled_layers needs a second packing in every layer or in none")
        if len({len(weights) for weights, _, _, _ in args}) > 1:
            raise ValueError("use_compiled_layers runs layers with the same options")
        dims = args[0][2]
        windows = [window for _, _, _, (window, _) in args]
        local_rope = [int(local) for _, _, _, (_, local) in args]
        if any(local_rope) and self.model.rotary_local is None:
            raise ValueError("a layer reads the local rotary tables, which the model lacks")
        activation = {"silu": 0, "gelu_tanh": 1}[self.config.hidden_act]  # decoder_layers_'s codes
        # A Llama passes none of them: its call is the one it always was.
        family = len(args[0][0]) > 6 or any(windows) or activation != 0
        options = (windows, local_rope, activation) if family else ()
        backend = layers[0].self_attn.backend if layers else None
        prefills = backend is not None and backend.compiles_prefill(layers[0].input_layernorm.weight.dtype, dims[2])
        self._compiled = CompiledLayers(
            ops, [w for weights, _, _, _ in args for w in weights], [w for _, large, _, _ in args for w in large],
            dims, prefills, kv_prefetch, options,
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> logits [N, V] in the model's dtype; only the rows that sample are passed here.
        Not widened to float32: a plain greedy batch takes the argmax of these as they are (the
        same index), and the sampler widens its own copy where it edits or draws from them."""
        assert self.lm_head is not None, "the LM head is the first stage's"
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, state_dict: dict[str, torch.Tensor], consume: bool = False) -> None:
        """Copy a Hugging Face-named state dict in (cast to the parameters' dtype); raise ValueError
        naming missing/extra tensors. With `consume`, `state_dict` is emptied and each tensor let go
        once copied, so the source never sits whole beside the model."""
        source = state_dict
        state_dict = fuse_state_dict(state_dict)
        if consume:
            source.clear()
        if self.config.norm_weight_offset:  # Gemma's norms multiply by 1 + w
            offset = self.config.norm_weight_offset
            state_dict = {k: v + offset if k.endswith("norm.weight") else v for k, v in state_dict.items()}
        if self.config.tie_word_embeddings and "model.embed_tokens.weight" in state_dict:
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        stage = self.stage
        if not (stage.first and stage.last):  # a pipeline stage: only its own tensors
            for name in [n for n in state_dict if not stage.owns(n, self.config.tie_word_embeddings)]:
                del state_dict[name]
        own = self.state_dict()
        expected = set(own)
        missing = expected - state_dict.keys()
        extra = state_dict.keys() - own.keys() - {"lm_head.weight"}
        if missing or extra:
            raise ValueError(f"weights do not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
        for name, tensor in state_dict.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(own[name].shape)}, file has {tuple(tensor.shape)}")
        with torch.no_grad():
            for name in list(state_dict):
                own[name].copy_(state_dict.pop(name) if consume else state_dict[name])
