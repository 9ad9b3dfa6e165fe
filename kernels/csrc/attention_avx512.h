// The two inner loops of paged decode attention (cpu_attention.cpp) in 512-bit vectors, for CPUs
// with AVX-512; the 8-wide loops stay the path elsewhere and for head sizes these do not take.
//
// Scores. The 8-wide loop summed each (position, head) dot product horizontally, about as many
// instructions as the multiplies themselves. Here 16 positions are scored together: each
// position's products stay a 16-lane partial vector, and one transpose-and-add tree (45
// shuffles and adds) turns the 16 partial vectors into one vector of 16 scores. With bfloat16
// and AVX512-BF16 the products are `vdpbf16ps` (two bfloat16 products per lane, summed in
// float32): q and k are bfloat16 already, so the sum is exact up to float32 accumulation, and
// the scale is applied to the finished scores. For head sizes 64 and 128 (scores_pairs) each
// vector holds two positions' partial products, so the tree is half as long, and the query
// operands stay in registers.
//
// Weighted sum. For bfloat16 with AVX512-BF16 (weighted_sum_pairs), the probabilities are
// rounded to bfloat16 and two positions' values go into each `vdpbf16ps`. Otherwise each value
// row is widened once to float32 and accumulated into G heads x
// (d / 16) vector accumulators with 512-bit FMAs.
//
// Both walk the item's KV heads (one, or all of a sequence's) tile by tile: see below. The
// weighted sum, which reads values the scores pass brought into L2, prefetches the keys of the
// thread's next item meanwhile (`next`, spread evenly over its products), so that its scores pass
// does not start each item on DRAM. Prefetching the next item's values too gains nothing
// (python -m pdserve.bench.cpu_attention_bench --batch 8 and 32; docs/cpu_kernels.md "Decode
// attention", "Prefetch").

#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "amx.h"
#include "prefetch.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace avx512 {

constexpr int64_t kLanes = 16;

// r[j] = sum of the lanes of t[j], for j < 16. The tree leaves score j in lane 4 (j % 4) + j / 4,
// which the last permute puts back in order.
inline __m512 sum_lanes16(__m512* t) {
  __m512 u[8], v[4], w[2];
  for (int i = 0; i < 8; ++i)  // 128-bit blocks: [t2i 0+2, t2i 1+3, t2i+1 0+2, t2i+1 1+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // block k holds four partial sums of t[4i + k]
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: two partial sums of t[8i + k], then two of t[8i + 4 + k]
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
  // block k: t[k], t[k + 4], t[k + 8], t[k + 12]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// vec.h's loads, as __m512.
template <typename T>
inline __m512 load16(const T* p) { return (__m512)::load16(p); }

// One key row against the G query rows of KV head h's group, as G partial vectors (sum their lanes
// for the dot products). The float path multiplies float32 q (scaled) with the row widened to
// float32.
template <int G, typename T>
struct WideDot {
  const float* q;  // [heads * G, d] float32, already scaled
  int64_t d;
  inline void operator()(int64_t h, const T* k, __m512* out) const {
    const float* qh = q + h * G * d;
    for (int g = 0; g < G; ++g) out[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanes) {
      const __m512 x = load16(k + c);
      for (int g = 0; g < G; ++g) out[g] = _mm512_fmadd_ps(load16(qh + g * d + c), x, out[g]);
    }
  }
};

#if defined(__AVX512BF16__)
// bfloat16 q (unscaled) against a bfloat16 key row, 32 products per instruction. Needs d % 32 == 0.
template <int G>
struct Bf16Dot {
  const c10::BFloat16* q;  // [heads * G, d] bfloat16, unscaled
  int64_t d;
  inline void operator()(int64_t h, const c10::BFloat16* k, __m512* out) const {
    const c10::BFloat16* qh = q + h * G * d;
    for (int g = 0; g < G; ++g) out[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 2 * kLanes) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(k + c);
      for (int g = 0; g < G; ++g) out[g] = _mm512_dpbf16_ps(out[g], (__m512bh)_mm512_loadu_si512(qh + g * d + c), x);
    }
  }
};
#endif

