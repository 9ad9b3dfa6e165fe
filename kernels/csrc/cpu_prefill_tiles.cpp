// Causal prefill attention of one sequence in bfloat16 on AMX tiles:
//
//   q [T, Hq, D]; key, value [Tk, Hkv, D] with Tk = offset + T, D a multiple of 32; query t sits at
//   position offset + t and sees keys 0 .. offset + t, or with a sliding window W > 0 only
//   offset + t - W + 1 .. offset + t. Query heads h*G .. h*G+G-1 share KV head h.
//
// Each KV head's keys and values are packed once into the pair-interleaved form TDPBF16PS reads as
// its "B" operand: the keys as [Tk/16 key tiles][D/32 steps][16][32] (a tile is 16 keys by 32 of
// D), the values as [Tk/32 key steps][D/16 column tiles][16][32] (32 keys by 16 of D). A work item
// is one KV head and 32 of its query rows (token by token, its G heads together; two "A" tiles of
// 16): their scores against the keys the last row sees, 32 keys at a time into four float32
// accumulators; a softmax per row in float32 over the keys that row sees, rounded to bfloat16 as
// the next product's "A" operand (zero past them); then that product with the values, two column
// tiles at a time, divided by the row's sum on the way out. With a window, an item's products
// start at the 32-key step holding its first row's first key (the steps before are skipped) and
// each row's probabilities are zero before its own first key. As SDPA's bfloat16 kernels do, the
// probabilities are rounded to bfloat16 before they weight the values; sums and maxima are float32.
//
// Why: torch's SDPA (its CPU flash attention) runs bfloat16 prefill attention far below the tiles'
// rate, a large share of a prefill (python -m pdserve.bench.engine_overhead --dtype bfloat16,
// prefill 256 and 1,024, against --attention-backend reference; docs/cpu_kernels.md "Prefill
// attention").
//
// Where the build has no AMX, or Linux refuses the process the tile state (amx.h), the same layout
// runs on VDPBF16PS in register blocks where the CPU has AVX512-BF16 (Avx512Bf16Blocks), else
// through a portable emulation of the tile instructions: slow and never chosen by the backend
// (`tile_kernel`), but it keeps the packing and the chunking tested on every machine against the
// SDPA oracle.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "amx.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <memory>

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kRows = 32;  // query rows per work item: two A tiles of 16
constexpr int64_t kStep = 32;  // bfloat16 elements in a tile row: D per step of the scores, keys per step of the values

// Padding past each scratch row (64 bytes: 16 floats, 32 bfloat16). Rows of a power-of-two width
// sit 4 KB apart, so a tile's 16 row stores and loads alias in the L1 and serialise; one more line
// per row spreads them (engine_overhead, prefill 1,024, on AMX).
constexpr int64_t kPadF = 16, kPadB = 32;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Tile numbers: 0-3 accumulate (2 * half + column tile), 4-5 the two halves of the rows, 6-7 the
// two B tiles of a step. Every tile is configured as 16 rows of 64 bytes.

