// y = x W^T in bfloat16 on AMX tiles, against a weight packed once into the tiles' own layout.
//
//   W [N, K]  ->  [G = ceil(N/32), K/32, 16, 2, 32]
//
// Element [g, kt, r, t, 2n + j] is W[32g + 16t + n, 32kt + 2r + j]: for each group of 32 output
// columns and each step of 32 along K, two 1 KiB AMX "B" tiles (16 rows of 16 column pairs, the
// pair-interleaved form TDPBF16PS reads) with their rows interleaved (row r of tile 0, row r of
// tile 1, ...: AMX loads each with a 128-byte stride, VDPBF16PS reads one k pair's 32 columns as
// 128 contiguous bytes), and a group's steps follow each other, so a thread's share of the weight
// streams from memory front to back in 2 KiB pieces.
// Rows of x go in chunks of 32, as two "A" tiles of up to 16 rows loaded straight from x; four
// float32 accumulator tiles hold the chunk's 32 x 32 outputs.
//
// Why: at decode sizes oneDNN's bfloat16 matmuls read the weights well below the rate a plain
// streaming loop reaches over the same tensors, and these tiles read them at about that rate; a
// decode step at batch 1-32 is bound by that read (python -m pdserve.bench.engine_overhead against
// --cpu-linear onednn; docs/cpu_kernels.md "Projections", "Tiles").
//
// Where the build has no AMX (every variant but amx, kernels/variants.py) or the kernel refuses
// the process AMX's register state (amx.h), the same layout runs on VDPBF16PS where the CPU has
// AVX512-BF16, else through a portable loop: slow, and never chosen by the runner (`tile_kernel`),
// but it keeps the layout and the chunking tested on every machine against the oracle x @ W.T.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "amx.h"
#include "ops.h"
#include "prefetch.h"
#include "vec.h"
#include "work_shares.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace {

constexpr int64_t kGroup = 32;       // output columns per group: two B tiles of 16
constexpr int64_t kStep = 32;        // K per step: one tile row of 32 bfloat16
constexpr int64_t kStepElems = 1024;  // bfloat16 elements in one step of a group (2 tiles)
constexpr int64_t kChunk = 32;       // rows of x per chunk: two A tiles of 16
constexpr int64_t kRowBlock = 8;     // rows of x per VDPBF16PS block (16 accumulators)

using bf16 = c10::BFloat16;

// Round a chunk's float32 results into y, `cols` of the group's 32 columns.
inline void write_rows(const float* acc, int rows, int64_t cols, bf16* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r) {
    const float* a = acc + r * kGroup;
    bf16* out = y + r * ldy;
    if (cols == kGroup) {
      store16(out, load16(a));
      store16(out + 16, load16(a + 16));
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = bf16(a[c]);
    }
  }
}

// x's rows as the caller passed them (bfloat16, row stride ldx): what AMX's A tiles and the
// portable loop read.
struct PlainRows {
  const bf16* x;
  int64_t ldx;
  PlainRows(const bf16* x_, int64_t ldx_, int64_t, int64_t) : x(x_), ldx(ldx_) {}
};

#if defined(PDSERVE_AMX)

// Tiles 0-3 accumulate (2h + t: rows of half h, columns of B tile t), 4-5 hold x's two halves,
// 6-7 the weight. A half with no rows keeps one row configured and is never used.
void configure(int rows0, int rows1) {
  pdserve_amx::TileConfig cfg;
  const int half1 = std::max(rows1, 1);
  const int rows[8] = {rows0, rows0, half1, half1, rows0, half1, 16, 16};
  for (int t = 0; t < 8; ++t) cfg.set(t, rows[t], 64);
  cfg.load();
}

