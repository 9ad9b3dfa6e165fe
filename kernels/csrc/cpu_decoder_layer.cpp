// The decoder layers of a step in one call: decode-only steps, prefills and mixed steps alike. The
// same math in the same order as model/llama.py's DecoderLayer (each residual add with the norm
// after it, RMSNorm.add_norm_) and the compiled backend (kernels/cpu_backend.py), its oracle:
//
//   h = rms_norm(x); q, k, v = split(h Wqkv^T); rotary(q, k); store k, v at their slots
//   x += attention(q, paged cache; each new prompt causal over its prefix) Wo^T
//   h = rms_norm(x); x += (silu(gate) * up)(h Wgate_up^T) Wdown^T
//
// That is a Llama. The other families (model/families.py) add, per layer, where the caller passes
// them (five more weights a layer, `windows`, `local_rope`, `activation`: decoder_layers_ below):
//   - a bias added to h Wqkv^T (Qwen2), whichever packing runs the projection;
//   - q and k each through an RMSNorm over every head's D values before the rotary (Qwen3, Gemma 3);
//   - a sliding window: each query attends its last `window` positions (Gemma 3's local layers),
//     which decode, prefill and a prompt's cached prefix read from the window's first block on;
//   - the local rotary tables instead of the global ones (Gemma 3's local layers, own base);
//   - sandwich norms (Gemma 3): x += post_norm(attention); h = pre_ffn_norm(x);
//     x += post_ffn_norm(mlp(h)), where a Llama's post norm is the MLP's input norm;
//   - GeGLU, gelu_tanh(gate) * up, instead of SiLU's (Gemma 3): the plain gate/up projection, then
//     the elementwise op (the fused gate/up kernels apply SiLU only).
// A Llama passes none of them and takes the branches of none: its step is the same work.
//
// A step through the Python layers spends much of a small step on their ~12 calls a layer
// (modules, dispatch, views, checks, temporaries: python -m pdserve.bench.engine_overhead, decode
// batch 1 and prefill 64, against --no-fused-ops; docs/cpu_kernels.md "Elementwise ops and the
// decoder layers in one call"); here they are direct calls to the compiled ops (ops.h),
// and x, the residual stream, is updated in place. The projections take any packing (ops.h
// `project`): our panels, AMX tiles, or oneDNN's layout, with a second packing for steps of more
// rows than `large_above` where the layers keep one (AMX tiles for small steps, oneDNN for large).
// Where the projections are bound by compute, the MLP's prefetch the next layer's KV for its
// decode rows in their background (prefetch.h), so that attention reads it from cache.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <utility>
#include <unistd.h>
#include <vector>

#include "ops.h"

