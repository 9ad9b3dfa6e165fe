// The compiled CPU ops as C++ functions: bindings.cpp registers them as torch.ops.pdserve_cpu.<name>
// (the schemas live there), and ops built from other ops (cpu_decoder_layer.cpp) call them without
// a trip through the dispatcher. The checks live with each definition.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "prefetch.h"

namespace pdserve_cpu {

// cpu_attention.cpp. `window` > 0: each query attends its last `window` positions only (a
// sliding window, kernels/interface.py), 0: all of them.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                            int64_t window);
// decode_attention, where a thread left without a sequence (fewer sequences than threads, as at
// batch 1) prefetches the lines of `spare` meanwhile, in order, until the last sequence is done:
// the memory the caller reads next (the output projection's weight), which would otherwise wait
// for it on DRAM.
at::Tensor decode_attention_then(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                                 int64_t window, const BackgroundPrefetch& spare);
void store_kv_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping);

// cpu_elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// x += y in place, then rms_norm(x): the residual add and the next norm in one pass.
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& y, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
// gelu(gate, approximate="tanh") * up of [T, 2I] rows -> [T, I] (GeGLU), as torch computes it to
// within float32 rounding. `pair_group` > 0: the gate's and the up's columns alternate in groups
// of that many (a gate/up projection through paired tiles, cpu_linear.pack_gate_up_tiles).
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, int64_t pair_group = 0);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
// [R, N] rows -> int64 [R]: max(dim=-1).indices, for greedy sampling.
at::Tensor argmax_rows(const at::Tensor& x);

// cpu_linear.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features);
// x W^T for a weight packed any of the three ways (cpu_linear.cpp): 3-D panels go to `linear`,
// 5-D AMX tiles to `tile_linear`, a 2-D [N, K] weight in oneDNN's packed layout
// (model/llama.py Linear.pack_onednn) to oneDNN's matmul. The tiles trickle `background`
// (prefetch.h) between their own loads; the other packings ignore it.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                   const PrefetchRange& background = {});
// x W^T through oneDNN's packed copy of W [N, K] (model/llama.py Linear.pack_onednn), with the
// rows split between the intra-op threads where each gets enough of them.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed);
// silu(gate) * up of x through a gate/up weight [2 I, K] packed in 24-column panels, I % 24 == 0.
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t intermediate);
// silu_mul(project(x, weight, 2 I)), in one pass where the packing allows it: panels with I a
// multiple of 24, or AMX tiles with I a multiple of 32 (tile_fuses_silu_mul).
at::Tensor project_silu_mul(const at::Tensor& x, const at::Tensor& weight, int64_t intermediate,
                           const PrefetchRange& background = {});

// y [rows, n] = x [rows, k_size] times a float32 weight in 24-column panels, on this thread only:
// panel p starts at panels + p * panel_stride and its first k_size rows of 24 are read (so a panel
// packed for a longer K serves any prefix of it). For kernels that run products inside their own
// parallel work items (cpu_prefill.cpp).
void panel_product(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t panel_stride, int64_t k_size,
                   int64_t n, float* y, int64_t ldy);
// Output columns per panel, and the rows of x the panel kernel takes through a panel at a time.
constexpr int64_t kPanelColumns = 24;
constexpr int64_t kPanelRowBlock = 48;

// cpu_prefill.cpp: causal attention of one new prompt's rows over its keys (offset of them cached
// before it), each row over its last `window` keys where window > 0, float32 or bfloat16 (the
// tiles below).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, int64_t offset,
                             double scale, int64_t window);

// cpu_prefill_tiles.cpp: prefill_attention in bfloat16 (checked there), D a multiple of 32.
at::Tensor prefill_attention_tiles(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, int64_t offset,
                                   double scale, int64_t window);

// cpu_linear_tiles.cpp
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const PrefetchRange& background = {});
// silu(gate) * up of x through AMX tiles of a gate/up weight [2 I, K], I % 32 == 0, in one pass.
at::Tensor tile_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                                const PrefetchRange& background = {});
// Whether tile_linear_silu_mul takes this packed weight and intermediate size.
bool tile_fuses_silu_mul(const at::Tensor& packed, int64_t intermediate);
// Whether this build and process run the tiles on AMX (amx.h); onednn_linear asks.
bool tile_linear_uses_amx();
// What runs the tile kernels here: "amx", "avx512_bf16" or "portable" (amx.h).
std::string tile_kernel();
// Whether the weights the tile kernels read lie on transparent huge pages: there the smallest
// steps leave the weight's stream to the hardware prefetcher (cpu_linear_tiles.cpp). Process-wide,
// false (prefetch) until the model that packs them says so (model/llama.py pack_cpu_linears).
bool tile_weights_on_huge_pages();
void set_tile_weights_on_huge_pages(bool on);
// On VDPBF16PS, a chunk of up to this many rows on huge pages leaves its weight's stream to the
// hardware prefetcher; larger chunks prefetch their weight kTileOwnPrefetchBytes ahead.
constexpr int kTileHardwareStreamRows = 4;
constexpr int64_t kTileOwnPrefetchBytes = int64_t{16} << 10;

// cpu_decoder_layer.cpp: every layer of a step and the final norm in one call, a Llama's or, with
// the options after kv_prefetch, any family's (the arguments are described there).
at::Tensor decoder_layers_(at::Tensor x, at::TensorList weights, at::TensorList large_weights, int64_t large_above,
                           const at::Tensor& final_norm, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                           int64_t num_decode, const at::Tensor& decode_seq_lens,
                           const at::Tensor& decode_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                           const at::Tensor& prefill_seq_lens, const at::Tensor& prefill_block_tables,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                           double eps, double scale, bool kv_prefetch, at::IntArrayRef windows,
                           at::IntArrayRef local_rope, int64_t activation, const std::optional<at::Tensor>& local_cos,
                           const std::optional<at::Tensor>& local_sin);

}  // namespace pdserve_cpu
