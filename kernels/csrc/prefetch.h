// Memory a kernel prefetches in the background of its own work, a line at a time between its own
// loads: the next layer's KV cache while this layer's MLP multiplies (cpu_decoder_layer.cpp).
//
// Why: at batch 32 a decode step's projections are bound by compute (the weights stream in a
// third of their time), and decode attention then reads its KV from DRAM with the vector units
// nearly idle: on a 2-core Zen 4 the two ran one after the other, 24 + 8 ms, where the roofline
// is the larger of the two rates, not their sum. Prefetched into L2 during the MLP, the KV spills
// into L3 (on Zen 4 a victim cache of L2, 32 MiB) and attention reads it from there.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdserve_cpu {

constexpr int64_t kLineBytes = 64;

// Spans of memory, span_lines cache lines each, prefetched in the order given.
struct BackgroundPrefetch {
  std::vector<const char*> spans;
  int64_t span_lines = 0;
  int64_t lines() const { return static_cast<int64_t>(spans.size()) * span_lines; }
};

// One thread's share of a BackgroundPrefetch, lines [begin, end): `one()` prefetches the next
// line into L2 (a no-op once the share is done). Counters, not a division per line: it runs in
// the kernels' inner loops.
class PrefetchCursor {
 public:
  PrefetchCursor() = default;
  PrefetchCursor(const BackgroundPrefetch* bp, int64_t begin, int64_t end) {
    if (bp == nullptr || bp->span_lines == 0) return;
    end = std::min(end, bp->lines());
    if (begin >= end) return;
    spans_ = bp->spans.data();
    span_lines_ = bp->span_lines;
    span_ = begin / span_lines_;
    const int64_t offset = begin % span_lines_;
    ptr_ = spans_[span_] + offset * kLineBytes;
    in_span_ = span_lines_ - offset;
    left_ = end - begin;
  }
  // Part `part` of `parts` equal parts of the `lines` lines from `start`.
  static PrefetchCursor contiguous(const char* start, int64_t lines, int64_t part, int64_t parts) {
    PrefetchCursor c;
    const int64_t begin = lines * part / parts, end = lines * (part + 1) / parts;
    if (begin >= end) return c;
    c.ptr_ = start + begin * kLineBytes;
    c.left_ = c.in_span_ = end - begin;
    return c;
  }
  // Share `part` of `parts` equal shares of lines [first, last).
  static PrefetchCursor share(const BackgroundPrefetch* bp, int64_t first, int64_t last, int64_t part,
                              int64_t parts) {
    const int64_t n = last - first;
    return PrefetchCursor(bp, first + n * part / parts, first + n * (part + 1) / parts);
  }
  inline void one() {
    if (left_ == 0) return;
    __builtin_prefetch(ptr_, 0, 2);  // read, into L2 (x86: PREFETCHT1)
    ptr_ += kLineBytes;
    if (--left_ != 0 && --in_span_ == 0) {
      ptr_ = spans_[++span_];
      in_span_ = span_lines_;
    }
  }
  // Whatever of the share is left, at once.
  void rest() {
    while (left_ != 0) one();
  }

 private:
  const char* const* spans_ = nullptr;
  const char* ptr_ = nullptr;
  int64_t span_lines_ = 0, span_ = 0, in_span_ = 0, left_ = 0;
};

// Lines [first, last) of a BackgroundPrefetch, for one kernel call to spread over its units of
// work (empty: nothing to prefetch).
struct PrefetchRange {
  const BackgroundPrefetch* bp = nullptr;
  int64_t first = 0, last = 0;
  PrefetchCursor share(int64_t part, int64_t parts) const {
    return bp == nullptr ? PrefetchCursor() : PrefetchCursor::share(bp, first, last, part, parts);
  }
};

}  // namespace pdserve_cpu