namespace pdserve_cpu {

namespace {

// What a step's attention reads, beyond q, k and v: the first `num_decode` rows decode (one token
// per sequence, paged), the rest are new prompts' rows, sequence b at rows num_decode + cu[b] ..
// num_decode + cu[b + 1], `lens[b]` tokens long with its prefix (lens[b] - its rows) in the cache.
struct StepShape {
  int64_t num_decode;
  const at::Tensor& decode_seq_lens;
  const at::Tensor& decode_block_tables;
  std::vector<int64_t> cu, lens;
  const at::Tensor& prefill_block_tables;
};

// A sequence's cached positions first .. length-1 as a dense [length - first, Hkv, D], reading the
// blocks from first's on only (kernels/reference.py gather_kv(start=first)):
//
//   table_row:  | b0 | b1 | b2 | b3 |        block = 4, first = 6, length = 15
//   positions:   0..3 4..7 8..11 12..15
//   read:             [b1 ......... b3]     rows 4..15, then narrowed to 6..14
at::Tensor gather(const at::Tensor& cache, const at::Tensor& table_row, int64_t first, int64_t length) {
  const int64_t block = cache.size(1), first_block = first / block, blocks = (length + block - 1) / block;
  const at::Tensor rows = cache.index_select(0, table_row.narrow(0, first_block, blocks - first_block).to(at::kLong));
  return rows.reshape({-1, cache.size(2), cache.size(3)}).narrow(0, first - first_block * block, length - first);
}

// `window` > 0: each query attends its last `window` positions only. A prompt's cached prefix is
// then read from the first key its first row sees (the reference backend's rule): blocks before
// it may have been freed and hold another sequence's keys.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const StepShape& step, double scale, int64_t window,
                     const BackgroundPrefetch& spare) {
  const int64_t tokens = q.size(0), nd = step.num_decode;
  if (nd == tokens)
    return decode_attention_then(q, k_cache, v_cache, step.decode_seq_lens, step.decode_block_tables, scale, window,
                                 spare);
  const size_t prompts = step.lens.size();
  if (nd == 0 && prompts == 1 && step.lens[0] == tokens) return prefill_attention(q, k, v, 0, scale, window);
  at::Tensor out = at::empty_like(q);
  if (nd > 0)
    out.narrow(0, 0, nd).copy_(decode_attention(q.narrow(0, 0, nd), k_cache, v_cache, step.decode_seq_lens,
                                                step.decode_block_tables, scale, window));
  for (size_t b = 0; b < prompts; ++b) {
    const int64_t start = nd + step.cu[b], rows = step.cu[b + 1] - step.cu[b], prefix = step.lens[b] - rows;
    if (rows == 0) continue;
    const at::Tensor qs = q.narrow(0, start, rows);
    at::Tensor o;
    if (prefix == 0) {
      o = prefill_attention(qs, k.narrow(0, start, rows), v.narrow(0, start, rows), 0, scale, window);
    } else {
      const at::Tensor table = step.prefill_block_tables.select(0, static_cast<int64_t>(b));
      const int64_t first = window > 0 ? std::max<int64_t>(0, prefix - window + 1) : 0;
      const int64_t length = step.lens[b];
      o = prefill_attention(qs, gather(k_cache, table, first, length), gather(v_cache, table, first, length),
                            prefix - first, scale, window);
    }
    out.narrow(0, start, rows).copy_(o);
  }
  return out;
}

// The output projection's weight and, where it follows in memory (the packed weights lie side by
// side in the order the layer reads them: model/llama.py), the gate/up's, as one run of lines;
// nothing for weights that are not plain tensors (oneDNN's).
BackgroundPrefetch weights_after(const at::Tensor& o, const at::Tensor& gate_up) {
  if (o.is_mkldnn() || gate_up.is_mkldnn() || !o.is_contiguous()) return {};
  const char* base = static_cast<const char*>(o.data_ptr());
  const char* end = base + o.nbytes();
  const char* next = gate_up.is_contiguous() ? static_cast<const char*>(gate_up.data_ptr()) : nullptr;
  if (next >= end && next - end < 4096) end = next + gate_up.nbytes();
  return BackgroundPrefetch::run(base, (end - base) / kLineBytes);
}

// Steps of at least this many rows prefetch the next layer's KV under the MLP (kv_prefetch_budget).
constexpr int64_t kKvPrefetchRows = 16;

// The first `bytes` of each thread's share of a tile weight's units (groups of 32 columns; pairs
// of them for a fused gate/up), as at::parallel_for hands the units out: where each of the
// projection's streams starts. The offsets are the same in every layer (the layers' weights have
// one shape): built once a step from layer 0's, `of` moves them to a layer's weight.
struct StreamStarts {
  std::vector<int64_t> offsets;
  int64_t lines = 0;
  StreamStarts() = default;
  StreamStarts(const at::Tensor& w, bool pairs, int64_t bytes) {
    if (bytes <= 0 || w.dim() != 5 || !w.is_contiguous()) return;
    const int64_t threads = at::get_num_threads();
    const int64_t unit_bytes = w.stride(0) * w.element_size() * (pairs ? 2 : 1);
    const int64_t units = w.size(0) / (pairs ? 2 : 1), chunk = (units + threads - 1) / threads;
    for (int64_t t = 0; t < threads && t * chunk < units; ++t) offsets.push_back(t * chunk * unit_bytes);
    lines = std::min(bytes, unit_bytes * chunk) / kLineBytes;
  }
  BackgroundPrefetch of(const at::Tensor& w) const {
    if (lines == 0) return {};
    return {static_cast<const char*>(w.data_ptr()), offsets.data(), static_cast<int64_t>(offsets.size()), lines};
  }
};

// How much of the start of each thread's share of the next projection's weight to prefetch under
// this projection, for a step of `rows` rows (none where the MLP prefetches the next layer's KV).
// A thread's stream starts cold: at one row (the hardware streams the weights) and from
// kTileHardwareStreamRows + 1 rows (the kernel prefetches its own weight kTileOwnPrefetchBytes
// ahead, which leaves the first that many bytes of each stream to wait on DRAM) that start now
// arrives under the projection before. 32 KiB at one row, the kernel's own distance above
// kTileHardwareStreamRows rows (much more costs the projection under it more than it gains), none
// at 2 to 4 rows, where it loses. Only on the VDPBF16PS tiles: AMX keeps it off until it is
// benchmarked there (engine_overhead, decode batch 1 and 8; docs/cpu_kernels.md "Projections",
// "Tiles").
int64_t warm_bytes(int64_t rows) {
  static const bool tiles = tile_kernel() == "avx512_bf16";
  if (!tiles) return 0;
  if (rows == 1) return int64_t{32} << 10;
  return rows > kTileHardwareStreamRows && rows < kKvPrefetchRows ? kTileOwnPrefetchBytes : 0;
}

// Per projection of a layer (qkv, o, gate/up, down): where its threads' streams start.
using LayerStreamStarts = std::array<StreamStarts, 4>;

// The weights of a layer in decoder_layers_'s list: a Llama's six, or those and five more.
constexpr int64_t kLlamaWeights = 6, kFamilyWeights = kLlamaWeights + 5;

// What a layer adds to a Llama's (an undefined tensor or 0: nothing), from decoder_layers_'s extra
// weights, windows and local_rope.
struct LayerOptions {
  at::Tensor qkv_bias;       // [q + 2 kv], added to the qkv projection
  at::Tensor q_norm;         // [D] each, with k_norm: RMSNorm of every head
  at::Tensor k_norm;
  at::Tensor pre_ffn_norm;   // [H] each, with post_ffn_norm: sandwich norms
  at::Tensor post_ffn_norm;
  int64_t window = 0;        // > 0: a sliding window of that many positions
  const at::Tensor* cos = nullptr;  // the rotary tables the layer reads
  const at::Tensor* sin = nullptr;
};

// The MLP's activation, decoder_layers_'s `activation`.
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// The gate/up projection's activation: SiLU fused into the projection where its packing allows it
// (project_silu_mul), GELU-tanh after a plain projection, through paired tiles' column order where
// the weight is such tiles (tile_fuses_silu_mul: the tiles model/llama.py pairs).
at::Tensor gate_up_act(const at::Tensor& h, const at::Tensor& weight, int64_t intermediate, Activation act,
                       const PrefetchRange& background) {
  if (act == Activation::kSilu) return project_silu_mul(h, weight, intermediate, background);
  const int64_t pair_group = tile_fuses_silu_mul(weight, intermediate) ? 2 * intermediate / weight.size(0) : 0;
  return gelu_tanh_mul(project(h, weight, 2 * intermediate, background), pair_group);
}

// One layer from h, its input already normalised: x += attention, then x += MLP, in place. The
// residual adds go with the norms after them (add_rms_norm_: one pass, the same numbers as
// `x += y` then rms_norm): the post-attention norm (with sandwich norms, the pre-feedforward one),
// then `after` (the next layer's input norm or the final one), whose output it returns. `opt`:
// what the layer adds to a Llama's, `act` the MLP's activation. `proj` holds the layer's four
// projections in the packing this step's row count takes; `next_kv`, possibly empty, is the next layer's KV that the
// MLP's projections prefetch in their background (kv_prefetch_budget); `next_qkv`, null after the
// last layer, the next layer's qkv weight, whose streams' starts (`starts`) the down projection
// prefetches as each projection does the next one's.
at::Tensor layer_from_normed(at::Tensor& x, const at::Tensor& h, const at::Tensor& post_norm, const at::Tensor* proj,
                             const at::Tensor& after, const at::Tensor& positions, const LayerOptions& opt,
                             Activation act, at::Tensor k_cache, at::Tensor v_cache,
                             const at::Tensor& slot_mapping, const StepShape& step, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
                             double scale, const BackgroundPrefetch& next_kv, const LayerStreamStarts& starts,
                             const at::Tensor* next_qkv) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // Each projection prefetches where the threads' streams of the next one start (warm_bytes).
  const BackgroundPrefetch w_o = starts[1].of(proj[1]), w_gu = starts[2].of(proj[2]);
  const BackgroundPrefetch w_down = starts[3].of(proj[3]);
  const BackgroundPrefetch w_next = next_qkv != nullptr ? starts[0].of(*next_qkv) : BackgroundPrefetch{};
  at::Tensor qkv_out = project(h, proj[0], q_size + 2 * kv_size, PrefetchRange::all(w_o));
  if (opt.qkv_bias.defined()) qkv_out.add_(opt.qkv_bias);
  at::Tensor q = qkv_out.narrow(1, 0, q_size), k = qkv_out.narrow(1, q_size, kv_size);
  if (opt.q_norm.defined()) {  // over [T * heads, D] rows: copies, as the PyTorch layer's
    q = rms_norm(q.reshape({-1, head_dim}), opt.q_norm, eps);
    k = rms_norm(k.reshape({-1, head_dim}), opt.k_norm, eps);
  }
  q = q.view({tokens, num_heads, head_dim});
  k = k.view({tokens, num_kv_heads, head_dim});
  const at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  rotary_(q, k, positions, *opt.cos, *opt.sin);
  store_kv_(k, v, k_cache, v_cache, slot_mapping);
  // At batch 1 the second thread has no sequence to attend: it pulls in the weights that follow,
  // which the output projection then reads from cache (engine_overhead, decode batch 1;
  // docs/cpu_kernels.md "Decode attention", "Work items").
  const BackgroundPrefetch spare = weights_after(proj[1], proj[2]);
  const at::Tensor attn = attention(q, k, v, k_cache, v_cache, step, scale, opt.window, spare);
  const at::Tensor o = project(attn.reshape({tokens, q_size}), proj[1], hidden, PrefetchRange::all(w_gu));
  const at::Tensor h2 = !opt.pre_ffn_norm.defined()
                            ? add_rms_norm_(x, o, post_norm, eps)
                            : add_rms_norm_(x, rms_norm(o, post_norm, eps), opt.pre_ffn_norm, eps);
  // The next layer's KV (if any) trickles into the caches under the MLP, split by FLOPs: two thirds
  // under the gate/up projection, the rest under the down projection. Without it, the starts of
  // the down projection's streams, then of the next layer's qkv.
  const int64_t lines = next_kv.lines(), split = lines * 2 / 3;
  const PrefetchRange under_gate_up =
      lines > 0 ? PrefetchRange{&next_kv, 0, split} : PrefetchRange::all(w_down);
  const PrefetchRange under_down =
      lines > 0 ? PrefetchRange{&next_kv, split, lines} : PrefetchRange::all(w_next);
  const at::Tensor gated = gate_up_act(h2, proj[2], intermediate_size, act, under_gate_up);
  at::Tensor mlp = project(gated, proj[3], hidden, under_down);
  if (opt.post_ffn_norm.defined()) mlp = rms_norm(mlp, opt.post_ffn_norm, eps);
  return add_rms_norm_(x, mlp, after, eps);
}

