// The elementwise work around the projections, fused: RMSNorm, SiLU(gate) * up, GELU-tanh(gate) *
// up (GeGLU), and rotary embedding applied in place. Each is one pass over its rows (parallel over
// rows) instead of the 4-10 eager ops and temporaries of model/llama.py's PyTorch code, which
// stays their oracle. float32 and bfloat16; everything is computed in float32 and rounded once on
// the way out (GeGLU twice, as torch's two ops round it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }

// Rows of at most this many elements go to one task together (cheap rows are batched).
constexpr int64_t kGrain = 1 << 14;

inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)); }

// o = w * (row * rsqrt(mean(row^2) + eps)) for one row of h, a vector at a time and a tail.
template <typename T>
inline void norm_row(const T* row, const T* wp, int64_t h, double eps, T* o) {
  const int64_t hv = h - h % kVf;  // the part done a vector at a time
  vf vss = {};
  for (int64_t i = 0; i < hv; i += kVf) {
    const vf a = loadf(row + i);
    vss += a * a;
  }
  float ss = hsum(vss);
  for (int64_t i = hv; i < h; ++i) ss += load(row, i) * load(row, i);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
  for (int64_t i = 0; i < hv; i += kVf) storef(o + i, loadf(wp + i) * (loadf(row + i) * inv));
  for (int64_t i = hv; i < h; ++i) store(o, i, load(wp, i) * (load(row, i) * inv));
}

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), h = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, h, eps, op + r * h);
  });
}

// x += y in place, rounded to x's dtype as torch's add rounds it, then out = rms_norm(x): the
// residual add and the norm after it in one pass over each row (the row is still in L1 when the
// norm reads it back), the same numbers as `x + y` followed by rms_norm.
template <typename T>
void add_rms_norm_kernel(at::Tensor& x, const at::Tensor& y, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), h = x.size(1), xs = x.stride(0), ys = y.stride(0);
  T* xp = x.data_ptr<T>();
  const T* yp = y.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t hv = h - h % kVf;
  at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xp + r * xs;
      const T* add = yp + r * ys;
      for (int64_t i = 0; i < hv; i += kVf) storef(row + i, loadf(row + i) + loadf(add + i));
      for (int64_t i = hv; i < h; ++i) store(row, i, load(row, i) + load(add, i));
      norm_row(row, wp, h, eps, op + r * h);  // reads back the rounded sums, as rms_norm(x + y) does
    }
  });
}

template <typename T>
void silu_mul_kernel(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * gs, gp + r * gs + inter, op + r * inter, inter);
  });
}

// x rounded to T's precision and widened back: torch rounds each op's result to the tensor's dtype.
template <typename T>
inline vf round_to(vf x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[kVf];
    storef(tmp, x);
    return loadf(tmp);
  }
}

// o[i] = gelu_tanh(g[i]) * u[i] for i < n, as torch's F.gelu(g, approximate="tanh") * u computes
// it: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) in float32 in torch's order of operations,
// rounded to T (the gelu op's output), then the product, rounded again. tanh(|z|) = 1 - d with
// d = 2e / (1 + e), e = exp(-2|z|) (never overflows), d accurate to float32 and rounded once in
// 1 - d: tanh rounded to the float32 grid as torch's (Sleef's) is, which matters where z < 0 and
// 1 + tanh(z) cancels to a few of that grid's steps (gelu of -3 to -5). The tail goes through one
// zero-padded vector, as silu_mul_row's does.
template <typename T>
inline void gelu_tanh_mul_row(const T* g, const T* u, T* o, int64_t n) {
  const auto gelu_mul = [](vf a, vf b) {
    const vf inner = 0.7978845608028654f * (a + 0.044715f * (a * a * a));
    const vf mag = inner < 0.f ? vf{} - inner : inner;
    const vf e = exp_nonpositive(-2.f * mag);
    const vf t = 1.f - 2.f * e * reciprocal(1.f + e);
    const vf gelu = 0.5f * a * (1.f + (inner < 0.f ? vf{} - t : t));
    return round_to<T>(gelu) * b;
  };
  int64_t i = 0;
  for (; i + kVf <= n; i += kVf) storef(o + i, gelu_mul(loadf(g + i), loadf(u + i)));
  if (i < n) {
    T gt[kVf] = {}, ut[kVf] = {}, ot[kVf];
    std::copy(g + i, g + n, gt);
    std::copy(u + i, u + n, ut);
    storef(ot, gelu_mul(loadf(gt), loadf(ut)));
    std::copy(ot, ot + (n - i), o + i);
  }
}