// One chunk of rows (rows0 + rows1 <= 32) times one group, into acc [32, 32]. Prefetch: the
// weight streams from DRAM only in a group's first chunk; 8 KiB ahead (4 steps) beats the
// hardware prefetcher alone at batch 1-32, and 16 KiB ahead is slower (engine_overhead on AMX).
template <bool Prefetch>
void chunk_by_group(const bf16* x, int64_t ldx, int rows0, int rows1, const bf16* w, int64_t steps, float* acc) {
  constexpr int64_t kAhead = 4 * kStepElems;
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(bf16));
  _tile_zero(0);
  _tile_zero(1);
  if (rows1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const bf16* b = w + s * kStepElems;
    if (Prefetch) {
      for (int line = 0; line < 32; ++line) _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + line * 32), _MM_HINT_T0);
    }
    _tile_loadd(4, x + s * kStep, stride);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 32, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (rows1) {
      _tile_loadd(5, x + 16 * ldx + s * kStep, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kGroup * sizeof(float));
  _tile_stored(1, acc + 16, kGroup * sizeof(float));
  if (rows1) {
    _tile_stored(2, acc + 16 * kGroup, kGroup * sizeof(float));
    _tile_stored(3, acc + 16 * kGroup + 16, kGroup * sizeof(float));
  }
}

// One thread's multiplies on AMX: the tile configuration follows the chunk's row count (a thread
// loads its own; oneDNN sets its own too), and the tiles are released when the thread's share is done.
struct AmxChunks {
  using Rows = PlainRows;  // the A tiles load x's rows as they are
  const Rows& in;
  int rows0 = -1, rows1 = -1;
  explicit AmxChunks(const Rows& rows) : in(rows) {}
  void operator()(int64_t m0, int rows, const bf16* w, int64_t steps, bool from_memory, float* acc) {
    const bf16* x = in.x + m0 * in.ldx;
    const int64_t ldx = in.ldx;
    const int r0 = std::min(rows, 16), r1 = rows - r0;
    if (r0 != rows0 || r1 != rows1) {
      configure(r0, r1);
      rows0 = r0;
      rows1 = r1;
    }
    if (from_memory) {
      chunk_by_group<true>(x, ldx, r0, r1, w, steps, acc);
    } else {
      chunk_by_group<false>(x, ldx, r0, r1, w, steps, acc);
    }
  }
  void operator()(int64_t m0, int rows, const bf16* w, int64_t steps, bool from_memory, float* acc,
                  pdserve_cpu::PrefetchCursor&) {  // no background prefetch: not benchmarked on AMX
    (*this)(m0, rows, w, steps, from_memory, acc);
  }
  ~AmxChunks() { _tile_release(); }
};

#endif

#if defined(PDSERVE_AVX512_BF16)

// R rows of x (R <= 8) times one group, into acc rows [R, 32], with VDPBF16PS: for each pair of k,
// the two B tiles' rows (16 columns each) are two registers, each row's pair of x is broadcast,
// and 2R float32 accumulators stay in registers over the whole of K. A weight register feeds R
// rows; at R = 8 there are 16 independent chains, enough to hide the instruction's latency.
//
// Prefetch (the block that reads the weight from memory): each k pair's two lines 16 KiB ahead
// (8 steps) into L2, one pair of prefetches per pair of loads: from 1 to 8 rows this streams the
// weights at the rate of a bare load loop over the same bytes. The AMX path's burst of 32
// prefetches into L1 a step fills L1's miss buffers here, and the loads behind it wait
// (engine_overhead's matmuls column, decode batch 1 and 8; docs/cpu_kernels.md "Tiles").
//
// `background` (the next layer's KV, prefetch.h) and `next` (the next group's weight) trickle
// their lines one each per k pair, between the block's own loads.
//
// The cursors are copied in and back out: through the references GCC kept their state in memory,
// loaded and stored again at every k pair.
//
// x holds each k pair of the R rows side by side, Pitch pairs from one k pair to the next: a
// PairRows block: Pitch 8, or 2 or 4 for that few rows.
template <int R, int Pitch, bool Prefetch, bool Trickle>
void rows_by_group(const int32_t* x, const bf16* w, int64_t steps, float* acc,
                   pdserve_cpu::PrefetchCursor& background_, pdserve_cpu::PrefetchCursor& next_) {
  constexpr int64_t kAhead = pdserve_cpu::kTileOwnPrefetchBytes / static_cast<int64_t>(sizeof(bf16));
  pdserve_cpu::PrefetchCursor background = background_, next = next_;
  __m512 c[R][2];
  for (int m = 0; m < R; ++m) c[m][0] = c[m][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const bf16* b = w + s * kStepElems;
    const int32_t* xs = x + s * (kStep / 2) * Pitch;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (Prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + r * 64), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + r * 64 + 32), _MM_HINT_T1);
      }
      if constexpr (Trickle) {
        background.one();
        next.one();
      }
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + r * 64));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + r * 64 + 32));
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        const __m512bh a = pdserve_amx::broadcast_pair(xs + r * Pitch + m);
        c[m][0] = _mm512_dpbf16_ps(c[m][0], a, w0);
        c[m][1] = _mm512_dpbf16_ps(c[m][1], a, w1);
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_store_ps(acc + m * kGroup, c[m][0]);
    _mm512_store_ps(acc + m * kGroup + 16, c[m][1]);
  }
  if constexpr (Trickle) {
    background_ = background;
    next_ = next;
  }
}