// The KV a step's decode rows read in layers of sliding window `window` (0: none), as byte offsets
// from a layer's K cache, each block's keys then its values (the same offsets in every such layer:
// `layer` only moves the base): block j of every sequence's window before block j + 1 of any (so a
// budget cut leaves each sequence its first blocks), up to `budget` bytes. Blocks before a
// window's first (kernels/reference.py window_first_block) are not read: they may be freed.
struct DecodeKvBlocks {
  std::vector<int64_t> offsets;
  int64_t block_lines = 0;
  const char* cache = nullptr;  // layer 0's K cache
  int64_t layer_bytes = 0;

  // kv_cache [L, 2, blocks, S, Hkv, D], as decoder_layers_ takes it.
  DecodeKvBlocks(const StepShape& step, const at::Tensor& kv_cache, int64_t budget, int64_t window) {
    const at::Tensor& tables = step.decode_block_tables;
    // decode_attention checks the metadata after this; a table it would refuse prefetches nothing.
    if (step.num_decode == 0 || budget <= 0 || tables.dim() != 2 || tables.scalar_type() != at::kInt ||
        tables.size(0) < step.num_decode || tables.stride(1) != 1)
      return;
    const int64_t elem = kv_cache.element_size(), block_bytes = kv_cache.stride(2) * elem;
    const int64_t values_at = kv_cache.stride(1) * elem, block = kv_cache.size(3);
    block_lines = block_bytes / kLineBytes;
    cache = static_cast<const char*>(kv_cache.data_ptr());
    layer_bytes = kv_cache.stride(0) * elem;
    const at::Tensor lens = step.decode_seq_lens.to(at::kInt).contiguous();
    const int32_t* lp = lens.data_ptr<int32_t>();
    const int32_t* tp = tables.data_ptr<int32_t>();
    // The blocks a sequence reads, first .. end - 1 within its table row.
    const auto end = [&](int64_t b) { return std::clamp<int64_t>((lp[b] + block - 1) / block, 0, tables.size(1)); };
    const auto first = [&](int64_t b) { return window > 0 && lp[b] > window ? (lp[b] - window) / block : 0; };
    // A row whose blocks the next row reads too (a prompt's rows, each a decode of its own under
    // --deterministic) adds nothing: only the rows that are not.
    const auto covered = [&](int64_t b) {
      if (b + 1 >= step.num_decode || first(b + 1) > first(b) || end(b + 1) < end(b)) return false;
      const int32_t* row = tp + b * tables.stride(0);
      return std::equal(row + first(b), row + end(b), tp + (b + 1) * tables.stride(0) + first(b));
    };
    std::vector<int64_t> reading;
    int64_t most = 0;
    for (int64_t b = 0; b < step.num_decode; ++b) {
      if (covered(b)) continue;
      reading.push_back(b);
      most = std::max(most, end(b) - first(b));
    }
    for (int64_t j = 0; j < most; ++j) {
      for (const int64_t b : reading) {
        if (first(b) + j >= end(b)) continue;
        if (static_cast<int64_t>(offsets.size() + 2) * block_bytes > budget) return;
        const int64_t at = tp[b * tables.stride(0) + first(b) + j] * block_bytes;
        offsets.push_back(at);
        offsets.push_back(values_at + at);
      }
    }
  }

