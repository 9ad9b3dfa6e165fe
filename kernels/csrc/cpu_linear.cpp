// y = x W^T on the CPU against a weight packed once into panels of 24 output columns.
//
//   W [N, K]  ->  panels [P = ceil(N/24), K, 24]   (panel p holds columns 24p .. 24p+23, zero-padded)
//
// A panel streams from memory front to back, so a decode step (a few rows of x) reads every weight
// once at the machine's bandwidth. A register tile of up to 4 rows of x by the panel's 24 columns
// keeps 12 vector accumulators: each loaded weight vector is reused by 4 rows, each broadcast x
// value by 3 vectors, and 12 independent FMA chains hide the FMA latency. The k loop is unrolled
// 8 times. Rows of x go in blocks of 48, which stay in L2 while every panel passes by. On AVX2
// this beats oneDNN's packed matmul from 1 row to 256 (python -m pdserve.bench.engine_overhead
// against --cpu-linear onednn; docs/cpu_kernels.md "Projections", "Panels (float32 on AVX2)").
// float32 and bfloat16; bfloat16 is widened to float32 and accumulated there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPanel = pdserve_cpu::kPanelColumns;
constexpr int kVectors = kPanel / 8;
constexpr int kMaxRows = 4;
constexpr int64_t kRowBlock = pdserve_cpu::kPanelRowBlock;

// While a thread multiplies panel p it prefetches panel p + 1, spread evenly over every row tile's
// pass. A panel makes one pass per 4 rows, all but the first from cache; a prefetch only ahead in
// the panel being read left the memory idle during the later passes, so a step took the stream's
// time plus the compute's instead of the larger of them. It pays at 8 to 32 rows; at 256, bound
// by compute, it changes nothing (engine_overhead's matmuls column; docs/cpu_kernels.md "Panels").
//
// Rows 0 .. MR-1 of x times one panel: y[m, 0..ncols) for each of those rows. Each step of k
// prefetches `stride` bytes from `ahead` on (two lines when that is more than one, so that no
// line is skipped). Never inlined: inlined into linear_silu_mul's loop, GCC spills an accumulator
// to the stack on every step of k.
template <int MR, typename T>
__attribute__((noinline)) void tile(const T* x, int64_t ldx, const T* panel, int64_t k_size, T* y, int64_t ldy,
                                    int64_t ncols, const char* ahead, int64_t stride) {
  v8 acc[MR][kVectors];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = v8{};
#pragma GCC unroll 8
  for (int64_t k = 0; k < k_size; ++k) {
    v8 w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = load8(panel + k * kPanel + 8 * v);
    const char* line = ahead + k * stride;
    __builtin_prefetch(line);
    if (stride > 64) __builtin_prefetch(line + stride / 2);
    for (int m = 0; m < MR; ++m) {
      const float a = to_float(x[m * ldx + k]);
      for (int v = 0; v < kVectors; ++v) acc[m][v] += a * w[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    T* out = y + m * ldy;
    if (ncols == kPanel) {
      for (int v = 0; v < kVectors; ++v) store8(out + 8 * v, acc[m][v]);
      continue;
    }
    float row[kPanel];  // the last, zero-padded panel
    for (int v = 0; v < kVectors; ++v) store8(row + 8 * v, acc[m][v]);
    for (int64_t j = 0; j < ncols; ++j) out[j] = from_float<T>(row[j]);
  }
}

// Rows in tiles of at most 4, as even as possible (7 rows go as 4 + 3, not 4 + 2 + 1): a tile of
// few rows has too few accumulators to hide the FMA latency. `next` is the panel to prefetch
// (the one after this, or this one again at the end of a thread's share): tile i of the n tiles
// prefetches its i-th n-th.
template <typename T>
inline void rows_by_panel(const T* x, int64_t ldx, int64_t rows, const T* panel, int64_t k_size, T* y, int64_t ldy,
                          int64_t ncols, const T* next) {
  const int64_t tiles = std::max<int64_t>(1, (rows + kMaxRows - 1) / kMaxRows);
  const int64_t base = rows / tiles, wider = rows % tiles;
  // A panel row of k is kPanel elements; each tile prefetches its share of every row of `next`.
  const int64_t stride = (kPanel * static_cast<int64_t>(sizeof(T)) + tiles - 1) / tiles;
  int64_t m = 0;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t mr = base + (i < wider ? 1 : 0);
    const T* xr = x + m * ldx;
    T* yr = y + m * ldy;
    const char* ahead = reinterpret_cast<const char*>(next) + i * stride * k_size;
    switch (mr) {
      case 1: tile<1>(xr, ldx, panel, k_size, yr, ldy, ncols, ahead, stride); break;
      case 2: tile<2>(xr, ldx, panel, k_size, yr, ldy, ncols, ahead, stride); break;
      case 3: tile<3>(xr, ldx, panel, k_size, yr, ldy, ncols, ahead, stride); break;
      default: tile<4>(xr, ldx, panel, k_size, yr, ldy, ncols, ahead, stride); break;
    }
    m += mr;
  }
}

template <typename T>
void linear_kernel(const at::Tensor& x, const at::Tensor& panels, int64_t n, at::Tensor& y) {
  const int64_t rows = x.size(0), k_size = x.size(1), ldx = x.stride(0), num_panels = panels.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = panels.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t m_rows = std::min(kRowBlock, rows - m0);
    at::parallel_for(0, num_panels, 4, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const T* panel = wp + p * k_size * kPanel;
        const T* next = p + 1 < end ? panel + k_size * kPanel : panel;
        const int64_t ncols = std::min(kPanel, n - p * kPanel);
        rows_by_panel(xp + m0 * ldx, ldx, m_rows, panel, k_size, yp + m0 * n + p * kPanel, n, ncols, next);
      }
    });
  }
}

