// Paged decode attention for the CPU: one query token per sequence against its paged KV cache,
// read in place (no gather, no padded copy). Built on the machine that runs it by
// kernels/cpu_ops.py through torch.utils.cpp_extension; kernels/reference.py is its oracle.
//
// Layout (kernels/interface.py): q [B, Hq, D]; k_cache/v_cache [N, S, Hkv, D];
// seq_lens [B] int32; block_tables [B, M] int32. Query heads h*G .. h*G+G-1 share KV head h.
//
// With a sliding window W > 0 a sequence of ctx tokens attends positions max(0, ctx - W) .. ctx - 1
// only: its row offsets start there, mid-block where the window does, so the blocks wholly
// before the window are never read (nor checked: they may be freed) and the first, partial
// block's earlier slots are left out, with no mask in the loops.
//
// Work item = (sequence, KV head): its G query heads are scored together, so each key and value
// row is read from memory once per group. Scores are kept in float32 for the whole context, then
// softmaxed exactly (max-subtracted), then the weighted sum of values accumulates in float32 (for
// bfloat16 values on AVX512-BF16, from probabilities rounded to bfloat16: attention_avx512.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "attention_avx512.h"
#include "ops.h"
#include "vec.h"
#include "work_shares.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// In place: s = softmax(s) over n scores, a native vector at a time, the max included: on AVX-512
// a scalar max and 8-wide exponentials are a large share of attention's compute at batch 32
// (python -m pdserve.bench.cpu_attention_bench).
inline void softmax(float* __restrict s, int64_t n) {
  const float inv = 1.f / exp_shifted_sum(s, n, row_max(s, n), 1.f);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// out[g] = sum over pos of p[g * ctx + pos] * v[pos], for the G query heads of one KV head. The
// accumulators of NC 8-float chunks of every head stay in registers across the positions (G * NC
// independent FMA chains); each value row is loaded once for the group. Needs d % (8 NC) == 0.
template <int G, int NC, typename T>
void weighted_sum_vec(const float* p, const T* vp, const int64_t* rows, int64_t ctx, int64_t d, float* out) {
  for (int64_t c = 0; c < d; c += 8 * NC) {
    v8 acc[G][NC] = {};
    for (int64_t pos = 0; pos < ctx; ++pos) {
      const T* vrow = vp + rows[pos] + c;
      if (pos + 8 < ctx) {
        const char* ahead = reinterpret_cast<const char*>(vp + rows[pos + 8] + c);
        for (int64_t b = 0; b < 8 * NC * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(ahead + b);
      }
      v8 x[NC];
      for (int k = 0; k < NC; ++k) x[k] = load8(vrow + 8 * k);
      for (int g = 0; g < G; ++g) {
        const float w = p[g * ctx + pos];
        for (int k = 0; k < NC; ++k) acc[g][k] += w * x[k];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) std::memcpy(out + g * d + c + 8 * k, &acc[g][k], sizeof(v8));
  }
}

template <int G, typename T>
void weighted_sum_g(const float* p, const T* vp, const int64_t* rows, int64_t ctx, int64_t d, float* out) {
  constexpr int NC = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  if (d % (8 * NC) == 0) return weighted_sum_vec<G, NC>(p, vp, rows, ctx, d, out);
  weighted_sum_vec<G, 1>(p, vp, rows, ctx, d, out);
}

// acc += p * v
template <typename T>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * to_float(v[i]);
}

struct Geometry {
  int64_t group, d, block_size, c_sn, c_ss, c_sh;
};

// The first position a sequence of `len` tokens attends: len - window where a window leaves
// earlier ones out, else 0.
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// Offsets (in elements) of KV head h's row at positions from..end-1 of one sequence, into
// rows[pos - start] (rows already holding start..from-1 keep them), walking its blocks in order
// from from's (no division per position).
inline void row_offsets(const int32_t* blocks, int64_t h, int64_t start, int64_t from, int64_t end,
                        const Geometry& geo, std::vector<int64_t>& rows) {
  rows.resize(end - start);
  int64_t pos = from;
  for (int64_t j = from / geo.block_size, t = from % geo.block_size; pos < end; ++j, t = 0) {
    const int64_t base = blocks[j] * geo.c_sn + h * geo.c_sh;
    for (; t < geo.block_size && pos < end; ++t, ++pos) rows[pos - start] = base + t * geo.c_ss;
  }
}

// Whether block table rows a and b hold the same blocks for a sequence's first `len` positions
// (false where a is null or len is 0).
inline bool shares_blocks(const int32_t* a, const int32_t* b, int64_t len, int64_t block_size) {
  if (a == nullptr || len <= 0) return false;
  const int64_t blocks = (len + block_size - 1) / block_size;
  return a == b || std::equal(a, a + blocks, b);
}

// scores[g * ctx + pos] = qf[g] . k[pos] for the G query heads of one KV head. G is a template
// parameter so the G accumulators of two positions at a time stay in registers (2G independent
// FMA chains); each key row is loaded once for the whole group. Needs d % 8 == 0. `ld` is the
// distance between two heads' rows of scores: ctx, or more where this scores scores_quad's tail.
template <int G, typename T>
void scores_vec(const float* qf, const T* kp, const int64_t* rows, int64_t ctx, int64_t ld, const Geometry& geo,
                float* scores) {
  const int64_t d = geo.d;
  int64_t pos = 0;
  for (; pos + 1 < ctx; pos += 2) {
    const T* k0 = kp + rows[pos];
    const T* k1 = kp + rows[pos + 1];
    if (pos + 8 < ctx) {  // rows of another block are not where the hardware prefetcher looks
      const char* ahead0 = reinterpret_cast<const char*>(kp + rows[pos + 8]);
      const char* ahead1 = reinterpret_cast<const char*>(kp + rows[pos + 9 < ctx ? pos + 9 : pos + 8]);
      for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(ahead0 + b);
        __builtin_prefetch(ahead1 + b);
      }
    }
    v8 a0[G] = {}, a1[G] = {};
    for (int64_t i = 0; i < d; i += 8) {
      const v8 x0 = load8(k0 + i), x1 = load8(k1 + i);
      for (int g = 0; g < G; ++g) {
        const v8 qv = load8(qf + g * d + i);
        a0[g] += qv * x0;
        a1[g] += qv * x1;
      }
    }
    for (int g = 0; g < G; ++g) {
      scores[g * ld + pos] = hsum(a0[g]);
      scores[g * ld + pos + 1] = hsum(a1[g]);
    }
  }
  for (; pos < ctx; ++pos) {
    const T* k0 = kp + rows[pos];
    v8 a0[G] = {};
    for (int64_t i = 0; i < d; i += 8) {
      const v8 x0 = load8(k0 + i);
      for (int g = 0; g < G; ++g) a0[g] += load8(qf + g * d + i) * x0;
    }
    for (int g = 0; g < G; ++g) scores[g * ld + pos] = hsum(a0[g]);
  }
}

#if defined(__AVX__)
// scores_vec for groups of at most 3 on 256-bit vectors, four positions at a time: the G x 4
// accumulators stay in registers, and a tree of three horizontal adds turns each query head's four
// partial vectors into its four scores, stored together. scores_vec sums each score's lanes one by
// one, which costs about as much as the products (cpu_attention_bench --batch 32 on AVX2;
// docs/cpu_kernels.md "Decode attention", "Scores").
template <int G, typename T>
void scores_quad(const float* qf, const T* kp, const int64_t* rows, int64_t ctx, const Geometry& geo,
                 float* scores) {
  static_assert(G * 4 <= 12, "G x 4 accumulators must leave registers for the loads");
  const int64_t d = geo.d, row_bytes = d * static_cast<int64_t>(sizeof(T));
  constexpr int64_t kAhead = 8;  // positions; rows of another block are not where the hardware prefetcher looks
  int64_t pos = 0;
  for (; pos + 4 <= ctx; pos += 4) {
    const T* k[4];
    for (int p = 0; p < 4; ++p) k[p] = kp + rows[pos + p];
    for (int p = 0; p < 4 && pos + kAhead + p < ctx; ++p) {
      const char* ahead = reinterpret_cast<const char*>(kp + rows[pos + kAhead + p]);
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
    }
    v8 acc[G][4] = {};
    for (int64_t i = 0; i < d; i += 8) {
      v8 x[4];
      for (int p = 0; p < 4; ++p) x[p] = load8(k[p] + i);
      for (int g = 0; g < G; ++g) {
        const v8 qv = load8(qf + g * d + i);
        for (int p = 0; p < 4; ++p) acc[g][p] += qv * x[p];
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 h01 = _mm256_hadd_ps((__m256)acc[g][0], (__m256)acc[g][1]);
      const __m256 h23 = _mm256_hadd_ps((__m256)acc[g][2], (__m256)acc[g][3]);
      const __m256 h = _mm256_hadd_ps(h01, h23);  // each 128-bit half: one partial sum of the 4 scores
      _mm_storeu_ps(scores + g * ctx + pos, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
  if (pos < ctx) scores_vec<G>(qf, kp, rows + pos, ctx - pos, ctx, geo, scores + pos);  // the last 0-3
}
#endif

// The same for any group size and head size.
template <typename T>
void scores_any(const float* qf, const T* kp, const int64_t* rows, int64_t ctx, const Geometry& geo,
                float* scores) {
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const T* krow = kp + rows[pos];
    for (int64_t g = 0; g < geo.group; ++g) {
      const float* qg = qf + g * geo.d;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < geo.d; ++i) acc += qg[i] * to_float(krow[i]);
      scores[g * ctx + pos] = acc;
    }
  }
}

// f(std::integral_constant<int, G>) for a group size 1..8 known at compile time; false for others.
template <typename F>
bool by_group(int64_t group, F&& f) {
  switch (group) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 7: f(std::integral_constant<int, 7>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

template <typename T>
void scores_dispatch(const float* qf, const T* kp, const int64_t* rows, int64_t ctx, const Geometry& geo,
                     float* scores) {
  if (geo.d % 8 == 0 && by_group(geo.group, [&](auto g) {
        constexpr int G = decltype(g)::value;
#if defined(__AVX__)
        if constexpr (G <= 3) return scores_quad<G>(qf, kp, rows, ctx, geo, scores);
#endif
        scores_vec<G>(qf, kp, rows, ctx, ctx, geo, scores);
      }))
    return;
  scores_any(qf, kp, rows, ctx, geo, scores);
}

template <typename T>
void weighted_sum_any(const float* p, const T* vp, const int64_t* rows, int64_t ctx, const Geometry& geo, float* out) {
  std::fill(out, out + geo.group * geo.d, 0.f);
  for (int64_t pos = 0; pos < ctx; ++pos) {
    const T* vrow = vp + rows[pos];
    for (int64_t g = 0; g < geo.group; ++g) axpy(out + g * geo.d, p[g * ctx + pos], vrow, geo.d);
  }
}

template <typename T>
void weighted_sum_dispatch(const float* p, const T* vp, const int64_t* rows, int64_t ctx, const Geometry& geo,
                           float* out) {
  if (geo.d % 8 == 0 &&
      by_group(geo.group, [&](auto g) { weighted_sum_g<decltype(g)::value>(p, vp, rows, ctx, geo.d, out); }))
    return;
  weighted_sum_any(p, vp, rows, ctx, geo, out);
}

// Whether the 512-bit loops (attention_avx512.h) run: a CPU with AVX-512, a head size that is a
// multiple of 16, a group of at most 8 and every KV head's row of a slot side by side.
inline bool wide_applies(const Geometry& geo) {
#if defined(__AVX512F__)
  return geo.d % 16 == 0 && geo.group >= 1 && geo.group <= 8 && geo.c_sh == geo.d;
#else
  (void)geo;
  return false;
#endif
}

// How the 512-bit path scores (decided once per call): on AMX tiles, with vdpbf16ps on q as it came
// in bfloat16, or with float32 FMAs on q widened and scaled (every other case).
enum class Dots { Float, Bf16, Tiles };

template <typename T>
Dots wide_dots(const Geometry& geo) {
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, c10::BFloat16> && wide_applies(geo) && geo.d % 32 == 0)
    return pdserve_amx::ready() ? Dots::Tiles : Dots::Bf16;
#endif
  (void)geo;
  return Dots::Float;
}

// The 512-bit loops over `heads` KV heads of one sequence (wide_applies must hold). The query rows
// come as they are in q_raw for Bf16 and Tiles dots, else in float32, scaled, in qf. `tiles` is
// the scratch of the Tiles scores, [heads * group * d + 16 * heads * d].
template <typename T>
void attend_wide(Dots dots, const T* q_raw, const float* qf, const T* kp, const T* vp, const int64_t* rows,
                 int64_t ctx, int64_t heads, const Geometry& geo, float scale, float* scores, float* out, T* tiles,
                 pdserve_cpu::PrefetchCursor& next, bool resident) {
#if defined(__AVX512F__)
  const auto scores_with = [&](auto g, const auto& dot, float s) {
    avx512::scores<decltype(g)::value>(dot, kp, vp, rows, ctx, heads, s, scores, !resident);
  };
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(PDSERVE_AMX)
    if (dots == Dots::Tiles)
      avx512::TileScores{heads, geo.group, geo.d, tiles, tiles + heads * geo.group * geo.d}(q_raw, kp, vp, rows, ctx,
                                                                                           scale, scores);
#endif
#if defined(__AVX512BF16__)
    if (dots == Dots::Bf16) {
      by_group(geo.group, [&](auto g) {
        constexpr int G = decltype(g)::value;
        // The query operands in registers: G x D / 16 of them, at most 16.
        if constexpr (G <= 4) {
          if (geo.d == 64) return avx512::scores_pairs<G, 64>(q_raw, kp, vp, rows, ctx, heads, scale, scores, !resident);
        } else {  // 5 to 8 query heads a KV head (Qwen2.5's 7): two calls of at most 4
          if (geo.d == 64) {
            avx512::scores_pairs<4, 64>(q_raw, kp, vp, rows, ctx, heads, scale, scores, !resident, G, 0);
            return avx512::scores_pairs<G - 4, 64>(q_raw, kp, vp, rows, ctx, heads, scale, scores, false, G, 4);
          }
        }
        if constexpr (G <= 2) {
          if (geo.d == 128) return avx512::scores_pairs<G, 128>(q_raw, kp, vp, rows, ctx, heads, scale, scores, !resident);
        }
        scores_with(g, avx512::Bf16Dot<G>{q_raw, geo.d}, scale);
      });
    }
#endif
  }
  if (dots == Dots::Float)
    by_group(geo.group, [&](auto g) { scores_with(g, avx512::WideDot<decltype(g)::value, T>{qf, geo.d}, 1.f); });
  for (int64_t r = 0; r < heads * geo.group; ++r) softmax(scores + r * ctx, ctx);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (dots != Dots::Float) {  // bfloat16 values, d % 32 == 0 (wide_dots)
      by_group(geo.group, [&](auto g) {
        constexpr int G = decltype(g)::value;
        constexpr int NC = G <= 2 ? 4 : (G <= 4 ? 2 : 1);  // at most 16 accumulators
        if (geo.d % (32 * NC) == 0) return avx512::weighted_sum_pairs<G, NC>(scores, vp, rows, ctx, geo.d, heads, out, next);
        avx512::weighted_sum_pairs<G, 1>(scores, vp, rows, ctx, geo.d, heads, out, next);
      });
      return;
    }
  }
#endif
  by_group(geo.group, [&](auto g) {
    constexpr int G = decltype(g)::value;
    constexpr int NC = G <= 4 ? 4 : 2;  // at most 16 accumulators
    if (geo.d % (16 * NC) == 0) return avx512::weighted_sum<G, NC>(scores, vp, rows, ctx, geo.d, heads, out, next);
    avx512::weighted_sum<G, 1>(scores, vp, rows, ctx, geo.d, heads, out, next);
  });
#else
  (void)dots, (void)q_raw, (void)qf, (void)kp, (void)vp, (void)rows, (void)ctx, (void)heads, (void)geo, (void)scale;
  (void)scores, (void)out, (void)tiles, (void)next, (void)resident;
#endif
}

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, int64_t window,
                   at::Tensor& out, const pdserve_cpu::BackgroundPrefetch& spare) {
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(2);
  const Geometry geo{hq / hkv, d, k_cache.size(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const int64_t group = geo.group;
  const int64_t q_sb = q.stride(0), q_sh = q.stride(1);
  const int64_t t_sb = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_tables.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // A work item is all of a sequence's KV heads on the 512-bit path, so that each tile of
  // positions reads whole slots, else one KV head of one sequence. Whole sequences even where
  // there are fewer than threads (batch 1: one thread attends alone): one stream of whole slots
  // reads the cache faster than heads split across threads (cpu_attention_bench --batch 4;
  // engine_overhead, decode batch 1; docs/cpu_kernels.md "Decode attention", "Work items").
  const bool wide = wide_applies(geo);
  const int64_t heads = wide ? hkv : 1;
  const int64_t per_seq = hkv / heads;
  const Dots dots = wide_dots<T>(geo);
  const bool raw_q = dots != Dots::Float;
  const int64_t tile_scratch = dots == Dots::Tiles ? heads * group * d + 16 * heads * d : 0;
  // A block's keys, whole lines: its slots, each all of the item's heads.
  const int64_t block_lines = (geo.block_size * geo.c_ss * static_cast<int64_t>(sizeof(T)) + 63) / 64;

  // Threads left without an item prefetch `spare` into their caches (the memory the caller reads
  // next) until the last item is done: see decode_attention_then.
  const int64_t items = batch * per_seq;
  const int64_t spare_units = spare.lines() > 0 && items < at::get_num_threads() && !at::in_parallel_region()
                                  ? at::get_num_threads() - items : 0;
  // One thread's scratch. The tile scratch (query pairs, copied key rows) comes from ATen's
  // allocator, which starts every block on a 64-byte line: a tile row across two lines loads at
  // half the rate.
  struct Scratch {
    std::vector<float> qf, acc, scores;
    std::vector<T> q_raw;
    at::Tensor tiles;
    T* tile_scratch_at = nullptr;
    std::vector<int64_t> rows, next_blocks;
    // What `rows` holds: KV head rows_head's positions rows_start .. rows_start + rows.size() - 1
    // of the sequence whose block table row is rows_table (null: nothing yet).
    const int32_t* rows_table = nullptr;
    int64_t rows_head = -1, rows_start = -1;
    // How many of an item's positions (KV head h, from `start`, block table row `table`) `rows`
    // holds already: a prompt's previous row's, each its own sequence under --deterministic.
    int64_t rows_held(const int32_t* table, int64_t h, int64_t start, int64_t block_size) const {
      const int64_t held = static_cast<int64_t>(rows.size());
      const bool same = rows_head == h && rows_start == start && shares_blocks(rows_table, table, start + held, block_size);
      return same ? held : 0;
    }
  };
  const auto scratch = [&] {
    const int64_t width = heads * group * d;
    Scratch s;
    s.qf.resize(width);
    s.acc.resize(width);
    s.q_raw.resize(width);
    if (tile_scratch > 0) {
      s.tiles = at::empty({tile_scratch}, q.options());
      s.tile_scratch_at = s.tiles.template data_ptr<T>();
    }
    return s;
  };
  // One item; `after`, the thread's next item (-1 for none), has its keys prefetched meanwhile.
  const auto attend = [&](Scratch& s, int64_t item, int64_t after) {
    const int64_t b = item / per_seq, h0 = (item % per_seq) * heads;
    // The positions attended, start .. start + ctx - 1: the last `window` of the sequence's.
    const int64_t start = window_start(lens[b], window), ctx = lens[b] - start, width = heads * group * d;
    T* o = op + b * hq * d + h0 * group * d;  // out is contiguous
    if (ctx <= 0) {
      std::fill(o, o + width, from_float<T>(0.f));
      return;
    }
    for (int64_t r = 0; r < heads * group; ++r) {
      const T* src = qp + b * q_sb + (h0 * group + r) * q_sh;
      if (raw_q) {
        std::copy(src, src + d, s.q_raw.data() + r * d);
      } else {
        for (int64_t i = 0; i < d; ++i) s.qf[r * d + i] = to_float(src[i]) * fscale;
      }
    }
    s.scores.resize(heads * group * ctx);
    const int32_t* own = table + b * t_sb;
    // Where the previous item's positions are a prefix of these, only the new ones, and the slots
    // are in cache: the scores pass leaves out its prefetches.
    const int64_t held = std::min(s.rows_held(own, h0, start, geo.block_size), ctx);
    const bool resident = held > 0;
    row_offsets(own, h0, start, start + held, start + ctx, geo, s.rows);
    s.rows_table = own, s.rows_head = h0, s.rows_start = start;
    if (wide) {
      // The keys of this thread's next item (a whole sequence: the wide path), block by block;
      // none where they are this item's own (a prompt's next row): the scores pass brought them in.
      s.next_blocks.clear();
      const int64_t nb = after >= 0 ? after / per_seq : -1;
      const bool next_resident = nb >= 0 && lens[nb] <= lens[b] + 1 && window_start(lens[nb], window) >= start &&
                                 shares_blocks(own, table + nb * t_sb, lens[nb], geo.block_size);
      for (int64_t j = nb >= 0 && !next_resident ? window_start(lens[nb], window) / geo.block_size : 0;
           nb >= 0 && !next_resident && j * geo.block_size < lens[nb]; ++j)
        s.next_blocks.push_back(table[nb * t_sb + j] * geo.c_sn * static_cast<int64_t>(sizeof(T)));
      const pdserve_cpu::BackgroundPrefetch next_keys{reinterpret_cast<const char*>(kp), s.next_blocks.data(),
                                                      static_cast<int64_t>(s.next_blocks.size()), block_lines};
      pdserve_cpu::PrefetchCursor next(next_keys, 0, next_keys.lines());
      attend_wide(dots, s.q_raw.data(), s.qf.data(), kp, vp, s.rows.data(), ctx, heads, geo, fscale, s.scores.data(),
                  s.acc.data(), s.tile_scratch_at, next, resident);
    } else {
      scores_dispatch(s.qf.data(), kp, s.rows.data(), ctx, geo, s.scores.data());
      for (int64_t g = 0; g < group; ++g) softmax(s.scores.data() + g * ctx, ctx);
      weighted_sum_dispatch(s.scores.data(), vp, s.rows.data(), ctx, geo, s.acc.data());
    }
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) store8(o + i, load8(s.acc.data() + i));
    for (; i < width; ++i) o[i] = from_float<T>(s.acc[i]);
  };
  if (spare_units == 0) {
    // Every thread has items: each runs its share, then what is left of the others' from their
    // far ends (work_shares.h), so that sequences of different lengths do not leave one thread
    // waiting at the join. The next item prefetched is the next of the thread's own share. It
    // gains in decode steps at batch 32 with uneven contexts and costs nothing where contexts split
    // evenly (docs/cpu_kernels.md "Decode attention", "Work items").
    pdserve_cpu::parallel_for_stealing(items, scratch, attend);
    return;
  }
  std::atomic<int64_t> items_left{items};
  at::parallel_for(0, items + spare_units, 1, [&](int64_t begin, int64_t end) {
    if (begin >= items) {
      if (begin > items) return;  // one of them takes it all: the lines are read in order
      pdserve_cpu::PrefetchCursor cursor(spare, 0, spare.lines());
      while (cursor.active() && items_left.load(std::memory_order_relaxed) > 0) cursor.some(16);
      return;
    }
    end = std::min(end, items);
    Scratch s = scratch();
    for (int64_t item = begin; item < end; ++item) {
      attend(s, item, item + 1 < end ? item + 1 : -1);
      items_left.fetch_sub(1, std::memory_order_relaxed);
    }
  });
}

}  // namespace

namespace pdserve_cpu {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                            int64_t window) {
  return decode_attention_then(q, k_cache, v_cache, seq_lens, block_tables, scale, window, {});
}

at::Tensor decode_attention_then(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                                 int64_t window, const BackgroundPrefetch& spare) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "pdserve_cpu.decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "expected q [B,Hq,D] and cache [N,S,Hkv,D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must have the same shape and strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head size of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt,
              "seq_lens and block_tables must be int32");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0), "seq_lens must be [B]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "block_tables must be [B, M] with contiguous rows");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a positive number of positions, got ", window);
  at::Tensor lens = seq_lens.contiguous();
  // Every block a sequence reads must exist: checked here, once, so the kernel never reads out of
  // bounds whatever the caller passes. Those before its window it does not read.
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0), width = block_tables.size(1);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t need = (static_cast<int64_t>(lp[b]) + block_size - 1) / block_size;
    TORCH_CHECK(need <= width, "sequence ", b, " needs ", need, " blocks but its table holds ", width);
    for (int64_t j = window_start(lp[b], window) / block_size; j < need; ++j) {
      const int32_t id = tp[b * block_tables.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", b, " block ", j, " is ", id, ", outside the cache");
    }
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q, k_cache, v_cache, lens, block_tables, scale, window, out, spare);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<c10::BFloat16>(q, k_cache, v_cache, lens, block_tables, scale, window, out, spare);
  } else {
    TORCH_CHECK(false, "pdserve_cpu.decode_attention supports float32 and bfloat16, not ", q.scalar_type());
  }
  return out;
}

// Each token's key and value row into its slot (block * S + offset) of the paged cache, one
// memcpy each; negative slots are skipped, any other slot outside the cache is an error raised
// before anything is written.
void store_kv_(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && k_cache.device().is_cpu(), "pdserve_cpu.store_kv_ runs on CPU tensors");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key and value must be the same [T, Hkv, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must be the same [N, S, Hkv, D]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "key, value and the cache must share a dtype");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "key rows do not fit the cache's [Hkv, D]");
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "each token's key and value must be one contiguous [Hkv, D] row");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && k_cache.stride(1) == row,
              "each cache slot must be one contiguous [Hkv, D] row");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [T]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), capacity = k_cache.size(0) * block_size, tokens = key.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] < capacity, "token ", t, " has slot ", sp[t], ", outside the cache (", capacity, " slots)");
  const int64_t bytes = row * key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = key.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = sp[t];
    if (s < 0) continue;
    const int64_t dst = ((s / block_size) * k_cache.stride(0) + (s % block_size) * row) * es;
    std::memcpy(kc + dst, kp + t * key.stride(0) * es, bytes);
    std::memcpy(vc + dst, vp + t * value.stride(0) * es, bytes);
  }
}

}  // namespace pdserve_cpu