// The kernel for R = `rows` (1 .. Max; more counts as Max) rows at pitch P, R known at compile time.
template <int P, int Max, bool Prefetch, bool Trickle>
void rows_by_group_upto(int rows, const int32_t* x, const bf16* w, int64_t steps, float* acc,
                        pdserve_cpu::PrefetchCursor& background, pdserve_cpu::PrefetchCursor& next) {
  if constexpr (Max > 1) {
    if (rows < Max) return rows_by_group_upto<P, Max - 1, Prefetch, Trickle>(rows, x, w, steps, acc, background, next);
  }
  rows_by_group<Max, P, Prefetch, Trickle>(x, w, steps, acc, background, next);
}

// The kernel for `rows` rows at `pitch` (at most as many rows as the pitch holds), with the
// cursors' prefetches in its loop only where either has lines to prefetch: most calls have none
// (every step of fewer than 16 rows), and their loop then holds nothing but the weight's own
// loads, prefetches and products. A block of pitch 2 always runs both rows: a lone row's pair is
// zero (PairRows), and the two-row kernel streams the weight faster than a one-row one.
template <bool Prefetch, bool Trickle>
void rows_by_group_r(int rows, const int32_t* x, int pitch, const bf16* w, int64_t steps, float* acc,
                     pdserve_cpu::PrefetchCursor& background, pdserve_cpu::PrefetchCursor& next) {
  switch (pitch) {
    case 2: return rows_by_group<2, 2, Prefetch, Trickle>(x, w, steps, acc, background, next);
    case 4: return rows_by_group_upto<4, 4, Prefetch, Trickle>(rows, x, w, steps, acc, background, next);
    default: return rows_by_group_upto<kRowBlock, kRowBlock, Prefetch, Trickle>(rows, x, w, steps, acc, background, next);
  }
}

template <bool Prefetch>
void rows_by_group_any(int rows, const int32_t* x, int pitch, const bf16* w, int64_t steps, float* acc,
                       pdserve_cpu::PrefetchCursor& background, pdserve_cpu::PrefetchCursor& next) {
  if (background.active() || next.active())
    return rows_by_group_r<Prefetch, true>(rows, x, pitch, w, steps, acc, background, next);
  rows_by_group_r<Prefetch, false>(rows, x, pitch, w, steps, acc, background, next);
}

