// Work items handed out to an OpenMP team one at a time, from one atomic counter.
//
// `schedule(dynamic)` asks the OpenMP runtime for every item, and what that costs depends on the build
// of the runtime the host happens to load: Debian's LLVM libomp 16 formats its debug trace strings
// (vsnprintf) on each request, 2-3% of a 32-stream serving run's samples. A counter costs one atomic
// add an item on every runtime.
#pragma once

#include <atomic>
#include <cstdint>

namespace appliance {

class WorkQueue {
 public:
  explicit WorkQueue(int64_t items) : items_(items) {}
  // The next item for the calling thread, or -1 when none is left.
  int64_t take() {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    return i < items_ ? i : -1;
  }

 private:
  const int64_t items_;
  alignas(64) std::atomic<int64_t> next_{0};
};

// Row-wise kernels (norms, RoPE, cache writes, SiLU) with less work than this (elements) run on the
// calling thread: a decode step of a few sequences would spend more on waking the team and meeting it at
// the barrier than on the rows (10 parallel regions a layer, 300 a step of the default model). Batch-1
// decode step of the default spec, four alternated rounds on Zen 5: 3.25 -> 3.08 ms; batch 8 unchanged.
constexpr int64_t kParallelElements = 8192;

}  // namespace appliance