#if defined(PDSERVE_AMX)
struct AmxTiles {
  AmxTiles() {
    pdserve_amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
    cfg.load();
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
  // The tile intrinsics take their register as a literal, so each tile the kernel uses is a case.
  template <int T> void zero() {
    static_assert(T >= 0 && T < 4, "accumulators are tiles 0-3");
    if constexpr (T == 0) _tile_zero(0);
    if constexpr (T == 1) _tile_zero(1);
    if constexpr (T == 2) _tile_zero(2);
    if constexpr (T == 3) _tile_zero(3);
  }
  template <int T> void load(const bf16* p, int64_t ld) {
    static_assert(T >= 4 && T < 8, "operands are tiles 4-7");
    const int64_t stride = ld * static_cast<int64_t>(sizeof(bf16));
    if constexpr (T == 4) _tile_loadd(4, p, stride);
    if constexpr (T == 5) _tile_loadd(5, p, stride);
    if constexpr (T == 6) _tile_loadd(6, p, stride);
    if constexpr (T == 7) _tile_loadd(7, p, stride);
  }
  template <int C, int A, int B> void dot() {
    static_assert(C == 2 * (A - 4) + (B - 6), "accumulator 2 * half + column tile");
    if constexpr (C == 0) _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (C == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (C == 3) _tile_dpbf16ps(3, 5, 7);
  }
  template <int T> void store(float* p, int64_t ld) {
    const int64_t stride = ld * static_cast<int64_t>(sizeof(float));
    if constexpr (T == 0) _tile_stored(0, p, stride);
    if constexpr (T == 1) _tile_stored(1, p, stride);
    if constexpr (T == 2) _tile_stored(2, p, stride);
    if constexpr (T == 3) _tile_stored(3, p, stride);
  }
};
#endif

#if defined(PDSERVE_AVX512_BF16)
// The products with VDPBF16PS, on a CPU with AVX512-BF16 and no AMX: not the tile instructions
// emulated (their 16 x 16 accumulators went through L1 at every 32-deep step, and the B rows were
// loaded again for each half of the rows) but a register-blocked kernel over the same packed
// layouts, its accumulators in registers over the whole reduction: 8 rows by two key tiles (32
// keys) for the scores, 8 rows by two column tiles (32 of D) for the outputs, one broadcast pair of
// A per row and one B row per tile at each pair of the reduction. (4 rows by four column tiles
// would read all of an item's values from L2 once per 4 rows, not 8, and make the products with
// the values slower than the scores.) engine_overhead --dtype bfloat16, prefill 256 and 1,024, on
// AVX512-BF16; docs/cpu_kernels.md "Prefill attention".
struct Avx512Bf16Blocks {};

// Keeps v in a register from here on: without it GCC loads each B row again for every row of A
// it multiplied (one 512-bit load per VDPBF16PS, which makes the loads the bound).
template <typename V>
inline void in_register(V& v) {
  asm volatile("" : "+v"(v));
}

// Scores of rows [R, D] (row i at q + i d) against the key tiles kt and kt + 1 (`tile` elements
// apart): s[i][16 t + n] for i < R (row i at s + i ls).
template <int R>
inline void score_block(const bf16* q, int64_t d, const bf16* kt, int64_t tile, float* s, int64_t ls) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < d / 2; ++pair) {  // key tile row `pair` holds D elements 2 pair, 2 pair + 1
    __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + pair * 32));
    __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + tile + pair * 32));
    in_register(b0), in_register(b1);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512bh a = pdserve_amx::broadcast_pair(q + i * d + 2 * pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(s + i * ls, acc[i][0]);
    _mm512_storeu_ps(s + i * ls + 16, acc[i][1]);
  }
}

// Outputs of rows [R, width] of probabilities (row i at p + i lp) against the value tiles of
// column tiles c0 and c0 + 1: o[i][16 (c0 + c) + n] (row i at o + i d).
template <int R>
inline void value_block(const bf16* p, int64_t lp, const bf16* values, int64_t width, int64_t col_tiles, int64_t c0,
                        float* o, int64_t d) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t ks = 0; ks < width / kStep; ++ks) {
    const bf16* vt = values + (ks * col_tiles + c0) * 16 * 32;
    for (int64_t r = 0; r < 16; ++r) {  // keys 32 ks + 2 r, + 1
      __m512bh b[2];
      for (int c = 0; c < 2; ++c) {
        b[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vt + (c * 16 + r) * 32));
        in_register(b[c]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512bh a = pdserve_amx::broadcast_pair(p + i * lp + ks * kStep + 2 * r);
        for (int c = 0; c < 2; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, b[c]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 2; ++c) _mm512_storeu_ps(o + i * d + 16 * (c0 + c), acc[i][c]);
}

constexpr int kScoreRows = 8, kValueRows = 8;  // 16 accumulators each
static_assert(kRows % kScoreRows == 0 && kRows % kValueRows == 0, "whole blocks of rows");

void scores_on(Avx512Bf16Blocks&, const bf16* q_rows, int64_t d, const bf16* keys, int64_t width, float* s,
               int64_t ls) {
  const int64_t tile = d * 16;  // one key tile: D / 32 steps of [16][32]
  for (int64_t k0 = 0; k0 < width; k0 += kStep)
    for (int64_t m0 = 0; m0 < kRows; m0 += kScoreRows)
      score_block<kScoreRows>(q_rows + m0 * d, d, keys + (k0 / 16) * tile, tile, s + m0 * ls + k0, ls);
}

void values_on(Avx512Bf16Blocks&, const bf16* p, int64_t lp, const bf16* values, int64_t width, int64_t d,
               float* o) {
  const int64_t col_tiles = d / 16;  // even: D is a multiple of 32
  for (int64_t c0 = 0; c0 < col_tiles; c0 += 2)
    for (int64_t m0 = 0; m0 < kRows; m0 += kValueRows)
      value_block<kValueRows>(p + m0 * lp, lp, values, width, col_tiles, c0, o + m0 * d, d);
}
#endif

// What the tile instructions compute, on eight tiles in memory: C[m][n] += sum over r, j of
// A[m][2r + j] B[r][2n + j], in float32.
struct PortableTiles {
  float acc[8][16 * 16];
  float operand[8][16 * 32];
  template <int T> void zero() { std::fill(acc[T], acc[T] + 16 * 16, 0.f); }
  template <int T> void load(const bf16* p, int64_t ld) {
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 32; ++c) operand[T][r * 32 + c] = static_cast<float>(p[r * ld + c]);
  }
  template <int C, int A, int B> void dot() {
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float s = acc[C][m * 16 + n];
        for (int k = 0; k < 32; ++k) s += operand[A][m * 32 + k] * operand[B][(k / 2) * 32 + 2 * n + k % 2];
        acc[C][m * 16 + n] = s;
      }
  }
  template <int T> void store(float* p, int64_t ld) {
    for (int r = 0; r < 16; ++r) std::copy(acc[T] + r * 16, acc[T] + r * 16 + 16, p + r * ld);
  }
};