  // Those lines in layer l (none where no block was taken).
  BackgroundPrefetch layer(int64_t l) const {
    return {cache + l * layer_bytes, offsets.data(), static_cast<int64_t>(offsets.size()), block_lines};
  }
};

// How many bytes of the next layer's KV to prefetch while a layer's MLP runs: a quarter of the
// last-level cache, so that it is still there when the next layer's attention reads it; nothing
// where the caller turns it off (`kv_prefetch`: the engine's --kv-prefetch). Only where it pays:
// steps of at least kKvPrefetchRows rows, whose projections are bound by compute and leave memory
// idle (below that they are bound by memory and lose what attention gains), on the VDPBF16PS
// tiles (AMX keeps it off until it is benchmarked there). engine_overhead, decode batch 8 and 32,
// against --no-kv-prefetch; docs/cpu_kernels.md "Elementwise ops and the decoder layers in one
// call".
int64_t kv_prefetch_budget(const at::Tensor& gate_up, int64_t rows, bool kv_prefetch) {
  static const int64_t budget = [] {
    if (tile_kernel() != "avx512_bf16") return int64_t{0};
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? static_cast<int64_t>(l3) / 4 : int64_t{8} << 20;
  }();
  return kv_prefetch && gate_up.dim() == 5 && rows >= kKvPrefetchRows ? budget : 0;  // only the tiles trickle it
}

