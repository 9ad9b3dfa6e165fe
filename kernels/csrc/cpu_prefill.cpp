// Causal prefill attention of one sequence on the CPU; float32 here, as blocked matmuls (bfloat16
// goes to AMX tiles: cpu_prefill_tiles.cpp):
//
//   q [T, Hq, D]; key, value [Tk, Hkv, D] with Tk = offset + T; query t sits at position offset + t
//   and sees keys 0 .. offset + t, or with a sliding window W > 0 only offset + t - W + 1 ..
//   offset + t. Query heads h*G .. h*G+G-1 share KV head h.
//
// A window first drops the keys before the first query's window (none of them is seen, so they
// are neither packed nor scored); then each chunk of rows starts its products at the panel
// holding its first row's first key, and each row's softmax zeroes the keys before its own.
// Without a window (or with one over every key) the chunks start at key 0 as before.
//
// Each KV head's keys and values are first packed, once, into the panels of 24 columns that the
// projections' kernel reads (cpu_linear.cpp): the keys as a weight [Tk, D] (scores = q k^T), the
// values as one [D, Tk] (out = p v), so a block of queries runs against any prefix of them. A work
// item, on one thread, is one KV head and one block of 64 query tokens, whose G query heads are
// the rows of two products, 48 rows (16 tokens) at a time: scores against the keys the chunk's last
// row sees, a softmax per row over the keys that row sees (the rest zeroed), then the product with
// the values, whose rows are divided by their sums as they are written out. The upper triangle of
// each chunk's last keys is computed and discarded. kernels/reference.py's SDPA path is the oracle.
// The panels beat the same blocks as whole-block MKL sgemms (at::mm, which packs both operands
// every call) and torch's SDPA (python -m pdserve.bench.engine_overhead --dtype float32, prefill
// 256 and 1,024; docs/cpu_kernels.md "Prefill attention").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kTokenBlock = 64;
constexpr int64_t kRowChunk = pdserve_cpu::kPanelRowBlock;  // rows of a block's product at a time

// Row r of s (n_row visible keys of `width`): p = exp(scale (s - max)) over the visible keys, zero
// past them; returns 1 / sum p.
inline float softmax_row(float* __restrict s, int64_t n_row, int64_t width, float scale) {
  const float sum = exp_shifted_sum(s, n_row, row_max(s, n_row), scale);
  std::fill(s + n_row, s + width, 0.f);
  return 1.f / sum;
}

// The first key a query at position `pos` sees through a window of `window` > 0 keys.
inline int64_t first_key(int64_t pos, int64_t window) { return pos >= window ? pos - window + 1 : 0; }

// Rows [n, K] of src (row r at src + r * ld, K contiguous) as the panels of a weight with n output
// columns: dst[p, k, j] = src[24 p + j, k], zero past n. dst holds ceil(n / 24) * K * 24.
void pack_rows(const float* src, int64_t ld, int64_t n, int64_t k_size, float* dst) {
  constexpr int64_t kCols = pdserve_cpu::kPanelColumns;
  for (int64_t p = 0; p * kCols < n; ++p) {
    float* panel = dst + p * k_size * kCols;
    const int64_t cols = std::min(kCols, n - p * kCols);
    for (int64_t k = 0; k < k_size; ++k)
      for (int64_t j = 0; j < kCols; ++j) panel[k * kCols + j] = j < cols ? src[(p * kCols + j) * ld + k] : 0.f;
  }
}

// Rows [K, n] of src (row k at src + k * ld) as the panels of a weight [n, K], i.e. its transpose:
// dst[p, k, j] = src[k, 24 p + j], zero past n; a copy of 24 contiguous floats at a time.
void pack_columns(const float* src, int64_t ld, int64_t n, int64_t k_size, float* dst) {
  constexpr int64_t kCols = pdserve_cpu::kPanelColumns;
  for (int64_t p = 0; p * kCols < n; ++p) {
    float* panel = dst + p * k_size * kCols;
    const int64_t cols = std::min(kCols, n - p * kCols);
    for (int64_t k = 0; k < k_size; ++k) {
      std::copy(src + k * ld + p * kCols, src + k * ld + p * kCols + cols, panel + k * kCols);
      std::fill(panel + k * kCols + cols, panel + (k + 1) * kCols, 0.f);
    }
  }
}

}  // namespace