// Keys [Tk, D] of one head (row n at src + n * ld) as score tiles, zero past Tk:
// dst[kt][s][r][2n + j] = key[16 kt + n][32 s + 2r + j], for Tk rounded up to 32 keys.
void pack_keys(const bf16* src, int64_t ld, int64_t keys, int64_t d, bf16* dst) {
  const int64_t tiles = round_up(keys, 2 * 16) / 16, steps = d / kStep;
  for (int64_t kt = 0; kt < tiles; ++kt)
    for (int64_t s = 0; s < steps; ++s) {
      bf16* tile = dst + (kt * steps + s) * 16 * 32;
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = 16 * kt + n;
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t j = 0; j < 2; ++j) tile[r * 32 + 2 * n + j] = key < keys ? src[key * ld + s * kStep + 2 * r + j] : bf16(0.f);
      }
    }
}

// Values [Tk, D] of one head as value tiles, zero past Tk:
// dst[ks][ct][r][2n + j] = value[32 ks + 2r + j][16 ct + n].
void pack_values(const bf16* src, int64_t ld, int64_t keys, int64_t d, bf16* dst) {
  const int64_t steps = round_up(keys, kStep) / kStep, col_tiles = d / 16;
  for (int64_t ks = 0; ks < steps; ++ks)
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      bf16* tile = dst + (ks * col_tiles + ct) * 16 * 32;
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t j = 0; j < 2; ++j) {
          const int64_t key = ks * kStep + 2 * r + j;
          for (int64_t n = 0; n < 16; ++n) tile[r * 32 + 2 * n + j] = key < keys ? src[key * ld + 16 * ct + n] : bf16(0.f);
        }
    }
}

// p[i] = bf16(exp(scale (s[i] - max s))) for i < n and zero from n to `width`, in one pass from the
// scores to the probabilities (n > 0); returns the sum of the exponentials before rounding. The
// exponent is one multiply-add in base 2 and exp2_coarse is accurate to the bfloat16 the
// probabilities are rounded to. With AVX512-BF16 the rounding is one instruction (vec.h store16);
// its generic emulation is a large share of the softmax.
inline float exp_into_bf16(const float* s, int64_t n, int64_t width, float scale, bf16* p) {
  const float k = scale * 1.4426950408889634f, mk = -row_max(s, n) * k;  // log2(e) scale
  vf sum = {};
  int64_t i = 0;
  for (; i + kVf <= n; i += kVf) {
    const vf e = exp2_coarse(loadf(s + i) * k + mk);
    sum += e;
    storef(p + i, e);
  }
  if (i < n) {  // the tail, through one vector whose lanes past n are 2^-126: counted as 0
    vf t = vf{} - 126.f;
    for (int64_t l = 0; l < n - i; ++l) t[l] = s[i + l] * k + mk;
    vf e = exp2_coarse(t);
    for (int64_t l = n - i; l < kVf; ++l) e[l] = 0.f;
    sum += e;
    // p's rows are whole multiples of 32 keys, so the vector fits; a row of a window starts
    // anywhere, and the vector may reach into the row's padding (kPadB).
    storef(p + i, e);
    i += kVf;
  }
  if (i < width) std::fill(p + i, p + width, bf16(0.f));
  return hsum(sum);
}