// Both loops go a tile of 16 positions at a time, and within a tile over each of the item's KV
// heads. A slot holds every head's row side by side, so a tile reads whole slots (3 KB for 3
// heads of 64 bfloat16 keys) while the next tile's slots are prefetched: one sequential-looking
// stream instead of one strided pass per head, which reads the cache from DRAM far below what a
// plain sum over memory reaches. The scores pass also prefetches the same slots' values into L2,
// for the weighted sum that follows, rather than in a pass of their own. The vector loop
// (`scores`) prefetches keys and values into L2 only, a few lines before each of the tile's
// products: a burst of the keys' lines into L1 per slot fills the core's miss buffers and stalls
// the loop on its own prefetches (cpu_attention_bench, bfloat16 and float32; docs/cpu_kernels.md
// "Decode attention", "Prefetch").
constexpr int64_t kAhead = kLanes;  // the next tile: further ahead gains nothing (cpu_attention_bench)
template <int Hint = _MM_HINT_T0>
inline void prefetch_bytes(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, static_cast<_mm_hint>(Hint));
}

// Two spans of memory (a tile's keys, then its values) prefetched into L2 from running pointers,
// a line every kSpanStride bytes. Not prefetch.h's PrefetchCursor, whose span bookkeeping per
// line costs more than two running pointers in a loop this short (cpu_attention_bench --batch 32).
constexpr int64_t kSpanStride = 64;
struct SpanPrefetch {
  const char *k = nullptr, *k_end = nullptr, *v = nullptr, *v_end = nullptr;
  static SpanPrefetch of(const char* k, const char* v, int64_t bytes) { return {k, k + bytes, v, v + bytes}; }
  inline void some(int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      if (k < k_end) {
        _mm_prefetch(k, _MM_HINT_T1);
        k += kSpanStride;
      } else if (v < v_end) {
        _mm_prefetch(v, _MM_HINT_T1);
        v += kSpanStride;
      } else {
        return;
      }
    }
  }
};

// Where the next tile's slots (from position `ahead`) are contiguous, a block holding all of its
// positions and the item reading whole slots of `slot_elems`, its keys and values are two spans
// from running pointers: returns true and sets `span` and `per`, the lines for each of the tile's
// `products` products. Else the kernels prefetch slot by slot, whose address arithmetic is a
// good part of the loop's time when the KV is in cache. Every line, not every second one: leaving
// the adjacent line to the hardware reads DRAM slower (cpu_attention_bench --batch 8 and 32;
// docs/cpu_kernels.md "Decode attention", "Prefetch").
template <typename T>
inline bool next_tile_spans(const T* kp, const T* vp, const int64_t* rows, int64_t ctx, int64_t ahead,
                            int64_t slot_elems, int64_t products, SpanPrefetch& span, int64_t& per) {
  const int64_t next_n = std::min(kLanes, ctx - ahead);
  if (next_n <= 0 || rows[ahead + next_n - 1] - rows[ahead] != (next_n - 1) * slot_elems) return false;
  const int64_t bytes = next_n * slot_elems * static_cast<int64_t>(sizeof(T));
  span = SpanPrefetch::of(reinterpret_cast<const char*>(kp + rows[ahead]), reinterpret_cast<const char*>(vp + rows[ahead]),
                          bytes);
  per = (2 * ((bytes + kSpanStride - 1) / kSpanStride) + products - 1) / products;
  return true;
}

// Where the next tile's slots are not contiguous: lines [from, to) of the run of slots from `slot`
// on, each slot its keys' `lines` lines then its values', prefetched into L2 (slots from ctx on
// skipped). A product of the tile prefetches its part of one slot (`scores`) or of two
// (`scores_pairs`).
template <typename T>
inline void prefetch_slot_lines(const T* kp, const T* vp, const int64_t* rows, int64_t ctx, int64_t slot,
                                int64_t lines, int64_t from, int64_t to) {
  for (int64_t l = from; l < to; ++l) {
    int64_t s = slot, at = l;
    for (; at >= 2 * lines; at -= 2 * lines) ++s;
    if (s >= ctx) return;
    const T* row = at < lines ? kp + rows[s] : vp + rows[s];
    _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * (at < lines ? at : at - lines), _MM_HINT_T1);
  }
}