std::vector<int64_t> as_longs(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Every layer's LayerOptions from decoder_layers_'s weights (`per_layer` of them a layer: the
// five extras follow a Llama's six where there are eleven), windows and local_rope, checked (the
// norms' shapes and dtypes by rms_norm). The tables the options point at outlive them.
std::vector<LayerOptions> layer_options(at::TensorList weights, int64_t per_layer, at::IntArrayRef windows,
                                        at::IntArrayRef local_rope, const at::Tensor& cos, const at::Tensor& sin,
                                        const std::optional<at::Tensor>& local_cos,
                                        const std::optional<at::Tensor>& local_sin, int64_t layers,
                                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                        const at::Tensor& x) {
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers, "windows: none, or one for each of ",
              layers, " layers, got ", windows.size());
  TORCH_CHECK(local_rope.empty() || static_cast<int64_t>(local_rope.size()) == layers,
              "local_rope: none, or one for each of ", layers, " layers, got ", local_rope.size());
  std::vector<LayerOptions> options(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    LayerOptions& o = options[static_cast<size_t>(l)];
    o.cos = &cos;
    o.sin = &sin;
    if (!local_rope.empty() && local_rope[l] != 0) {
      TORCH_CHECK(local_cos.has_value() && local_sin.has_value(), "layer ", l,
                  " reads the local rotary tables: pass local_cos and local_sin");
      o.cos = &*local_cos;
      o.sin = &*local_sin;
    }
    if (!windows.empty()) {
      TORCH_CHECK(windows[l] >= 0, "layer ", l, ": a window is 0 (none) or a positive number of positions, got ",
                  windows[l]);
      o.window = windows[l];
    }
    if (per_layer == kLlamaWeights) continue;
    // An empty tensor stands for a weight the layer does not have.
    const auto extra = [&](int64_t i) {
      const at::Tensor& t = weights[per_layer * l + kLlamaWeights + i];
      return t.numel() > 0 ? t : at::Tensor();
    };
    o.qkv_bias = extra(0);
    o.q_norm = extra(1);
    o.k_norm = extra(2);
    o.pre_ffn_norm = extra(3);
    o.post_ffn_norm = extra(4);
    TORCH_CHECK(o.q_norm.defined() == o.k_norm.defined(), "layer ", l, ": a q norm and a k norm, or neither");
    TORCH_CHECK(o.pre_ffn_norm.defined() == o.post_ffn_norm.defined(), "layer ", l,
                ": a pre- and a post-feedforward norm, or neither");
    const int64_t qkv = (num_heads + 2 * num_kv_heads) * head_dim;
    TORCH_CHECK(!o.qkv_bias.defined() || (o.qkv_bias.dim() == 1 && o.qkv_bias.size(0) == qkv &&
                                          o.qkv_bias.scalar_type() == x.scalar_type()),
                "layer ", l, ": the qkv bias must be [", qkv, "] of x's dtype");
  }
  return options;
}

}  // namespace