// Scores [32, width] of the rows (ld D) against the packed keys (row r at s + r ls), 32 keys (two
// key tiles) at a time, on tiles.
template <typename Tiles>
void scores_on(Tiles& tiles, const bf16* q_rows, int64_t d, const bf16* keys, int64_t width, float* s, int64_t ls) {
  const int64_t steps = d / kStep;
  for (int64_t k0 = 0; k0 < width; k0 += kStep) {
    tiles.template zero<0>();
    tiles.template zero<1>();
    tiles.template zero<2>();
    tiles.template zero<3>();
    const bf16* kt = keys + (k0 / 16) * steps * 16 * 32;
    for (int64_t st = 0; st < steps; ++st) {
      tiles.template load<4>(q_rows + st * kStep, d);
      tiles.template load<6>(kt + st * 16 * 32, 32);
      tiles.template load<7>(kt + (steps + st) * 16 * 32, 32);
      tiles.template dot<0, 4, 6>();
      tiles.template dot<1, 4, 7>();
      tiles.template load<5>(q_rows + 16 * d + st * kStep, d);
      tiles.template dot<2, 5, 6>();
      tiles.template dot<3, 5, 7>();
    }
    tiles.template store<0>(s + k0, ls);
    tiles.template store<1>(s + k0 + 16, ls);
    tiles.template store<2>(s + 16 * ls + k0, ls);
    tiles.template store<3>(s + 16 * ls + k0 + 16, ls);
  }
}

// Outputs [32, D] = p v (row r at o + r D), two column tiles (32 of D) at a time, on tiles.
template <typename Tiles>
void values_on(Tiles& tiles, const bf16* p, int64_t lp, const bf16* values, int64_t width, int64_t d, float* o) {
  const int64_t col_tiles = d / 16;
  for (int64_t c0 = 0; c0 < col_tiles; c0 += 2) {
    tiles.template zero<0>();
    tiles.template zero<1>();
    tiles.template zero<2>();
    tiles.template zero<3>();
    for (int64_t ks = 0; ks < width / kStep; ++ks) {
      const bf16* vt = values + (ks * col_tiles + c0) * 16 * 32;
      tiles.template load<4>(p + ks * kStep, lp);
      tiles.template load<6>(vt, 32);
      tiles.template load<7>(vt + 16 * 32, 32);
      tiles.template dot<0, 4, 6>();
      tiles.template dot<1, 4, 7>();
      tiles.template load<5>(p + 16 * lp + ks * kStep, lp);
      tiles.template dot<2, 5, 6>();
      tiles.template dot<3, 5, 7>();
    }
    tiles.template store<0>(o + 16 * c0, d);
    tiles.template store<1>(o + 16 * c0 + 16, d);
    tiles.template store<2>(o + 16 * d + 16 * c0, d);
    tiles.template store<3>(o + 16 * d + 16 * c0 + 16, d);
  }
}

// One work item: 32 query rows [32, D] (ld D) against one head's packed keys and values, `seen`
// keys visible to the last row, row r seeing keys first(r) .. visible(r) - 1 (none for a padding
// row, visible 0), all from key `from` on, a multiple of 32: the products skip the keys before
// it. Writes the rows' unnormalised outputs to o [32, D] and their 1 / sum to inv.
template <typename Tiles, typename Visible, typename First>
void attend_rows(Tiles& tiles, const bf16* q_rows, int64_t d, const bf16* keys, const bf16* values, int64_t from,
                 int64_t seen, Visible visible, First first, float scale, float* s, bf16* p, float* o, float* inv) {
  const int64_t width = round_up(seen, kStep);
  const int64_t ls = width + kPadF, lp = width + kPadB;
  // Key tiles of 16 keys by D; value steps of 32 keys by D (pack_keys, pack_values).
  scores_on(tiles, q_rows, d, keys + from * d, width - from, s + from, ls);
  // Softmax per row over its visible keys, rounded into p [32, width], zero outside them.
  for (int64_t r = 0; r < kRows; ++r) {
    bf16* pr = p + r * lp;
    const int64_t n = visible(r), f = n > 0 ? first(r) : from;
    std::fill(pr + from, pr + f, bf16(0.f));
    inv[r] = n > 0 ? 1.f / exp_into_bf16(s + r * ls + f, n - f, width - f, scale, pr + f) : 0.f;
    if (n == 0) std::fill(pr + from, pr + width, bf16(0.f));
  }
  values_on(tiles, p + from, lp, values + from * d, width - from, d, o);
}