// scores[(h G + g) ctx + pos] = scale * (q[h G + g] . k_h[pos]) for the item's `heads` KV heads;
// rows[pos] is the offset of the first head's row at pos, head h's row is rows[pos] + h d; vp is
// the value cache, only prefetched here. `prefetch` false leaves out the next tile's prefetches:
// where the previous item read the same slots (a prompt's rows, each attending as a decode under
// --deterministic), they are in L2 already and the prefetches are work for nothing (a 1,024-token
// prompt's rows: 6.7 ms a layer with them, 4.9 without, SmolLM2's shape in bfloat16 on Zen 4).
template <int G, typename T, typename Dot>
void scores(const Dot& dot, const T* kp, const T* vp, const int64_t* rows, int64_t ctx, int64_t heads, float scale,
            float* scores, bool prefetch = true) {
  const int64_t d = dot.d, slot_bytes = heads * d * static_cast<int64_t>(sizeof(T));
  // Each of the tile's heads * kLanes products prefetches `per` lines of one of the next tile's
  // slots (its keys' lines, then its values'): slot s's part p goes with product s * heads + p.
  const int64_t lines = (slot_bytes + 63) / 64, per = (2 * lines + heads - 1) / heads;
  __m512 partial[G][kLanes];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t pos0 = 0; pos0 < ctx; pos0 += kLanes) {
    const int64_t n = ctx - pos0 < kLanes ? ctx - pos0 : kLanes;
    int64_t ahead = pos0 + kAhead, part = 0;  // the slot and part the next product prefetches
    SpanPrefetch span;
    int64_t span_per = 0;
    const bool spans = prefetch && next_tile_spans(kp, vp, rows, ctx, ahead, heads * d, heads * n, span, span_per);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = 0; j < n; ++j) {
        if (spans) {
          span.some(span_per);
        } else if (prefetch) {
          prefetch_slot_lines(kp, vp, rows, ctx, ahead, lines, part * per, std::min(2 * lines, (part + 1) * per));
        }
        if (++part == heads) part = 0, ++ahead;
        __m512 out[G];
        dot(h, kp + rows[pos0 + j] + h * d, out);
        for (int g = 0; g < G; ++g) partial[g][j] = out[g];
      }
      for (int g = 0; g < G; ++g) {
        for (int64_t j = n; j < kLanes; ++j) partial[g][j] = _mm512_setzero_ps();
        const __m512 s = _mm512_mul_ps(sum_lanes16(partial[g]), vscale);
        _mm512_mask_storeu_ps(scores + (h * G + g) * ctx + pos0, static_cast<__mmask16>((1u << n) - 1u), s);
      }
    }
  }
}

// Lines of `next` for each of `products` products to spread it evenly over them.
inline int64_t lines_per(const pdserve_cpu::PrefetchCursor& next, int64_t products) {
  return products > 0 ? (next.left() + products - 1) / products : 0;
}

