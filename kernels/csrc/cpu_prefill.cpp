// Causal prefill attention of one sequence in float32 on the CPU, as blocked matmuls:
//
//   q [T, Hq, D]; key, value [Tk, Hkv, D] with Tk = offset + T; query t sits at position offset + t
//   and sees keys 0 .. offset + t. Query heads h*G .. h*G+G-1 share KV head h.
//
// A work item, on one thread, is one KV head and one block of 64 query tokens. The block's G query
// heads are the rows of one sgemm (MKL's, through at::mm) against every key the block's last token
// sees, read in place at their stride; then a softmax per row over the keys that row sees (the
// rest zeroed); then one sgemm with the values, whose rows are divided by their sums as they are
// written out. The upper triangle of the block's last keys is computed and discarded: 6% more work
// at 1,024 tokens. On a 2-core AVX2 EPYC, SmolLM2's shapes: torch's SDPA (its CPU flash attention)
// 50-90 GFLOP/s, this 90-130. kernels/reference.py's SDPA path is the oracle.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTokenBlock = 64;

// Row r of s (n_row visible keys of `width`): p = exp(scale (s - max)) over the visible keys, zero
// past them; returns 1 / sum p.
inline float softmax_row(float* __restrict s, int64_t n_row, int64_t width, float scale) {
  const float sum = exp_shifted_sum(s, n_row, row_max(s, n_row), scale);
  std::fill(s + n_row, s + width, 0.f);
  return 1.f / sum;
}

}  // namespace

namespace pdserve_cpu {

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, int64_t offset,
                             double scale) {
  TORCH_CHECK(q.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "pdserve_cpu.prefill_attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "pdserve_cpu.prefill_attention computes float32");
  TORCH_CHECK(q.dim() == 3 && key.dim() == 3 && key.sizes() == value.sizes(), "expected q [T, Hq, D] and key, value [Tk, Hkv, D]");
  const int64_t tokens = q.size(0), hq = q.size(1), d = q.size(2), keys = key.size(0), hkv = key.size(1);
  TORCH_CHECK(key.size(2) == d, "q and key differ in head size");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(offset >= 0 && keys == offset + tokens, "expected ", offset + tokens, " keys (offset ", offset, " + ",
              tokens, " queries), got ", keys);
  TORCH_CHECK(q.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "q, key and value need a contiguous head dimension");
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  const int64_t group = hq / hkv;
  const float fscale = static_cast<float>(scale);
  at::Tensor out = at::empty({tokens, hq, d}, q.options());
  if (tokens == 0) return out;
  // [Hkv, T * G, D]: each KV head's query rows, token by token, its G heads together.
  const at::Tensor rows = q.reshape({tokens, hkv, group, d}).transpose(0, 1).contiguous().view({hkv, tokens * group, d});
  float* op = out.data_ptr<float>();
  // Work items (KV head, token block), each on one thread with a single-threaded sgemm: at these
  // sizes MKL's own threads spent a sixth of the time waiting. A block costs in proportion to the
  // keys it sees, so items go in pairs of a late and an early block, and each thread's contiguous
  // share of them holds about as much work.
  const int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock, items = hkv * blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> inv(kTokenBlock * group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, i = item % blocks;
      const int64_t block = i % 2 == 0 ? blocks - 1 - i / 2 : i / 2;
      const int64_t t0 = block * kTokenBlock, bt = std::min(kTokenBlock, tokens - t0), m = bt * group;
      const int64_t width = offset + t0 + bt;  // the keys this block's last token sees
      const at::Tensor k_h = key.select(1, h), v_h = value.select(1, h);  // [Tk, D], rows Hkv * D apart
      at::Tensor s = at::mm(rows[h].narrow(0, t0 * group, m), k_h.narrow(0, 0, width).t());  // [m, width]
      float* sp = s.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r) inv[r] = softmax_row(sp + r * width, offset + t0 + r / group + 1, width, fscale);
      const at::Tensor o = at::mm(s, v_h.narrow(0, 0, width));  // [m, D]
      const float* o_p = o.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r) {
        float* dst = op + ((t0 + r / group) * hq + h * group + r % group) * d;
        const float* src = o_p + r * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = src[j] * inv[r];
      }
    }
  });
  return out;
}

}  // namespace pdserve_cpu

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor key, Tensor value, int offset, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("prefill_attention", &pdserve_cpu::prefill_attention); }
