// Units of work split across threads in contiguous shares, as at::parallel_for hands them out,
// with stealing: a thread that finishes its own share takes the units still left in the others'
// from their far end, one at a time, while their owners go on from the near end.
//
// Why: at batch 1 the main thread attends the step's one sequence while the other thread pulls
// the output projection's weight into its cache (decode_attention_then's `spare`); with even
// shares the second thread would wait at the projection's join for the main thread's share,
// which it holds in its own cache. Stealing gains at batch 1 and costs nothing at larger batches
// (python -m pdserve.bench.engine_overhead, decode batch 1, 8 and 32; docs/cpu_kernels.md
// "Tiles"). A thief's unit is the far end of the other's share, so the owner's stream through
// memory stays in order. Decode attention takes its sequences the same way (cpu_attention.cpp),
// for sequences of different lengths.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace pdserve_cpu {

class StealingShares {
 public:
  explicit StealingShares(int64_t units)
      : units_(units),
        threads_(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units))),
        chunk_((units + threads_ - 1) / threads_),
        shares_(new Share[threads_]) {
    for (int64_t t = 0; t < threads_; ++t)
      shares_[t].left.store(pack(std::min(units_, t * chunk_), end_of(t)), std::memory_order_relaxed);
  }
  // How many shares: run at::parallel_for(0, threads(), 1, ...) and run(t, f) for each t it gives
  // (parallel_for_stealing below).
  int64_t threads() const { return threads_; }
  // f(u, next) for the units share t's thread takes: its own from the front, `next` the unit after
  // u in the share (-1 after its last), then the others' from the back, `next` -1.
  template <typename F>
  void run(int64_t t, const F& f) {
    for (int64_t u; (u = take(shares_[t], true)) >= 0;) f(u, u + 1 < end_of(t) ? u + 1 : int64_t{-1});
    for (int64_t k = 1; k < threads_; ++k)
      for (int64_t u; (u = take(shares_[(t + k) % threads_], false)) >= 0;) f(u, int64_t{-1});
  }

 private:
  // What is left of a share, [front, back), in one word: both ends move under one compare-and-swap.
  struct alignas(64) Share {
    std::atomic<uint64_t> left{0};
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  // The unit at the share's front (or back), or -1 where none is left.
  static int64_t take(Share& s, bool front) {
    uint64_t v = s.left.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(v & 0xffffffffu), b = static_cast<int64_t>(v >> 32);
      if (f >= b) return -1;
      if (s.left.compare_exchange_weak(v, front ? pack(f + 1, b) : pack(f, b - 1), std::memory_order_relaxed))
        return front ? f : b - 1;
    }
  }
  // Where share t ends as handed out.
  int64_t end_of(int64_t t) const { return std::min(units_, (t + 1) * chunk_); }
  int64_t units_, threads_, chunk_;
  std::unique_ptr<Share[]> shares_;
};

// at::parallel_for over `units` units through StealingShares: each thread makes its own state
// once, `make()`, then calls f(state, u, next) for each unit it takes (`next` as in run).
template <typename Make, typename F>
void parallel_for_stealing(int64_t units, const Make& make, const F& f) {
  StealingShares shares(units);
  at::parallel_for(0, shares.threads(), 1, [&](int64_t begin, int64_t end) {
    auto state = make();
    for (int64_t t = begin; t < end; ++t) shares.run(t, [&](int64_t u, int64_t next) { f(state, u, next); });
  });
}

}  // namespace pdserve_cpu
