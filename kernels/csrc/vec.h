// Vector helpers shared by the CPU kernels: GCC/Clang vector types of eight and sixteen floats,
// lowered to whatever the build's instruction set offers (kernels/variants.py), loads from float32
// and bfloat16, stores that round to bfloat16, a horizontal sum and a branch-free exp.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Eight floats: one AVX2 register (two SSE ones, half an AVX-512 one); GCC and Clang lower these
// vector types to whatever the build's instruction set offers.
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// bfloat16 is the top half of a float32: widening is a shift; narrowing rounds the way
// c10::BFloat16 does (to nearest, ties to even; NaN stays a quiet NaN), a vector at a time. The
// scalar conversion branches on NaN per element and does not vectorise, which makes a bfloat16
// SiLU-mul many times slower than its float32 one. V is a float vector, U16 and U32 the
// unsigned vectors of as many lanes.
template <typename V, typename U16, typename U32>
inline V widen_bf16(const c10::BFloat16* p) {
  U16 h;
  std::memcpy(&h, p, sizeof h);
  const U32 w = __builtin_convertvector(h, U32) << 16;
  V r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}
template <typename V, typename U16, typename U32>
inline void narrow_bf16(c10::BFloat16* p, V v) {
  U32 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const U32 nan = (U32)(v != v);
  const U32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const U16 h = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), U16);
  std::memcpy(p, &h, sizeof h);
}

template <typename V>
inline V load_floats(const float* p) {
  V r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
// The sum of a vector's lanes.
template <typename V>
inline float hsum(V a) {
  float s = 0.f;
  for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(float)); ++i) s += a[i];
  return s;
}

inline v8 load8(const float* p) { return load_floats<v8>(p); }
inline v8 load8(const c10::BFloat16* p) { return widen_bf16<v8, u16x8, u32x8>(p); }
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
inline void store8(c10::BFloat16* p, v8 v) {  // see store16
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh((__m256)v));
}
#else
inline void store8(c10::BFloat16* p, v8 v) { narrow_bf16<v8, u16x8, u32x8>(p, v); }
#endif

typedef int32_t i32x8 __attribute__((vector_size(32)));

// Taylor coefficients, lowest first: exp(r) to degree 6, and 2^f = exp(f ln2) to degree 4.
constexpr float kExpTaylor[] = {1.f, 1.f, 0.5f, 1.f / 6.f, 1.f / 24.f, 1.f / 120.f, 1.f / 720.f};
constexpr float kExp2Taylor[] = {1.f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                 0.009618129107628477f};

// c[0] + x (c[1] + x (c[2] + ...)) by Horner's rule, a vector at a time.
template <typename V, size_t N>
inline V horner(V x, const float (&c)[N]) {
  V p = V{} + c[N - 1];
  for (size_t i = N - 1; i-- > 0;) p = p * x + c[i];
  return p;
}

// exp(x) for x <= 0, a vector at a time, to about 2e-7 relative: x = n ln2 + r with |r| <= ln2/2,
// exp(r) by its degree-6 Taylor polynomial, 2^n through the exponent bits. Branch-free.
template <typename V, typename IV>
inline V exp_nonpositive_t(V x) {
  x = x < -87.f ? V{} - 87.f : x;
  const IV n = __builtin_convertvector(x * 1.4426950408889634f - 0.5f, IV);  // round, as x <= 0
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693145751953125f) - nf * 1.4286067653302e-06f;
  return horner(r, kExpTaylor) * (V)((n + 127) << 23);
}
inline v8 exp_nonpositive(v8 x) { return exp_nonpositive_t<v8, i32x8>(x); }

// Sixteen floats: one AVX-512 register, two AVX2 ones (vf below, on AVX-512).
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
// Horner's rule with one fused multiply-add a coefficient.
template <size_t N>
inline __m512 horner512(__m512 x, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[N - 1]);
  for (size_t i = N - 1; i-- > 0;) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c[i]));
  return p;
}