// out[(h G + g) d + c] = sum over pos of p[(h G + g) ctx + pos] * v_h[pos][c]. Within a tile the
// accumulators of NC 16-float chunks of a head's G queries stay in registers; they live in `out`
// between tiles. Needs d % (16 NC) == 0. Prefetches `next` meanwhile (see the top of this file).
template <int G, int NC, typename T>
void weighted_sum(const float* p, const T* vp, const int64_t* rows, int64_t ctx, int64_t d, int64_t heads, float* out,
                  pdserve_cpu::PrefetchCursor& next) {
  const int64_t per = lines_per(next, ctx * heads * (d / (kLanes * NC)));
  for (int64_t i = 0; i < heads * G * d; ++i) out[i] = 0.f;
  for (int64_t pos0 = 0; pos0 < ctx; pos0 += kLanes) {
    const int64_t n = ctx - pos0 < kLanes ? ctx - pos0 : kLanes;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < d; c += kLanes * NC) {
        __m512 acc[G][NC];
        for (int g = 0; g < G; ++g)
          for (int k = 0; k < NC; ++k) acc[g][k] = _mm512_loadu_ps(out + (h * G + g) * d + c + kLanes * k);
        for (int64_t j = 0; j < n; ++j) {
          next.some(per);
          const int64_t pos = pos0 + j;
          const T* vrow = vp + rows[pos] + h * d + c;
          __m512 x[NC];
          for (int k = 0; k < NC; ++k) x[k] = load16(vrow + kLanes * k);
          for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(p[(h * G + g) * ctx + pos]);
            for (int k = 0; k < NC; ++k) acc[g][k] = _mm512_fmadd_ps(w, x[k], acc[g][k]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int k = 0; k < NC; ++k) _mm512_storeu_ps(out + (h * G + g) * d + c + kLanes * k, acc[g][k]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// r[j] = sum of the 8 lanes of half j % 2 of t[j / 2], for j < 16: the tree of sum_lanes16 from
// its second level, three levels and 22 instructions for 16 scores instead of four and 46.
inline __m512 sum_halves8(const __m512* t) {
  __m512 u[4], v[2];
  for (int i = 0; i < 4; ++i)  // block k: four partial sums of position 4i + k
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: two partial sums of position 8i + k, then two of 8i + 4 + k
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // block k: positions k, k + 4, k + 8, k + 12
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// `scores` for bfloat16 q and keys of head size D (a multiple of 16), two positions per vector:
// each 512-bit key operand is 16 elements of position j in its low half and the same 16 of
// position j + 1 in its high half (two 256-bit loads), against q's 16 elements in both halves, so
// a tile of 16 positions leaves 8 partial vectors per query head instead of 16, and a cheaper
// tree. The head's G x D / 16 query operands stay in registers over the tile. Same products and
// float32 sums as Bf16Dot, in another order; the same prefetches as `scores`.
//
// `prefetch` false leaves out the next tile's prefetches, as in `scores`. `group` and `g0`: the G
// query heads scored are heads g0 .. g0 + G - 1 of each KV head's `group` (G itself by default),
// so that a group too large for its query operands to stay in registers goes in two calls (the
// second reading the keys the first brought into L1).
template <int G, int D>
void scores_pairs(const c10::BFloat16* q, const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* rows,
                  int64_t ctx, int64_t heads, float scale, float* scores, bool prefetch = true, int64_t group = G,
                  int64_t g0 = 0) {
  constexpr int M = D / 16;
  const int64_t slot_bytes = heads * D * static_cast<int64_t>(sizeof(c10::BFloat16));
  // Each of the tile's heads * 8 pair products prefetches `per` lines of one of the next tile's
  // pairs of slots (keys' lines, then values'): pair s's part p goes with product s * heads + p.
  const int64_t lines = (slot_bytes + 63) / 64, per = (4 * lines + heads - 1) / heads;
  __m512 partial[G][8];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t pos0 = 0; pos0 < ctx; pos0 += kLanes) {
    const int64_t n = ctx - pos0 < kLanes ? ctx - pos0 : kLanes;
    int64_t ahead = pos0 + kAhead, part = 0;  // the first of the pair of slots the next product prefetches
    SpanPrefetch span;
    int64_t span_per = 0;
    const bool spans = prefetch && next_tile_spans(kp, vp, rows, ctx, ahead, heads * D, heads * ((n + 1) / 2), span, span_per);
    for (int64_t h = 0; h < heads; ++h) {
      __m512bh qd[G][M];
      for (int g = 0; g < G; ++g)
        for (int m = 0; m < M; ++m)
          qd[g][m] = (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(q + (h * group + g0 + g) * D + 16 * m)));
      for (int64_t jj = 0; 2 * jj < n; ++jj) {
        if (spans) {
          span.some(span_per);
        } else if (prefetch) {
          prefetch_slot_lines(kp, vp, rows, ctx, ahead, lines, part * per, std::min(4 * lines, (part + 1) * per));
        }
        if (++part == heads) part = 0, ahead += 2;
        const int64_t j0 = pos0 + 2 * jj, j1 = 2 * jj + 1 < n ? j0 + 1 : j0;  // a lone last position twice
        const c10::BFloat16* k0 = kp + rows[j0] + h * D;
        const c10::BFloat16* k1 = kp + rows[j1] + h * D;
        __m512 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int m = 0; m < M; ++m) {
          const __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + 16 * m)));
          const __m512bh kk = (__m512bh)_mm512_inserti64x4(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1 + 16 * m)), 1);
          for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], qd[g][m], kk);
        }
        for (int g = 0; g < G; ++g) partial[g][jj] = acc[g];
      }
      for (int g = 0; g < G; ++g) {
        for (int64_t jj = (n + 1) / 2; jj < 8; ++jj) partial[g][jj] = _mm512_setzero_ps();
        const __m512 s = _mm512_mul_ps(sum_halves8(partial[g]), vscale);
        _mm512_mask_storeu_ps(scores + (h * group + g0 + g) * ctx + pos0, static_cast<__mmask16>((1u << n) - 1u), s);
      }
    }
  }
}