// silu(x Wg^T) * (x Wu^T) against the panels of W = [Wg; Wu] (a gate/up projection whose halves
// are whole panels, intermediate % 24 == 0): gate panel j and up panel j + half go one after the
// other into two L1 scratch tiles, and their SiLU-mul is written straight to y [M, intermediate].
// The separate op reads and writes the [M, 2 intermediate] product once more (engine_overhead,
// prefill 256 and decode batch 32; docs/cpu_kernels.md "Panels").
template <typename T>
void linear_silu_mul_kernel(const at::Tensor& x, const at::Tensor& panels, int64_t intermediate, at::Tensor& y) {
  const int64_t rows = x.size(0), k_size = x.size(1), ldx = x.stride(0), half = intermediate / kPanel;
  const int64_t panel_size = k_size * kPanel;
  const T* xp = x.data_ptr<T>();
  const T* wp = panels.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t m_rows = std::min(kRowBlock, rows - m0);
    at::parallel_for(0, half, 2, [&](int64_t begin, int64_t end) {
      T gate[kRowBlock * kPanel], up[kRowBlock * kPanel];
      for (int64_t j = begin; j < end; ++j) {
        const T* gp = wp + j * panel_size;
        const T* upp = wp + (j + half) * panel_size;
        const T* next = j + 1 < end ? gp + panel_size : upp;
        rows_by_panel(xp + m0 * ldx, ldx, m_rows, gp, k_size, gate, kPanel, kPanel, upp);
        rows_by_panel(xp + m0 * ldx, ldx, m_rows, upp, k_size, up, kPanel, kPanel, next);
        for (int64_t m = 0; m < m_rows; ++m)
          silu_mul_row(gate + m * kPanel, up + m * kPanel, yp + (m0 + m) * intermediate + j * kPanel, kPanel);
      }
    });
  }
}

// The checks and the dtype dispatch both panel ops share: y [M, columns] from kernel<T>(x, y), x
// with contiguous features.
template <typename Kernel>
at::Tensor run_on_panels(const char* op, const at::Tensor& x, const at::Tensor& panels, int64_t columns,
                         const Kernel& kernel) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "pdserve_cpu.", op, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [P, K, ", kPanel, "] (kernels/cpu_linear.py pack_weight)");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "x and the weight must share a dtype");
  TORCH_CHECK(x.size(1) == panels.size(1), "x has ", x.size(1), " features, the weight takes ", panels.size(1));
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty({x.size(0), columns}, x.options());
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    kernel(static_cast<float*>(nullptr), xc, y);
  } else if (x.scalar_type() == at::kBFloat16) {
    kernel(static_cast<c10::BFloat16*>(nullptr), xc, y);
  } else {
    TORCH_CHECK(false, "pdserve_cpu.", op, " supports float32 and bfloat16, not ", x.scalar_type());
  }
  return y;
}

}  // namespace