namespace pdserve_cpu {

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_in, const at::Tensor& value_in,
                             int64_t offset_in, double scale, int64_t window) {
  at::Tensor key = key_in, value = value_in;
  int64_t offset = offset_in;
  TORCH_CHECK(q.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "pdserve_cpu.prefill_attention runs on CPU tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && key.scalar_type() == dtype && value.scalar_type() == dtype,
              "pdserve_cpu.prefill_attention computes float32 or bfloat16, q, key and value alike");
  TORCH_CHECK(q.dim() == 3 && key.dim() == 3 && key.sizes() == value.sizes(), "expected q [T, Hq, D] and key, value [Tk, Hkv, D]");
  const int64_t tokens = q.size(0), hq = q.size(1), d = q.size(2), hkv = key.size(1);
  int64_t keys = key.size(0);
  TORCH_CHECK(key.size(2) == d, "q and key differ in head size");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(offset >= 0 && keys == offset + tokens, "expected ", offset + tokens, " keys (offset ", offset, " + ",
              tokens, " queries), got ", keys);
  TORCH_CHECK(q.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "q, key and value need a contiguous head dimension");
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a positive number of keys, got ", window);
  if (window >= keys) window = 0;  // every row's window holds all the keys it sees
  if (window > 0 && offset >= window) {  // keys before the first row's window: none is seen
    const int64_t drop = offset - window + 1;
    key = key.narrow(0, drop, keys - drop);
    value = value.narrow(0, drop, keys - drop);
    offset -= drop;
    keys -= drop;
  }
  if (dtype == at::kBFloat16) return prefill_attention_tiles(q, key, value, offset, scale, window);
  const int64_t group = hq / hkv;
  const float fscale = static_cast<float>(scale);
  at::Tensor out = at::empty({tokens, hq, d}, q.options());
  if (tokens == 0) return out;
  // [Hkv, T * G, D]: each KV head's query rows, token by token, its G heads together.
  const at::Tensor rows = q.reshape({tokens, hkv, group, d}).transpose(0, 1).contiguous().view({hkv, tokens * group, d});
  const float* rp = rows.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Each head's keys and values as panels: [Hkv, ceil(Tk / 24), D, 24] and [Hkv, ceil(D / 24), Tk, 24].
  const int64_t key_panels = (keys + kPanelColumns - 1) / kPanelColumns, value_panels = (d + kPanelColumns - 1) / kPanelColumns;
  const int64_t key_pack = key_panels * d * kPanelColumns, value_pack = value_panels * keys * kPanelColumns;
  const at::Tensor packing = at::empty({hkv * (key_pack + value_pack)}, q.options());
  float* packed = packing.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  at::parallel_for(0, 2 * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / 2;
      float* dst = packed + h * (key_pack + value_pack);
      if (item % 2 == 0) {
        pack_rows(kp + h * key.stride(1), key.stride(0), keys, d, dst);
      } else {
        pack_columns(vp + h * value.stride(1), value.stride(0), d, keys, dst + key_pack);
      }
    }
  });
  // Work items (KV head, token block). A block costs in proportion to the keys it sees, so items
  // go in pairs of a late and an early block, and each thread's contiguous share of them holds
  // about as much work.
  const int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock, items = hkv * blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // Scratch, written before it is read: left uninitialised (at 8,192 keys, s is 6 MB a thread).
    std::vector<float> inv(kTokenBlock * group);
    const std::unique_ptr<float[]> s(new float[kTokenBlock * group * keys]), o(new float[kTokenBlock * group * d]);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, i = item % blocks;
      const int64_t block = i % 2 == 0 ? blocks - 1 - i / 2 : i / 2;
      const int64_t t0 = block * kTokenBlock, bt = std::min(kTokenBlock, tokens - t0), m = bt * group;
      const int64_t width = offset + t0 + bt;  // the keys this block's last token sees
      const float* head_keys = packed + h * (key_pack + value_pack);
      const float* head_values = head_keys + key_pack;
      const float* q_rows = rp + (h * tokens * group + t0 * group) * d;
      float* sp = s.get();  // [m, width]
      // A chunk of rows at a time, against only the keys its last row sees: the discarded upper
      // triangle shrinks from the block's 64 tokens to a chunk's 16 (SmolLM2's 3 query heads).
      for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
        const int64_t rc = std::min(kRowChunk, m - r0), seen = offset + t0 + (r0 + rc - 1) / group + 1;
        // The chunk's keys from the panel holding its first row's first key: 0 without a window.
        const int64_t k0 = window > 0 ? first_key(offset + t0 + r0 / group, window) / kPanelColumns * kPanelColumns : 0;
        panel_product(q_rows + r0 * d, d, rc, head_keys + k0 * d, d * kPanelColumns, d, seen - k0, sp + r0 * width + k0,
                      width);
        for (int64_t r = r0; r < r0 + rc; ++r) {
          float* row = sp + r * width;
          const int64_t pos = offset + t0 + r / group, first = window > 0 ? first_key(pos, window) : 0;
          std::fill(row + k0, row + first, 0.f);
          inv[r] = softmax_row(row + first, pos + 1 - first, seen - first, fscale);
        }
        panel_product(sp + r0 * width + k0, width, rc, head_values + k0 * kPanelColumns, keys * kPanelColumns, seen - k0,
                      d, o.get() + r0 * d, d);
      }
      for (int64_t r = 0; r < m; ++r) {
        float* dst = op + ((t0 + r / group) * hq + h * group + r % group) * d;
        const float* src = o.get() + r * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = src[j] * inv[r];
      }
    }
  });
  return out;
}

}  // namespace pdserve_cpu