// `group` 0: each row is the gate's I columns, then the up's. `group` > 0: groups of that many
// gate columns and up columns alternate (a gate/up projection through paired tiles,
// cpu_linear.pack_gate_up_tiles), and the output is in the gate's order all the same.
template <typename T>
void gelu_tanh_mul_kernel(const at::Tensor& gate_up, int64_t group, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = gp + r * gs;
      if (group == 0) {
        gelu_tanh_mul_row(row, row + inter, op + r * inter, inter);
        continue;
      }
      for (int64_t c = 0; c < inter; c += group)
        gelu_tanh_mul_row(row + 2 * c, row + 2 * c + group, op + r * inter + c, group);
    }
  });
}

// x [T, H, D] rows strided, heads and dims contiguous: rotate-half with cos/sin [P, D/2] float32.
template <typename T>
void rotary_kernel(at::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t table_stride) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t xs = x.stride(0), hs = x.stride(1);
  const int64_t hv = half - half % kVf;
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, tokens, row_grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * table_stride;
      const float* s = sin + pos[t] * table_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * xs + h * hs;
        for (int64_t i = 0; i < hv; i += kVf) {
          const vf x1 = loadf(v + i), x2 = loadf(v + i + half), cv = loadf(c + i), sv = loadf(s + i);
          storef(v + i, x1 * cv - x2 * sv);
          storef(v + i + half, x2 * cv + x1 * sv);
        }
        for (int64_t i = hv; i < half; ++i) {
          const float x1 = load(v, i), x2 = load(v, i + half);
          store(v, i, x1 * c[i] - x2 * s[i]);
          store(v, i + half, x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, not ", t.scalar_type());
}

// The index of a row's first maximum, as torch's max(dim=-1).indices: the first NaN where the row
// holds one (NaN counts as greater than everything there), else the first element equal to the
// row's maximum; an all -inf row gives 0. Vector passes over a row that stays in cache: torch's own
// max over dim costs a decode step at batch 32 more than a layer's work (python -m
// pdserve.bench.engine_overhead, decode batch 32; docs/cpu_kernels.md "Elementwise ops and the
// decoder layers in one call").
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  const int64_t nan = find_first(row, n, [](auto v) { return v != v; });
  if (nan < n) return nan;
  const float best = row_max(row, n);
  return find_first(row, n, [best](auto v) { return v == best; });
}

template <typename T>
void argmax_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, n);
  });
}

}  // namespace

namespace pdserve_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "weight must be a contiguous [H] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_kernel<float>(x, weight, eps, out);
  else rms_norm_kernel<c10::BFloat16>(x, weight, eps, out);
  return out;
}

at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& y, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && y.sizes() == x.sizes() && y.stride(1) == 1,
              "y must be x's [T, H] and dtype with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(),
              "weight must be a contiguous [H] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) add_rms_norm_kernel<float>(x, y, weight, eps, out);
  else add_rms_norm_kernel<c10::BFloat16>(x, y, weight, eps, out);
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_kernel<float>(gate_up, out);
  else silu_mul_kernel<c10::BFloat16>(gate_up, out);
  return out;
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, int64_t pair_group) {
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  TORCH_CHECK(pair_group >= 0 && (pair_group == 0 || (gate_up.size(1) / 2) % pair_group == 0),
              "pair_group must be 0 or divide the intermediate size ", gate_up.size(1) / 2, ", got ", pair_group);
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) gelu_tanh_mul_kernel<float>(gate_up, pair_group, out);
  else gelu_tanh_mul_kernel<c10::BFloat16>(gate_up, pair_group, out);
  return out;
}

// In place on q [T, Hq, D] and k [T, Hkv, D]; positions [T] int64 index the tables' rows.
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "q [T, Hq, D] and k [T, Hkv, D] with an even D");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == q.size(2) / 2 && cos.stride(1) == 1 &&
                  cos.strides() == sin.strides(),
              "cos/sin must be float32 [P, D/2] tables with the same layout");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == q.size(0),
              "positions must be int64 [T]");
  at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.size(0); ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " is outside the rotary table (", cos.size(0), ")");
  if (q.scalar_type() == at::kFloat) {
    rotary_kernel<float>(q, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
    rotary_kernel<float>(k, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  } else {
    rotary_kernel<c10::BFloat16>(q, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
    rotary_kernel<c10::BFloat16>(k, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  }
}

// [R, N] float32 or bfloat16 rows (contiguous along N) -> int64 [R]: max(dim=-1).indices.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "x must be [R, N] with N > 0 and contiguous rows");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) argmax_kernel<float>(x, out);
  else argmax_kernel<c10::BFloat16>(x, out);
  return out;
}

}  // namespace pdserve_cpu