namespace pdserve_cpu {

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(panels.dim() != 3 || (out_features > (panels.size(0) - 1) * kPanel && out_features <= panels.size(0) * kPanel),
              "out_features ", out_features, " does not fit ", panels.size(0), " panels");
  return run_on_panels("linear", x, panels, out_features, [&](auto type, const at::Tensor& xc, at::Tensor& y) {
    linear_kernel<std::remove_pointer_t<decltype(type)>>(xc, panels, out_features, y);
  });
}

void panel_product(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t panel_stride, int64_t k_size,
                   int64_t n, float* y, int64_t ldy) {
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
    const int64_t m_rows = std::min(kRowBlock, rows - m0);
    for (int64_t p = 0; p < num_panels; ++p) {
      const float* panel = panels + p * panel_stride;
      const float* next = p + 1 < num_panels ? panel + panel_stride : panel;
      rows_by_panel(x + m0 * ldx, ldx, m_rows, panel, k_size, y + m0 * ldy + p * kPanel, ldy,
                    std::min(kPanel, n - p * kPanel), next);
    }
  }
}

at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t intermediate) {
  TORCH_CHECK(intermediate > 0 && intermediate % kPanel == 0 && panels.dim() == 3 && panels.size(0) * kPanel == 2 * intermediate,
              "linear_silu_mul needs a gate/up weight of 2 x ", intermediate, " columns in whole panels of ", kPanel,
              ", got ", panels.sizes());
  return run_on_panels("linear_silu_mul", x, panels, intermediate, [&](auto type, const at::Tensor& xc, at::Tensor& y) {
    linear_silu_mul_kernel<std::remove_pointer_t<decltype(type)>>(xc, panels, intermediate, y);
  });
}

at::Tensor project_silu_mul(const at::Tensor& x, const at::Tensor& weight, int64_t intermediate,
                           const PrefetchRange& background) {
  if (tile_fuses_silu_mul(weight, intermediate)) return tile_linear_silu_mul(x, weight, intermediate, background);
  if (weight.dim() == 3 && weight.size(2) == kPanel && intermediate % kPanel == 0)
    return linear_silu_mul(x, weight, intermediate);
  return silu_mul(project(x, weight, 2 * intermediate));
}

at::Tensor project(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                   const PrefetchRange& background) {
  if (weight.dim() == 3) return linear(x, weight, out_features);
  if (weight.dim() == 5) return tile_linear(x, weight, out_features, background);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == out_features, "a oneDNN-packed weight must be [", out_features,
              ", K], got ", weight.sizes());
  return onednn_linear(x, weight);
}

namespace {

// oneDNN's packed matmul (mkldnn::_linear_pointwise, what a Linear with a oneDNN copy calls); on
// a CPU with AMX or AVX512-BF16 its bfloat16 kernels use those units.
at::Tensor onednn_call(const at::Tensor& x, const at::Tensor& weight) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// Rows per thread for which each thread runs its own block of rows (see onednn_linear).
constexpr int64_t kSplitMinRows = 192, kSplitMaxRows = 640;

}  // namespace

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "pdserve_cpu.onednn_linear runs on CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), "x [..., ", weight.size(1),
              "] against a oneDNN-packed weight [N, K], got x ", x.sizes(), " and weight ", weight.sizes());
  const int64_t m = x.numel() / x.size(-1), threads = at::get_num_threads();
  // Each thread multiplies its own block of rows in one single-threaded oneDNN call (inside the
  // parallel region oneDNN does not split again). On AMX this beats oneDNN's own split of
  // bfloat16 projections between kSplitMinRows and kSplitMaxRows rows a thread, and loses outside
  // that range (engine_overhead, prefill 1,024; docs/cpu_kernels.md "Tiles"). Only on AMX, the one
  // machine kind it is benchmarked on: elsewhere oneDNN decides.
  const bool split = threads >= 2 && m >= threads * kSplitMinRows && m <= threads * kSplitMaxRows &&
                     !at::in_parallel_region() && tile_linear_uses_amx();
  if (!split) return onednn_call(x, weight);
  const at::Tensor xc = x.reshape({m, x.size(-1)}).contiguous();
  at::Tensor y = at::empty({m, weight.size(0)}, x.options());
  const int64_t per = (m + threads - 1) / threads;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the pool's threads take the caller's
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const c10::InferenceMode mode(inference);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * per, n = std::min(m, r0 + per) - r0;
      if (n > 0) y.narrow(0, r0, n).copy_(onednn_call(xc.narrow(0, r0, n), weight));
    }
  });
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = weight.size(0);
  return y.view(out_shape);
}

}  // namespace pdserve_cpu
