// Memory a kernel prefetches in the background of its own work, a line at a time between its own
// loads: the next layer's KV cache while this layer's MLP multiplies, or where each thread's
// stream of the next projection starts (cpu_decoder_layer.cpp); the keys of a thread's next
// sequence while decode attention sums the values of this one, and the next weights on a thread
// left without a sequence (cpu_attention.cpp).
//
// Why: at batch 32 a decode step's projections are bound by compute (the weights stream in a
// fraction of their time), and decode attention then reads its KV from DRAM with the vector units
// nearly idle: one after the other the two cost their sum, where the roofline is the larger of
// them. Prefetched into L2 during the MLP, the KV spills into L3 (on Zen 4 a victim cache of L2)
// and attention reads it from there (python -m pdserve.bench.engine_overhead, decode batch 32,
// against --no-kv-prefetch; docs/cpu_kernels.md "Elementwise ops and the decoder layers in one
// call").
#pragma once

#include <algorithm>
#include <cstdint>

namespace pdserve_cpu {

constexpr int64_t kLineBytes = 64;

// Spans of memory at base + offsets[i] (bytes), span_lines cache lines each, prefetched in the
// order given. The offsets are the same for every layer of a step (cpu_decoder_layer.cpp): only
// the base moves.
struct BackgroundPrefetch {
  const char* base = nullptr;
  const int64_t* offsets = nullptr;
  int64_t spans = 0, span_lines = 0;
  int64_t lines() const { return spans * span_lines; }
  // The `lines` lines from `at` on, as one span.
  static BackgroundPrefetch run(const void* at, int64_t lines) {
    static constexpr int64_t kFromBase[1] = {0};
    return {static_cast<const char*>(at), kFromBase, 1, lines};
  }
};

// Lines [begin, end) of a BackgroundPrefetch's spans, taken in order (a thread's share of them,
// or a part of one weight): `one()` prefetches the next line into L2 (a no-op once they are
// done). Counters, not a division per line: it runs in the kernels' inner loops. The offsets
// must outlive the cursor.
class PrefetchCursor {
 public:
  PrefetchCursor() = default;
  PrefetchCursor(const BackgroundPrefetch& bp, int64_t begin, int64_t end) {
    end = std::min(end, bp.lines());
    if (bp.span_lines <= 0 || begin >= end) return;
    base_ = bp.base;
    offsets_ = bp.offsets;
    span_lines_ = bp.span_lines;
    span_ = begin / span_lines_;
    const int64_t offset = begin % span_lines_;
    ptr_ = base_ + offsets_[span_] + offset * kLineBytes;
    in_span_ = span_lines_ - offset;
    left_ = end - begin;
  }
  // Forced inline: the kernels call it twice per k pair in loops unrolled 16 times, past GCC's
  // inlining budget, and there an out-of-line call (through the PLT) spilled the accumulators
  // to the stack and back around it, at every k pair.
  __attribute__((always_inline)) inline void one() {
    if (left_ == 0) return;
    __builtin_prefetch(ptr_, 0, 2);  // read, into L2 (x86: PREFETCHT1)
    ptr_ += kLineBytes;
    if (__builtin_expect(--left_ != 0 && --in_span_ == 0, 0)) {
      ptr_ = base_ + offsets_[++span_];
      in_span_ = span_lines_;
    }
  }
  // Whether any line is left: the kernels pick a loop without the cursors when none is.
  bool active() const { return left_ != 0; }
  int64_t left() const { return left_; }
  // The next `count` lines (fewer where fewer are left).
  __attribute__((always_inline)) inline void some(int64_t count) {
    for (int64_t i = 0; i < count; ++i) one();
  }
  // Whatever is left, at once.
  void rest() {
    while (left_ != 0) one();
  }

 private:
  const char* base_ = nullptr;
  const int64_t* offsets_ = nullptr;
  const char* ptr_ = nullptr;
  int64_t span_lines_ = 0, span_ = 0, in_span_ = 0, left_ = 0;
};

// Lines [first, last) of a BackgroundPrefetch, for one kernel call to spread over its units of
// work (empty: nothing to prefetch).
struct PrefetchRange {
  const BackgroundPrefetch* bp = nullptr;
  int64_t first = 0, last = 0;
  // All of `bp`'s lines (which must outlive the range).
  static PrefetchRange all(const BackgroundPrefetch& bp) { return {&bp, 0, bp.lines()}; }
  // Unit `part` of `parts`: an equal share of the range.
  PrefetchCursor share(int64_t part, int64_t parts) const {
    if (bp == nullptr) return {};
    const int64_t n = last - first;
    return {*bp, first + n * part / parts, first + n * (part + 1) / parts};
  }
};

}  // namespace pdserve_cpu