// The weighted sum for bfloat16 values with VDPBF16PS, two positions per instruction: the
// probabilities are rounded to bfloat16 (as FlashAttention rounds P before its PV product; the
// sum still accumulates in float32), and each pair of value rows is interleaved into (v_j[c],
// v_j+1[c]) pairs with one unpack each way. Per position and KV head, G x d / 32 VDPBF16PS and
// d / 32 unpacks replace the float loop's G x d / 16 FMAs and d / 16 widenings (bfloat16 to
// float32, two instructions each), which are a large share of decode attention's compute
// (cpu_attention_bench; docs/cpu_kernels.md "Decode attention", "Weighted sum"). unpacklo/hi
// work within 128-bit lanes, so accumulator lo holds columns 8L .. 8L+3 and hi 8L+4 .. 8L+7 of
// lane L; they are put back in order once, at the end.
//
// `p` holds float32 probabilities, row r (query head h G + g) at p + r ctx; they are converted to
// bfloat16 pairs in place: row r's pairs start at the same address, ceil(ctx / 2) of them, the
// last padded with a zero where ctx is odd. Needs d % (32 NC) == 0.
template <int G, int NC>
void weighted_sum_pairs(float* p, const c10::BFloat16* vp, const int64_t* rows, int64_t ctx, int64_t d, int64_t heads,
                        float* out, pdserve_cpu::PrefetchCursor& next) {
  const int64_t per = lines_per(next, (ctx + 1) / 2 * heads * (d / (32 * NC)));
  for (int64_t r = 0; r < heads * G; ++r) {
    float* row = p + r * ctx;
    auto* pairs = reinterpret_cast<uint16_t*>(row);
    for (int64_t i = 0; i < ctx; i += kLanes) {  // 16 floats read before their 32 bytes are written
      const __mmask16 m = static_cast<__mmask16>(ctx - i >= kLanes ? 0xFFFF : (1u << (ctx - i)) - 1u);
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, row + i));
      _mm256_mask_storeu_epi16(pairs + i, m, (__m256i)b);
    }
    if (ctx % 2) pairs[ctx] = 0;
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < heads; ++h) {
    const int32_t* pair_rows[G];  // query head g's pair for positions j, j + 1 at [j / 2]
    for (int g = 0; g < G; ++g) pair_rows[g] = reinterpret_cast<const int32_t*>(p + (h * G + g) * ctx);
    for (int64_t c = 0; c < d; c += 32 * NC) {
      __m512 lo[G][NC], hi[G][NC];
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < NC; ++k) lo[g][k] = hi[g][k] = _mm512_setzero_ps();
      for (int64_t j = 0; j < ctx; j += 2) {
        next.some(per);
        const c10::BFloat16* r0 = vp + rows[j] + h * d + c;
        const c10::BFloat16* r1 = j + 1 < ctx ? vp + rows[j + 1] + h * d + c : nullptr;
        __m512bh a[NC], b[NC];
        for (int k = 0; k < NC; ++k) {
          const __m512i x0 = _mm512_loadu_si512(r0 + 32 * k);
          const __m512i x1 = r1 != nullptr ? _mm512_loadu_si512(r1 + 32 * k) : _mm512_setzero_si512();
          a[k] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
          b[k] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        }
        for (int g = 0; g < G; ++g) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(pair_rows[g][j / 2]);
          for (int k = 0; k < NC; ++k) {
            lo[g][k] = _mm512_dpbf16_ps(lo[g][k], a[k], w);
            hi[g][k] = _mm512_dpbf16_ps(hi[g][k], b[k], w);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        float* o = out + (h * G + g) * d + c;
        for (int k = 0; k < NC; ++k) {
          _mm512_storeu_ps(o + 32 * k, _mm512_permutex2var_ps(lo[g][k], first, hi[g][k]));
          _mm512_storeu_ps(o + 32 * k + 16, _mm512_permutex2var_ps(lo[g][k], second, hi[g][k]));
        }
      }
    }
  }
}
#endif

