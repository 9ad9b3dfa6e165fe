// The decoder layers of a decode-only step in one call. The same math in the same order as
// model/llama.py's DecoderLayer (each residual add with the norm after it, RMSNorm.add_norm_), its
// oracle:
//
//   h = rms_norm(x); q, k, v = split(h Wqkv^T); rotary(q, k); store k, v at their slots
//   x += attention(q, paged cache) Wo^T
//   h = rms_norm(x); x += (silu(gate) * up)(h Wgate_up^T) Wdown^T
//
// A decode step at small batch spends as long on the Python layer's ~45 eager calls (dispatch,
// views, checks, temporaries) as on the maths itself; here they are direct calls to the compiled
// ops (ops.h), and x, the residual stream, is updated in place. The projections take either
// packing (ops.h `project`): our panels, or oneDNN's layout where bfloat16 runs on AMX/AVX512-BF16.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace pdserve_cpu {

namespace {

// One layer from h, its input already normalised: x += attention, then x += MLP, in place. The
// residual adds go with the norms after them (add_rms_norm_: one pass, the same numbers as
// `x += y` then rms_norm): the post-attention norm, then `after` (the next layer's input norm or
// the final one), whose output it returns.
at::Tensor layer_from_normed(at::Tensor& x, const at::Tensor& h, const at::Tensor& post_norm, const at::Tensor& qkv,
                             const at::Tensor& o, const at::Tensor& gate_up, const at::Tensor& down,
                             const at::Tensor& after, const at::Tensor& positions, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t intermediate_size, double eps, double scale) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor qkv_out = project(h, qkv, q_size + 2 * kv_size);
  const at::Tensor q = qkv_out.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  const at::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
  const at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  rotary_(q, k, positions, cos, sin);
  store_kv_(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor attn = decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale);
  const at::Tensor h2 = add_rms_norm_(x, project(attn.view({tokens, q_size}), o, hidden), post_norm, eps);
  const at::Tensor mlp = project(project_silu_mul(h2, gate_up, intermediate_size), down, hidden);
  return add_rms_norm_(x, mlp, after, eps);
}

}  // namespace

// Every layer of a decode-only step, and the final norm, in one call: weights six per layer in its
// order (input norm, post norm, qkv, o, gate_up, down), kv_cache the engine's [L, 2, blocks, S,
// Hkv, D]. Returns the final hidden states, normalised; x, the residual stream, is updated in place.
// One call from Python instead of one per layer: at batch 1 the 30 calls of SmolLM2 and their
// argument handling took about 1 ms of a 16 ms step.
at::Tensor decoder_layers_(at::Tensor x, at::TensorList weights, const at::Tensor& final_norm,
                           const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t intermediate_size, double eps, double scale) {
  constexpr int64_t kPerLayer = 6;
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2, "kv_cache must be [L, 2, blocks, S, Hkv, D], got ",
              kv_cache.sizes());
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * layers, "expected ", kPerLayer,
              " weights for each of ", layers, " layers, got ", weights.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == x.size(0),
              "decoder_layers_ runs decode-only steps: one token per sequence, seq_lens [T]");
  at::Tensor h = rms_norm(x, layers > 0 ? weights[0] : final_norm, eps);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kPerLayer * l;
    const at::Tensor& after = l + 1 < layers ? w[kPerLayer] : final_norm;  // the next layer's input norm
    const at::Tensor layer_cache = kv_cache.select(0, l);
    h = layer_from_normed(x, h, w[1], w[2], w[3], w[4], w[5], after, positions, cos, sin, layer_cache.select(0, 0),
                          layer_cache.select(0, 1), slot_mapping, seq_lens, block_tables, num_heads, num_kv_heads,
                          head_dim, intermediate_size, eps, scale);
  }
  return h;
}

}  // namespace pdserve_cpu

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "decoder_layers_(Tensor(a!) x, Tensor[] weights, Tensor final_norm, Tensor positions, Tensor cos, "
      "Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, Tensor seq_lens, Tensor block_tables, "
      "int num_heads, int num_kv_heads, int head_dim, int intermediate_size, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decoder_layers_", &pdserve_cpu::decoder_layers_); }

// oneDNN-packed weights are MkldnnCPU tensors, which make the dispatcher look for that key.
TORCH_LIBRARY_IMPL(pdserve_cpu, MkldnnCPU, m) { m.impl("decoder_layers_", &pdserve_cpu::decoder_layers_); }