// x's rows as VDPBF16PS broadcasts them, packed once per call for every thread and group: blocks
// of 8 rows, each [K/2, 8] pairs of bfloat16 (one int32 each), the 8 rows' pairs for one k pair
// side by side. The kernel then finds each broadcast at a constant offset from one pointer that
// moves by 512 bytes a step. Straight from x, each of the 8 rows needs its own pointer, and with
// the k loop unrolled GCC keeps them on the stack: loads competing with the weight's and x's for
// the load ports.
//
// A block is an 8 x K/2 transpose of int32, 8 x 8 at a time in AVX2 registers, its rows past x's
// last zero, a partial last block included: packed one int32 at a time, on one thread while the
// other waits, it would be a visible part of a batch-32 decode step (engine_overhead, batch 32;
// docs/cpu_kernels.md "Tiles").
//
// Two to four rows pack into a block only as wide as they need, 2 or 4 pairs a k pair, rather than
// one of 8 that is mostly zeros (engine decode steps at batch 2 to 4; docs/cpu_kernels.md "Tiles").
//
// One row packs as two, the second zero, and runs the two-row kernel (rows_by_group_r), whose
// second row's products are wasted: a one-row step streams its weights faster that way than the
// one-row kernel reading x's pairs where they lie (Pitch 1), and a block of 8 pairs would wait on
// DRAM for a buffer four times as large (engine_overhead, decode batch 1; docs/cpu_kernels.md
// "Tiles").
struct PairRows {
  // out[p * P + r] = pair p of row r (x's rows at stride ldx) for the first `rows` (<= P) rows,
  // zero for the rest of the P; P 2, 4 or 8, half_k % 8 == 0. Eight pairs of each row at a time:
  // their int32s interleaved row by row (unpacklo/hi_epi32, then _epi64 from 4 rows), per 128-bit
  // lane, whose halves (pairs 0-3 and 4-7) are then put in order.
  template <int P>
  static void transpose(const bf16* x, int64_t ldx, int64_t rows, int64_t half_k, int32_t* out) {
    static_assert(P == 2 || P == 4 || P == 8, "2, 4 or 8 rows");
    for (int64_t p = 0; p < half_k; p += 8) {
      __m256i r[P];
      for (int i = 0; i < P; ++i)
        r[i] = i < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ldx + 2 * p))
                        : _mm256_setzero_si256();
      __m256i t[P];  // pairs (j, j + 1) of rows 2i, 2i + 1, j even, per lane
      for (int i = 0; i < P / 2; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      __m256i* o = reinterpret_cast<__m256i*>(out + p * P);
      if constexpr (P == 2) {  // t0: pairs 0, 1 (lane 0) and 4, 5; t1: 2, 3 and 6, 7
        _mm256_storeu_si256(o, _mm256_permute2x128_si256(t[0], t[1], 0x20));
        _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(t[0], t[1], 0x31));
        continue;
      }
      __m256i u[P];  // rows 4h .. 4h + 3 of one pair, per lane: u[4h + j] holds pair j and j + 4
      for (int h = 0; h < P / 4; ++h) {
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
      }
      if constexpr (P == 4) {  // two pairs a register
        for (int j = 0; j < 4; j += 2) {
          _mm256_storeu_si256(o + j / 2, _mm256_permute2x128_si256(u[j], u[j + 1], 0x20));
          _mm256_storeu_si256(o + 2 + j / 2, _mm256_permute2x128_si256(u[j], u[j + 1], 0x31));
        }
      } else {  // one pair a register: rows 0-3 from u[j], 4-7 from u[4 + j]
        for (int j = 0; j < 4; ++j) {
          _mm256_storeu_si256(o + j, _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
          _mm256_storeu_si256(o + 4 + j, _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
        }
      }
    }
  }

  at::Tensor pairs;  // int32 [ceil(M / 8), K / 2, 8], or [K / 2, pitch] for 1 to 4 rows
  int64_t half_k;
  const int32_t* data;  // pairs.data_ptr()
  int pitch_;
  PairRows(const bf16* x, int64_t ldx, int64_t m, int64_t k)
      : half_k(k / 2), pitch_(m <= 2 ? 2 : m <= 4 ? 4 : static_cast<int>(kRowBlock)) {
    const int64_t blocks = (m + pitch_ - 1) / pitch_;  // one where the pitch is under 8
    pairs = at::empty({blocks, half_k, pitch_}, at::kInt);
    int32_t* out = pairs.data_ptr<int32_t>();
    data = out;
    if (pitch_ < kRowBlock) {
      (pitch_ == 2 ? transpose<2> : transpose<4>)(x, ldx, m, half_k, out);
      return;
    }
    // Decode-sized x packs on the calling thread: a fork and join costs more than the packing.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (half_k * kRowBlock));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        transpose<kRowBlock>(x + b * kRowBlock * ldx, ldx, std::min<int64_t>(kRowBlock, m - b * kRowBlock), half_k,
                             out + b * half_k * kRowBlock);
    });
  }
  // m0 a multiple of 8: 0 wherever the pitch is under 8.
  const int32_t* block(int64_t m0) const { return data + m0 / kRowBlock * half_k * kRowBlock; }
  // Pairs from one k pair to the next in block(m0).
  int pitch() const { return pitch_; }
};