// The same reduction and polynomial in AVX-512's own instructions: the clamp is one max, n is
// rounded in place (vrndscaleps) and 2^n applied by vscalefps, where the generic form needs a
// compare and blend, two conversions and the exponent-bit arithmetic; the softmaxes of prefill
// attention spend most of their time here.
inline v16 exp_nonpositive(v16 x) {
  const __m512 xc = _mm512_max_ps((__m512)x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286067653302e-06f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc));
  return (v16)_mm512_scalef_ps(horner512(r, kExpTaylor), n);
}
#else
inline v16 exp_nonpositive(v16 x) { return exp_nonpositive_t<v16, i32x16>(x); }
#endif

// 2^t for t <= 0 (a little above 0 is fine) to about 6e-5 relative, for results rounded to
// bfloat16 (whose rounding step is 4e-3): t = n + f with |f| <= 1/2, 2^f = exp(f ln2) by its
// degree-4 Taylor polynomial. A caller folds its scale and log2(e) into one multiply-add, so this
// is 9 operations a vector against exp_nonpositive's 13 (the prefill softmax's probabilities).
template <typename V, typename IV>
inline V exp2_coarse_t(V t) {
  t = t < -126.f ? V{} - 126.f : t;
  const IV n = __builtin_convertvector(t - 0.5f, IV);  // round (toward zero of t - 1/2: t <= ~0)
  const V f = t - __builtin_convertvector(n, V);
  return horner(f, kExp2Taylor) * (V)((n + 127) << 23);
}
inline v8 exp2_coarse(v8 t) { return exp2_coarse_t<v8, i32x8>(t); }
#if defined(__AVX512F__)
inline v16 exp2_coarse(v16 t) {
  const __m512 tc = _mm512_max_ps((__m512)t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (v16)_mm512_scalef_ps(horner512(_mm512_sub_ps(tc, n), kExp2Taylor), n);
}
#else
inline v16 exp2_coarse(v16 t) { return exp2_coarse_t<v16, i32x16>(t); }
#endif

inline v16 load16(const float* p) { return load_floats<v16>(p); }
#if defined(__AVX512F__)
// One VPMOVZXWD and a shift: GCC splits the generic 16-lane widening into two 8-lane halves and
// joins them (five instructions).
inline v16 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
#else
inline v16 load16(const c10::BFloat16* p) { return widen_bf16<v16, u16x16, u32x16>(p); }
#endif
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
#if defined(__AVX512BF16__)
// With AVX512-BF16 the rounding is one instruction (VCVTNEPS2BF16: to nearest, ties to even, as
// narrow_bf16) where the generic form takes about eight. It differs only where no activation
// goes: a NaN keeps its own payload (quieted) instead of becoming 0x7FC0, and float32 denormals
// (below 1.2e-38) become zero.
inline void store16(c10::BFloat16* p, v16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
inline void store16(c10::BFloat16* p, v16 v) { narrow_bf16<v16, u16x16, u32x16>(p, v); }
#endif

// The widest float vector the CPU computes natively, for the elementwise loops and the softmax:
// sixteen floats on AVX-512, eight elsewhere. A 64-byte GCC vector on an AVX2 CPU is lowered
// piece by piece, and its selects, maxima and float-to-int conversions go lane by lane through
// the stack, which makes SiLU-mul and the softmax far slower than at the native width
// (python -m pdserve.bench.engine_overhead --dtype float32, prefill 256, on AVX2;
// docs/cpu_kernels.md "Elementwise ops and the decoder layers in one call").
#if defined(__AVX512F__)
typedef v16 vf;
template <typename T> inline vf loadf(const T* p) { return load16(p); }
template <typename T> inline void storef(T* p, vf v) { store16(p, v); }
#else
typedef v8 vf;
template <typename T> inline vf loadf(const T* p) { return load8(p); }
template <typename T> inline void storef(T* p, vf v) { store8(p, v); }
#endif
constexpr int64_t kVf = sizeof(vf) / sizeof(float);

// Whether any lane of a vf comparison (all ones where true) is true: one mask test.
template <typename M>
inline bool any_lane(M m) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps((__m256)m) != 0;
#else
  for (int64_t l = 0; l < kVf; ++l) if (m[l]) return true;
  return false;
#endif
}

// 1 / x. A 512-bit division issues once every ~10 cycles, which bounded the SiLU-mul; AVX-512's
// 14-bit reciprocal estimate refined by one Newton step is within about 1e-8 relative.
inline vf reciprocal(vf x) {
#if defined(__AVX512F__)
  const vf r = (vf)_mm512_rcp14_ps((__m512)x);
  return r * (2.f - x * r);
#else
  return 1.f / x;
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// The largest of x[0, n), a vector at a time; NaNs are passed over (-inf for an empty or all-NaN row).
// Four running maxima over long rows, so each comparison does not wait on the one before: one
// chain of vmaxps was a hot spot of the bfloat16 prefill softmax (cpu_prefill_tiles.cpp).
template <typename T>
inline float row_max(const T* x, int64_t n) {
  const auto larger = [](vf a, vf b) { return a > b ? a : b; };  // b where a is NaN: NaNs pass over
  vf vmax = vf{} - INFINITY, m1 = vmax, m2 = vmax, m3 = vmax;
  int64_t i = 0;
  for (; i + 4 * kVf <= n; i += 4 * kVf) {
    vmax = larger(loadf(x + i), vmax);
    m1 = larger(loadf(x + i + kVf), m1);
    m2 = larger(loadf(x + i + 2 * kVf), m2);
    m3 = larger(loadf(x + i + 3 * kVf), m3);
  }
  vmax = larger(larger(m1, vmax), larger(m3, m2));
  for (; i + kVf <= n; i += kVf) vmax = larger(loadf(x + i), vmax);
  float m = -INFINITY;
  for (int64_t l = 0; l < kVf; ++l) m = std::max(m, vmax[l]);
  for (; i < n; ++i) m = std::max(m, to_float(x[i]));
  return m;
}

// The first i in [0, n) where hit(x[i]), else n: `hit` takes a vf (a lane mask back) and a float.
template <typename T, typename Hit>
inline int64_t find_first(const T* x, int64_t n, Hit hit) {
  int64_t i = 0;
  while (i + kVf <= n && !any_lane(hit(loadf(x + i)))) i += kVf;
  for (; i < n; ++i)
    if (hit(to_float(x[i]))) return i;
  return n;
}

// In place: s[i] = exp(scale (s[i] - m)) for i < n, a native vector at a time (s[i] <= m and
// scale > 0, so every exponent is at most 0); returns their sum. The softmaxes of decode and
// prefill attention.
inline float exp_shifted_sum(float* __restrict s, int64_t n, float m, float scale) {
  vf vsum = {};
  int64_t i = 0;
  for (; i + kVf <= n; i += kVf) {
    const vf e = exp_nonpositive((loadf(s + i) - m) * scale);
    storef(s + i, e);
    vsum += e;
  }
  float sum = hsum(vsum);
  for (; i < n; ++i) {  // the tail, through one padded vector
    v8 x = v8{} - 100.f;
    x[0] = (s[i] - m) * scale;
    s[i] = exp_nonpositive(x)[0];
    sum += s[i];
  }
  return sum;
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// o[i] = silu(g[i]) * u[i] for i < n, a native vector at a time: SiLU-mul's row, shared by the
// elementwise op and the gate/up projection that applies it on the way out (cpu_linear.cpp).
// The tail goes through one zero-padded vector, so every element is computed the same way
// wherever a row ends: the gate/up projection applies this to rows of 24 (16 + a tail of 8 on
// AVX-512) and must match the op, which takes whole rows of the intermediate size, to the bit.
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  const auto silu_mul = [](vf a, vf b) {
    // exp(-|a|): never overflows. In bfloat16, 2^(-|a| log2 e) to exp2_coarse's 6e-5.
    const vf neg = a < 0.f ? a : -a;
    const vf e = std::is_same_v<T, c10::BFloat16> ? exp2_coarse(neg * 1.4426950408889634f) : exp_nonpositive(neg);
    const vf sig = (a < 0.f ? e : vf{} + 1.f) * reciprocal(1.f + e);
    return a * sig * b;
  };
  int64_t i = 0;
  for (; i + kVf <= n; i += kVf) storef(o + i, silu_mul(loadf(g + i), loadf(u + i)));
  if (i < n) {
    T gt[kVf] = {}, ut[kVf] = {}, ot[kVf];
    std::copy(g + i, g + n, gt);
    std::copy(u + i, u + n, ut);
    storef(ot, silu_mul(loadf(gt), loadf(ut)));
    std::copy(ot, ot + (n - i), o + i);
  }
}

}  // namespace