// Every layer of a step, and the final norm, in one call: weights six per layer in its order (input
// norm, post norm, qkv, o, gate_up, down) or eleven (those, then the other families' five below),
// large_weights empty or four per layer (qkv, o, gate_up, down: the packing for steps of more than
// large_above rows), kv_cache the engine's [L, 2, blocks, S, Hkv, D], and the step's attention
// metadata as model/llama.py's AttentionMetadata holds it (int32 lengths, tables and offsets).
// Returns the final hidden states, normalised; x, the residual stream, is updated in place. One
// call from Python instead of one per layer, whose calls and argument handling show in a small
// decode step (engine_overhead, decode batch 1). `kv_prefetch` false keeps the MLP from
// prefetching the next layer's KV (kv_prefetch_budget).
//
// The other families' options (a Llama passes none; the file's header says what each does):
//   weights 7-11 of a layer   qkv bias [q + 2 kv], q norm [D], k norm [D] (both or neither),
//                             pre-feedforward norm [H], post-feedforward norm [H] (both or
//                             neither: sandwich norms); an empty tensor where the layer has none
//   windows      empty, or one per layer: its sliding window (0: none)
//   local_rope   empty, or one per layer: 1 where it reads local_cos / local_sin, not cos / sin
//   activation   0: SiLU (SwiGLU), 1: GELU-tanh (GeGLU)
at::Tensor decoder_layers_(at::Tensor x, at::TensorList weights, at::TensorList large_weights, int64_t large_above,
                           const at::Tensor& final_norm, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                           int64_t num_decode, const at::Tensor& decode_seq_lens,
                           const at::Tensor& decode_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                           const at::Tensor& prefill_seq_lens, const at::Tensor& prefill_block_tables,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                           double eps, double scale, bool kv_prefetch, at::IntArrayRef windows,
                           at::IntArrayRef local_rope, int64_t activation, const std::optional<at::Tensor>& local_cos,
                           const std::optional<at::Tensor>& local_sin) {
  constexpr int64_t kProjections = 4;
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2, "kv_cache must be [L, 2, blocks, S, Hkv, D], got ",
              kv_cache.sizes());
  const int64_t layers = kv_cache.size(0), n = static_cast<int64_t>(weights.size());
  TORCH_CHECK(n == kLlamaWeights * layers || (layers > 0 && n == kFamilyWeights * layers), "expected ",
              kLlamaWeights, " (or ", kFamilyWeights, ") weights for each of ", layers, " layers, got ", n);
  const int64_t per_layer = layers > 0 && n == kFamilyWeights * layers ? kFamilyWeights : kLlamaWeights;
  TORCH_CHECK(large_weights.empty() || static_cast<int64_t>(large_weights.size()) == kProjections * layers,
              "large_weights: none, or ", kProjections, " for each of ", layers, " layers, got ", large_weights.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H]");
  const std::vector<LayerOptions> options = layer_options(weights, per_layer, windows, local_rope, cos, sin,
                                                          local_cos, local_sin, layers, num_heads, num_kv_heads,
                                                          head_dim, x);
  TORCH_CHECK(activation == 0 || activation == 1, "activation must be 0 (SiLU) or 1 (GELU-tanh), got ", activation);
  const Activation act = static_cast<Activation>(activation);
  const int64_t tokens = x.size(0);
  TORCH_CHECK(num_decode >= 0 && num_decode <= tokens && decode_seq_lens.dim() == 1 &&
                  decode_seq_lens.size(0) == num_decode,
              "num_decode ", num_decode, " of ", tokens, " tokens, with one decode length each, got ",
              decode_seq_lens.sizes());
  StepShape step{num_decode, decode_seq_lens, decode_block_tables, {}, {}, prefill_block_tables};
  if (num_decode < tokens) {
    step.cu = as_longs(prefill_cu_seqlens_q);
    step.lens = as_longs(prefill_seq_lens);
    TORCH_CHECK(step.cu.size() == step.lens.size() + 1 && step.cu.front() == 0 &&
                    step.cu.back() == tokens - num_decode && prefill_block_tables.dim() == 2 &&
                    prefill_block_tables.size(0) == static_cast<int64_t>(step.lens.size()),
                "the prefill rows' metadata must cover the ", tokens - num_decode,
                " rows after the decodes: cu_seqlens [0 .. rows], a length and a block table per prompt");
    for (size_t b = 0; b < step.lens.size(); ++b)
      TORCH_CHECK(step.cu[b + 1] >= step.cu[b] && step.lens[b] >= step.cu[b + 1] - step.cu[b],
                  "prompt ", b, ": ", step.cu[b + 1] - step.cu[b], " new rows in a sequence of ", step.lens[b]);
  }
  const bool large = !large_weights.empty() && tokens > large_above;
  at::Tensor h = rms_norm(x, layers > 0 ? weights[0] : final_norm, eps);
  const int64_t budget =
      layers > 1 ? kv_prefetch_budget(large ? large_weights[2] : weights[4], tokens, kv_prefetch) : 0;
  // The decode rows' KV blocks, per distinct window among the layers (a Llama's: one, window 0).
  std::vector<std::pair<int64_t, DecodeKvBlocks>> decode_kv;
  decode_kv.reserve(static_cast<size_t>(std::max<int64_t>(layers, 1)));  // never moved: next_kv points into it
  const auto next_kv_of = [&](int64_t l) -> BackgroundPrefetch {
    if (l >= layers) return {};
    const int64_t window = options[l].window;
    for (const auto& [w, blocks] : decode_kv)
      if (w == window) return blocks.layer(l);
    decode_kv.emplace_back(window, DecodeKvBlocks(step, kv_cache, budget, window));
    return decode_kv.back().second.layer(l);
  };
  // Layer l's four projections, in the packing this step's row count takes.
  const auto proj_of = [&](int64_t l) {
    return large ? large_weights.data() + kProjections * l : weights.data() + per_layer * l + 2;
  };
  LayerStreamStarts starts;
  if (layers > 0) {
    const at::Tensor* first = proj_of(0);
    const int64_t warm = warm_bytes(tokens);
    // GeGLU runs the plain projection over paired tiles: one group a unit, as any other.
    const bool pairs = act == Activation::kSilu && tile_fuses_silu_mul(first[2], intermediate_size);
    starts = {StreamStarts(first[0], false, warm), StreamStarts(first[1], false, warm),
              StreamStarts(first[2], pairs, warm), StreamStarts(first[3], false, warm)};
  }
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + per_layer * l;
    const at::Tensor* proj = proj_of(l);
    const at::Tensor& after = l + 1 < layers ? w[per_layer] : final_norm;  // the next layer's input norm
    const at::Tensor layer_cache = kv_cache.select(0, l);
    const BackgroundPrefetch next_kv = next_kv_of(l + 1);
    const at::Tensor* next_qkv = l + 1 < layers ? proj_of(l + 1) : nullptr;  // never past the last layer
    h = layer_from_normed(x, h, w[1], proj, after, positions, options[l], act, layer_cache.select(0, 0),
                          layer_cache.select(0, 1), slot_mapping, step, num_heads, num_kv_heads, head_dim,
                          intermediate_size, eps, scale, next_kv, starts, next_qkv);
  }
  return h;
}

}  // namespace pdserve_cpu