// One thread's multiplies with VDPBF16PS: a chunk's rows in blocks of 8. The block that reads
// the group's weight from memory prefetches it, as the AMX path does; the others find it in L2.
// With more than one block (more than 8 rows: bound by compute), every block of the chunk also
// prefetches its share of the weight that follows this one in memory, the thread's next group
// (for a gate/up weight, packed in pairs, the pair's up group or the next pair's gate group), so
// that memory keeps streaming while the later blocks compute from L2, and the next group's first
// block finds its weight in L2 instead of waiting on DRAM. (After a thread's last group that is the next thread's weight, or
// past the packed weight's end: a prefetch never faults.)
//
// A chunk of up to kTileHardwareStreamRows rows (ops.h) leaves out the prefetch of its own weight
// where the weights lie on transparent huge pages (`tile_weights_on_huge_pages`): there the hardware
// prefetcher streams them faster than with the 16 KiB-ahead prefetches, whose two instructions
// per k pair are a large part of such a small chunk's work. Larger chunks keep them (there they
// cost nothing or help), and so do weights on 4 KiB pages, where the hardware prefetcher stops at
// every page (engine_overhead, decode batch 1 and 8; docs/cpu_kernels.md "Tiles").

struct Avx512Bf16Chunks {
  using Rows = PairRows;
  const Rows& in;
  explicit Avx512Bf16Chunks(const Rows& rows) : in(rows) {}
  void operator()(int64_t m0, int rows, const bf16* w, int64_t steps, bool from_memory, float* acc,
                  pdserve_cpu::PrefetchCursor& background) const {
    const int blocks = (rows + kRowBlock - 1) / kRowBlock;
    const bool own = from_memory && (rows > pdserve_cpu::kTileHardwareStreamRows || !pdserve_cpu::tile_weights_on_huge_pages());
    const bool ahead = from_memory && blocks > 1;
    const int64_t lines = steps * kStepElems * static_cast<int64_t>(sizeof(bf16)) / pdserve_cpu::kLineBytes;
    const auto after = pdserve_cpu::BackgroundPrefetch::run(w + steps * kStepElems, lines);
    for (int b = 0; b < blocks; ++b) {
      const int m = b * kRowBlock, n = std::min<int>(kRowBlock, rows - m);
      const auto block = own && m == 0 ? rows_by_group_any<true> : rows_by_group_any<false>;
      auto next = ahead ? pdserve_cpu::PrefetchCursor(after, lines * b / blocks, lines * (b + 1) / blocks)
                        : pdserve_cpu::PrefetchCursor();
      block(n, in.block(m0 + m), in.pitch(), w, steps, acc + m * kGroup, background, next);
      next.rest();
    }
  }
};

#endif

// The same layout without tiles: what TDPBF16PS computes, one row of x at a time.
struct PortableChunks {
  using Rows = PlainRows;
  const Rows& in;
  explicit PortableChunks(const Rows& rows) : in(rows) {}
  void operator()(int64_t m0, int rows, const bf16* w, int64_t steps, bool, float* acc,
                  pdserve_cpu::PrefetchCursor&) const {
    const bf16* x = in.x + m0 * in.ldx;
    const int64_t ldx = in.ldx;
    std::fill(acc, acc + kChunk * kGroup, 0.f);
    for (int m = 0; m < rows; ++m) {
      const bf16* xr = x + m * ldx;
      float* a = acc + m * kGroup;
      for (int64_t s = 0; s < steps; ++s) {
        for (int t = 0; t < 2; ++t) {
          const bf16* b = w + s * kStepElems + t * 32;
          for (int r = 0; r < 16; ++r) {
            const float x0 = xr[s * kStep + 2 * r], x1 = xr[s * kStep + 2 * r + 1];
            for (int c = 0; c < 16; ++c) a[16 * t + c] += x0 * float(b[r * 64 + 2 * c]) + x1 * float(b[r * 64 + 2 * c + 1]);
          }
        }
      }
    }
  }
};

