// Every op of torch.ops.pdserve_cpu: its schema and its kernels, in one place. The other files
// only define the functions (ops.h); each instruction-set variant of the library
// (kernels/variants.py) compiles this same list.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pdserve_cpu, m) {
  // Attention (cpu_attention.cpp, cpu_prefill.cpp, cpu_prefill_tiles.cpp).
  // window: each query's last `window` keys only (a sliding window), 0 for all of them.
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, Tensor block_tables, "
        "float scale, int window=0) -> Tensor");
  m.def("store_kv_(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("prefill_attention(Tensor q, Tensor key, Tensor value, int offset, float scale, int window=0) -> Tensor");

  // Elementwise (cpu_elementwise.cpp).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor y, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");

  // Linears on panels (cpu_linear.cpp). onednn_linear's weight is a oneDNN (MkldnnCPU) tensor
  // and x a CPU one: one kernel for every dispatch key.
  m.def("linear(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("linear_silu_mul(Tensor x, Tensor panels, int intermediate) -> Tensor");
  m.def("onednn_linear(Tensor x, Tensor packed) -> Tensor", &pdserve_cpu::onednn_linear);

  // Linears on tiles (cpu_linear_tiles.cpp), and what runs them in this build and process.
  m.def("tile_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("tile_linear_silu_mul(Tensor x, Tensor packed, int intermediate) -> Tensor");
  m.def("tile_kernel() -> str", &pdserve_cpu::tile_kernel);
  m.def("tile_weights_on_huge_pages() -> bool", &pdserve_cpu::tile_weights_on_huge_pages);
  m.def("set_tile_weights_on_huge_pages(bool on) -> ()", &pdserve_cpu::set_tile_weights_on_huge_pages);

  // Every decoder layer of a step (cpu_decoder_layer.cpp). kv_prefetch defaults to on, as the
  // engine's --kv-prefetch does. The arguments after it (sliding windows, which layers read the
  // local rotary tables, 0 SiLU or 1 GELU-tanh, those tables) and five more weights a layer (qkv
  // bias, q/k norms, sandwich norms) are the other families' options: a Llama leaves them out.
  m.def("decoder_layers_(Tensor(a!) x, Tensor[] weights, Tensor[] large_weights, int large_above, "
        "Tensor final_norm, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
        "int num_decode, Tensor decode_seq_lens, Tensor decode_block_tables, Tensor prefill_cu_seqlens_q, "
        "Tensor prefill_seq_lens, Tensor prefill_block_tables, int num_heads, int num_kv_heads, int head_dim, "
        "int intermediate_size, float eps, float scale, bool kv_prefetch=True, int[] windows=[], "
        "int[] local_rope=[], int activation=0, Tensor? local_cos=None, Tensor? local_sin=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("decode_attention", &pdserve_cpu::decode_attention);
  m.impl("store_kv_", &pdserve_cpu::store_kv_);
  m.impl("prefill_attention", &pdserve_cpu::prefill_attention);
  m.impl("rms_norm", &pdserve_cpu::rms_norm);
  m.impl("silu_mul", &pdserve_cpu::silu_mul);
  // The C++ function also takes paired tiles' column order (ops.h); the op has the plain one.
  m.impl("gelu_tanh_mul", [](const at::Tensor& gate_up) { return pdserve_cpu::gelu_tanh_mul(gate_up); });
  m.impl("argmax_rows", &pdserve_cpu::argmax_rows);
  m.impl("add_rms_norm_", &pdserve_cpu::add_rms_norm_);
  m.impl("rotary_", &pdserve_cpu::rotary_);
  m.impl("linear", &pdserve_cpu::linear);
  m.impl("linear_silu_mul", &pdserve_cpu::linear_silu_mul);
  // The tiles' C++ functions take a background prefetch too (ops.h); the op has none.
  m.impl("tile_linear", [](const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
    return pdserve_cpu::tile_linear(x, packed, out_features);
  });
  m.impl("tile_linear_silu_mul", [](const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
    return pdserve_cpu::tile_linear_silu_mul(x, packed, intermediate);
  });
  m.impl("decoder_layers_", &pdserve_cpu::decoder_layers_);
}

// oneDNN-packed weights are MkldnnCPU tensors, which make the dispatcher look for that key.
TORCH_LIBRARY_IMPL(pdserve_cpu, MkldnnCPU, m) { m.impl("decoder_layers_", &pdserve_cpu::decoder_layers_); }