template <typename Tiles>
void prefill_on_tiles(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, int64_t offset, float scale,
                      int64_t window, at::Tensor& out) {
  const int64_t tokens = q.size(0), hq = q.size(1), d = q.size(2), keys = key.size(0), hkv = key.size(1);
  const int64_t group = hq / hkv, rows = tokens * group, padded_rows = round_up(rows, kRows);
  // [Hkv, rows padded to 32, D]: each KV head's query rows, token by token, its G heads together.
  at::Tensor q_rows = at::empty({hkv, padded_rows, d}, q.options());
  q_rows.narrow(1, rows, padded_rows - rows).zero_();
  // One copy from q as it comes (often a strided view of the qkv projection's output).
  q_rows.narrow(1, 0, rows).view({hkv, tokens, group, d}).copy_(q.reshape({tokens, hkv, group, d}).transpose(0, 1));
  const int64_t padded_keys = round_up(keys, kStep);
  const int64_t head_pack = 2 * padded_keys * d;  // the keys' tiles, then the values'
  at::Tensor packing = at::empty({hkv * head_pack}, q.options());
  bf16* packed = packing.data_ptr<bf16>();
  const bf16* kp = key.data_ptr<bf16>();
  const bf16* vp = value.data_ptr<bf16>();
  at::parallel_for(0, 2 * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / 2;
      bf16* dst = packed + h * head_pack;
      if (item % 2 == 0) {
        pack_keys(kp + h * key.stride(1), key.stride(0), keys, d, dst);
      } else {
        pack_values(vp + h * value.stride(1), value.stride(0), keys, d, dst + padded_keys * d);
      }
    }
  });
  const bf16* qp = q_rows.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  // Work items (KV head, 32 rows). An item costs in proportion to the keys it sees, so items go
  // in pairs of a late and an early chunk, and each thread's contiguous share holds about as much.
  const int64_t chunks = padded_rows / kRows, items = hkv * chunks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Tiles tiles;
    // From ATen's allocator, which starts every block on a 64-byte line: the scores are tile stores
    // and the probabilities tile loads, and a tile row across two lines moves at half the rate.
    const at::Tensor scratch_f = at::empty({kRows * (padded_keys + kPadF) + kRows * d}, q.options().dtype(at::kFloat));
    const at::Tensor scratch_p = at::empty({kRows * (padded_keys + kPadB)}, q.options());
    float* const s = scratch_f.data_ptr<float>();
    float* const o = s + kRows * (padded_keys + kPadF);
    bf16* const p = scratch_p.data_ptr<bf16>();
    alignas(64) float inv[kRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / chunks, i = item % chunks;
      const int64_t chunk = i % 2 == 0 ? chunks - 1 - i / 2 : i / 2;
      const int64_t r0 = chunk * kRows, last = std::min(r0 + kRows, rows) - 1;
      const int64_t seen = offset + last / group + 1;
      const bf16* head = packed + h * head_pack;
      auto visible = [&](int64_t r) { return r0 + r < rows ? offset + (r0 + r) / group + 1 : int64_t{0}; };
      // A row at position pos sees keys pos - window + 1 .. pos through a window, all without one.
      auto first = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, visible(r) - window) : int64_t{0}; };
      const int64_t from = first(0) / kStep * kStep;
      attend_rows(tiles, qp + (h * padded_rows + r0) * d, d, head, head + padded_keys * d, from, seen, visible, first,
                  scale, s, p, o, inv);
      for (int64_t r = 0; r < kRows && r0 + r < rows; ++r) {
        const int64_t t = (r0 + r) / group, g = (r0 + r) % group;
        bf16* dst = op + (t * hq + h * group + g) * d;
        const float* src = o + r * d;
        for (int64_t j = 0; j < d; j += kVf) storef(dst + j, loadf(src + j) * inv[r]);
      }
    }
  });
}

}  // namespace

namespace pdserve_cpu {

at::Tensor prefill_attention_tiles(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, int64_t offset,
                                   double scale, int64_t window) {
  TORCH_CHECK(q.size(2) % kStep == 0, "pdserve_cpu.prefill_attention in bfloat16 takes head sizes that are multiples of ",
              kStep, ", got ", q.size(2));
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
#if defined(PDSERVE_AMX)
  if (pdserve_amx::ready()) {
    prefill_on_tiles<AmxTiles>(q, key, value, offset, static_cast<float>(scale), window, out);
    return out;
  }
#endif
#if defined(PDSERVE_AVX512_BF16)
  prefill_on_tiles<Avx512Bf16Blocks>(q, key, value, offset, static_cast<float>(scale), window, out);
#else
  prefill_on_tiles<PortableTiles>(q, key, value, offset, static_cast<float>(scale), window, out);
#endif
  return out;
}

}  // namespace pdserve_cpu