// Rows of x go in blocks that stay in L2 while every group of the weight passes by (each block
// reads the weight once more): without them a long prefill re-reads all of x from memory for each
// group of 32 columns.
constexpr int64_t kBlockBytes = 512 * 1024;

// The loop both ops share: within a block of rows, each thread takes a share of the weight's
// `units` (groups of 32 columns, or gate/up pairs of them), then what is left of the other
// threads' shares from their far ends (work_shares.h), and calls
// `per_chunk(chunks, unit, m0, rows, first, acc, background)` for each chunk of up to 32 rows from
// row m0; `first` marks the block's first chunk, which reads the unit's weight from memory.
// `Chunks` multiplies (one per thread: AMX tiles, VDPBF16PS or the portable loop). `background`
// (may be empty) is spread over the first block's units: each unit trickles an equal share of it
// and issues what is left when the unit ends.
template <typename Chunks, typename PerChunk>
void by_row_blocks(const typename Chunks::Rows& xr, int64_t rows, int64_t steps, int64_t units,
                   const pdserve_cpu::PrefetchRange& background, const PerChunk& per_chunk) {
  const int64_t row_bytes = steps * kStep * static_cast<int64_t>(sizeof(bf16));
  const int64_t block = std::max(kChunk, kBlockBytes / row_bytes / kChunk * kChunk);
  struct Thread {  // a thread's multiplier and accumulators, left uninitialised
    Chunks chunks;
    alignas(64) float acc[kChunk * kGroup];
    explicit Thread(const typename Chunks::Rows& rows) : chunks(rows) {}
  };
  for (int64_t b0 = 0; b0 < rows; b0 += block) {
    const int64_t b_end = std::min(rows, b0 + block);
    pdserve_cpu::parallel_for_stealing(units, [&] { return Thread(xr); }, [&](Thread& th, int64_t u, int64_t) {
      auto cursor = b0 == 0 ? background.share(u, units) : pdserve_cpu::PrefetchCursor();
      for (int64_t m0 = b0; m0 < b_end; m0 += kChunk)
        per_chunk(th.chunks, u, m0, static_cast<int>(std::min(kChunk, b_end - m0)), m0 == b0, th.acc, cursor);
      cursor.rest();
    });
  }
}

// run(std::type_identity<Chunks>{}) with the multiplier this process uses: AMX tiles where they
// run, else VDPBF16PS where the CPU has AVX512-BF16, else the portable loop.
template <typename Run>
void with_chunks(const Run& run) {
#if defined(PDSERVE_AMX)
  if (pdserve_amx::ready()) return run(std::type_identity<AmxChunks>{});
#endif
#if defined(PDSERVE_AVX512_BF16)
  run(std::type_identity<Avx512Bf16Chunks>{});
#else
  run(std::type_identity<PortableChunks>{});
#endif
}

}  // namespace

namespace pdserve_cpu {

namespace {
std::atomic<bool> weights_on_huge_pages{false};
}  // namespace

bool tile_weights_on_huge_pages() { return weights_on_huge_pages.load(std::memory_order_relaxed); }

void set_tile_weights_on_huge_pages(bool on) { weights_on_huge_pages.store(on, std::memory_order_relaxed); }

bool tile_linear_uses_amx() { return pdserve_amx::ready(); }

std::string tile_kernel() { return pdserve_amx::tile_kernel(); }

namespace {

// The checks both ops share; x with contiguous rows.
at::Tensor checked_rows(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "pdserve_cpu.", op, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "pdserve_cpu.", op,
              " computes bfloat16, got x ", x.scalar_type(), " and weight ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 16 && packed.size(3) == 2 && packed.size(4) == 32 &&
                  packed.is_contiguous(),
              "the weight must be a contiguous [G, K/32, 16, 2, 32] (kernels/cpu_linear.py pack_tiles), got ",
              packed.sizes());
  TORCH_CHECK(x.size(1) == packed.size(1) * kStep, "x has ", x.size(1), " features, the weight takes ",
              packed.size(1) * kStep);
  return x.stride(1) == 1 ? x : x.contiguous();
}

}  // namespace

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const PrefetchRange& background) {
  const at::Tensor xc = checked_rows("tile_linear", x, packed);
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kGroup && out_features <= packed.size(0) * kGroup,
              "out_features ", out_features, " does not fit ", packed.size(0), " groups of ", kGroup);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  const auto* xp = xc.data_ptr<bf16>();
  const auto* wp = packed.data_ptr<bf16>();
  auto* yp = y.data_ptr<bf16>();
  const int64_t ldx = xc.stride(0), steps = packed.size(1), group_elems = steps * kStepElems, n = out_features;
  with_chunks([&]<typename Chunks>(std::type_identity<Chunks>) {
    const typename Chunks::Rows xr(xp, ldx, xc.size(0), xc.size(1));
    by_row_blocks<Chunks>(xr, xc.size(0), steps, packed.size(0), background,
                          [&](Chunks& chunks, int64_t g, int64_t m0, int rows, bool first, float* acc,
                              PrefetchCursor& cursor) {
                            chunks(m0, rows, wp + g * group_elems, steps, first, acc, cursor);
                            write_rows(acc, rows, std::min(kGroup, n - g * kGroup), yp + m0 * n + g * kGroup, n);
                          });
  });
  return y;
}

