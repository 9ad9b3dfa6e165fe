// Vector helpers shared by the CPU kernels: GCC/Clang vector types of eight floats, lowered to
// whatever -march=native offers (one AVX2 register, half an AVX-512 one), loads from float32 and
// bfloat16, a horizontal sum and a branch-free exp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace {

// Eight floats: one AVX2 register (two SSE ones, half an AVX-512 one); GCC and Clang lower these
// vector types to whatever -march=native offers.
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline v8 load8(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  v8 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}
// Stores, rounding to bfloat16 the way c10::BFloat16 does (to nearest, ties to even; NaN stays a
// quiet NaN), eight at a time: the scalar conversion branches on NaN per element and does not
// vectorise, which made a bfloat16 SiLU-mul of a 256-token prefill 15x slower than its float32 one.
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline void store8(c10::BFloat16* p, v8 v) {
  u32x8 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x8 nan = (u32x8)(v != v);
  const u32x8 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const u16x8 h = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), u16x8);
  std::memcpy(p, &h, sizeof h);
}

inline float hsum(v8 a) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

// exp(x) for x <= 0, eight at a time, to about 2e-7 relative: x = n ln2 + r with |r| <= ln2/2,
// exp(r) by its degree-6 Taylor polynomial, 2^n through the exponent bits. Branch-free.
inline v8 exp_nonpositive(v8 x) {
  x = x < -87.f ? v8{} - 87.f : x;
  const i32x8 n = __builtin_convertvector(x * 1.4426950408889634f - 0.5f, i32x8);  // round, as x <= 0
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * 0.693145751953125f) - nf * 1.4286067653302e-06f;
  v8 p = v8{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * (v8)((n + 127) << 23);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

}  // namespace