#if defined(PDSERVE_AMX)
// Scores on AMX tiles, for bfloat16 where the CPU has AMX. For each tile of 16 positions and each
// KV head, the 16 key rows are an A tile (16 rows of 32 bfloat16, a slot apart: read in place from
// the cache) and the head's G query rows, transposed into pairs, a B tile; TDPBF16PS gives the
// 16 x G dot products, d / 32 steps of them. Its accumulation is float32, as vdpbf16ps's. It
// replaces vdpbf16ps and the transpose-add tree, a large share of the scores' compute at large
// batches (cpu_attention_bench --batch 32 on an AMX CPU).
//
// Tiles: 0 accumulates, 1 holds key rows, 2 the query pairs. A tile whose 16 positions are not
// evenly spaced (it crosses blocks smaller than 16) or that is the last, partial one is copied
// into `rows16` ([16, heads * d], zero-padded) first.
struct TileScores {
  int64_t heads, group, d;
  c10::BFloat16* q_pairs;  // [heads, d / 32, 16, 2 G]: [h][s][r][2g + j] = q[h G + g][32 s + 2 r + j]
  c10::BFloat16* rows16;   // [16, heads * d]

  void operator()(const c10::BFloat16* q, const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* rows, int64_t ctx, float scale,
                  float* scores) const {
    const int64_t steps = d / 32, pair_bytes = 4 * group, slot = heads * d;
    const int64_t slot_bytes = slot * static_cast<int64_t>(sizeof(c10::BFloat16));
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t g = 0; g < group; ++g)
            for (int64_t j = 0; j < 2; ++j)
              q_pairs[((h * steps + s) * 16 + r) * 2 * group + 2 * g + j] = q[(h * group + g) * d + 32 * s + 2 * r + j];
    pdserve_amx::TileConfig cfg;
    cfg.set(0, 16, static_cast<int>(pair_bytes));
    cfg.set(1, 16, 64);
    cfg.set(2, 16, static_cast<int>(pair_bytes));
    cfg.load();
    alignas(64) float out[16 * 16];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i across = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(group)));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t pos0 = 0; pos0 < ctx; pos0 += kLanes) {
      const int64_t n = ctx - pos0 < kLanes ? ctx - pos0 : kLanes;
      const int64_t ahead = std::min(kLanes, ctx - pos0 - kAhead);  // the next tile's slots, prefetched
      bool even = n == kLanes;
      const int64_t stride = even ? rows[pos0 + 1] - rows[pos0] : 0;
      for (int64_t j = 2; even && j < kLanes; ++j) even = rows[pos0 + j] - rows[pos0 + j - 1] == stride;
      const c10::BFloat16* base = kp + rows[pos0];
      int64_t row_stride = stride;
      if (!even) {
        for (int64_t j = 0; j < kLanes; ++j) {
          c10::BFloat16* dst = rows16 + j * slot;
          if (j < n) {
            std::memcpy(dst, kp + rows[pos0 + j], slot * sizeof(c10::BFloat16));
          } else {
            std::memset(static_cast<void*>(dst), 0, slot * sizeof(c10::BFloat16));
          }
        }
        base = rows16;
        row_stride = slot;
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      for (int64_t h = 0; h < heads; ++h) {
        // A share of the prefetches before each head's products, not the whole next tile's 192
        // lines at once: a burst fills the core's fill buffers and stalls the products behind it.
        // Two tiles ahead is slower (cpu_attention_bench --batch 64 --context 300 on an AMX CPU).
        for (int64_t j = h * kLanes / heads; j < (h + 1) * kLanes / heads && j < ahead; ++j) {
          prefetch_bytes(kp + rows[pos0 + kAhead + j], slot_bytes);
          prefetch_bytes<_MM_HINT_T1>(vp + rows[pos0 + kAhead + j], slot_bytes);
        }
        _tile_zero(0);
        for (int64_t s = 0; s < steps; ++s) {
          _tile_loadd(1, base + h * d + 32 * s, row_stride * static_cast<int64_t>(sizeof(c10::BFloat16)));
          _tile_loadd(2, q_pairs + (h * steps + s) * 32 * group, pair_bytes);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, out, pair_bytes);  // out[j G + g]: position j, query head g
        for (int64_t g = 0; g < group; ++g) {
          const __m512 col = _mm512_i32gather_ps(across, out + g, 4);
          _mm512_mask_storeu_ps(scores + (h * group + g) * ctx + pos0, valid, _mm512_mul_ps(col, vscale));
        }
      }
    }
    _tile_release();
  }
};
#endif

}  // namespace avx512

#endif  // __AVX512F__