bool tile_fuses_silu_mul(const at::Tensor& packed, int64_t intermediate) {
  return packed.dim() == 5 && intermediate > 0 && intermediate % kGroup == 0 &&
         packed.size(0) * kGroup == 2 * intermediate;
}

at::Tensor tile_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                                const PrefetchRange& background) {
  const at::Tensor xc = checked_rows("tile_linear_silu_mul", x, packed);
  TORCH_CHECK(tile_fuses_silu_mul(packed, intermediate), "tile_linear_silu_mul needs a gate/up weight of 2 x ",
              intermediate, " columns in whole groups of ", kGroup, ", got ", packed.sizes());
  at::Tensor y = at::empty({x.size(0), intermediate}, x.options());
  if (x.size(0) == 0) return y;
  const auto* xp = xc.data_ptr<bf16>();
  const auto* wp = packed.data_ptr<bf16>();
  auto* yp = y.data_ptr<bf16>();
  // Pair p is the gate's group p and the up's group I/32 + p, packed side by side as groups 2p
  // and 2p + 1 (kernels/cpu_linear.py pack_gate_up_tiles): a thread's pairs are one stream through
  // memory. Both products of a chunk are rounded to bfloat16 as the projection's output would be,
  // then silu_mul_row (vec.h, the op's own row function) takes those 32 columns. The same bits as
  // silu_mul of the projection's columns put back in order, without writing the [M, 2 I]
  // projection and reading it back in a second parallel pass.
  //
  // With the up's groups in the second half of the weight (as the projection lies), each thread
  // would read two streams 1.8 MB apart (SmolLM2), slower than one stream over the same bytes
  // (engine_overhead, decode batch 1 and 8; docs/cpu_kernels.md "Tiles").
  const int64_t ldx = xc.stride(0), pairs = intermediate / kGroup, steps = packed.size(1);
  const int64_t group_elems = steps * kStepElems;
  with_chunks([&]<typename Chunks>(std::type_identity<Chunks>) {
    const typename Chunks::Rows xr(xp, ldx, xc.size(0), xc.size(1));
    by_row_blocks<Chunks>(xr, xc.size(0), steps, pairs, background,
                          [&](Chunks& chunks, int64_t p, int64_t m0, int rows, bool first, float* acc,
                              PrefetchCursor& cursor) {
                            alignas(64) bf16 gate[kChunk * kGroup], up[kChunk * kGroup];
                            chunks(m0, rows, wp + 2 * p * group_elems, steps, first, acc, cursor);
                            write_rows(acc, rows, kGroup, gate, kGroup);
                            chunks(m0, rows, wp + (2 * p + 1) * group_elems, steps, first, acc, cursor);
                            write_rows(acc, rows, kGroup, up, kGroup);
                            for (int r = 0; r < rows; ++r)
                              silu_mul_row(gate + r * kGroup, up + r * kGroup, yp + (m0 + r) * intermediate + p * kGroup,
                                           kGroup);
                          });
  });
  return y;
}

}  // namespace pdserve_cpu
