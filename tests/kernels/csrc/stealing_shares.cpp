// A test-only op, torch.ops.pdserve_cpu_testing.stealing_shares_trace: how parallel_for_stealing
// (kernels/csrc/work_shares.h: the tiles' and decode attention's work split) hands out units.
// Built by tests/kernels/test_work_shares.py; never part of the production library.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "work_shares.h"

#include <chrono>
#include <cstdint>
#include <thread>

namespace {

// [2, units] int64: how many times each unit ran and the thread that ran it last, on the current
// thread count; thread 0 sleeps `slow_us` microseconds after each unit, so that the others steal
// from it.
at::Tensor stealing_shares_trace(int64_t units, int64_t slow_us) {
  TORCH_CHECK(units >= 0 && slow_us >= 0, "units and slow_us must not be negative");
  at::Tensor trace = at::zeros({2, units}, at::kLong);
  int64_t* count = trace.data_ptr<int64_t>();
  int64_t* by = count + units;
  pdserve_cpu::parallel_for_stealing(units, [] { return at::get_thread_num(); }, [&](int thread, int64_t u, int64_t) {
    __atomic_fetch_add(count + u, 1, __ATOMIC_RELAXED);
    by[u] = thread;
    if (thread == 0 && slow_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
  });
  return trace;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu_testing, m) {
  m.def("stealing_shares_trace(int units, int slow_us) -> Tensor", &stealing_shares_trace);
}
