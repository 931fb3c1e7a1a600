// Work items handed out to an OpenMP team one at a time, from one atomic counter.
//
// `schedule(dynamic)` asks the OpenMP runtime for every item, and what that costs depends on the build
// of the runtime the host happens to load: Debian's LLVM libomp 16 formats its debug trace strings
// (vsnprintf) on each request, 2-3% of a 32-stream serving run's samples. A counter costs one atomic
// add an item on every runtime.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

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

// The same items split into one contiguous range per thread: a thread takes its own range's items from
// the front, then (its range done, or never started by a thread the team lacks) the others' the same way.
// Every take is an atomic add on the taker's own cache line, where one shared counter's line went back
// and forth between the cores at each take (80% of `run`'s own samples, 3.4% of a batch-8 decode step
// on Zen 5); a preempted thread's items are still taken by the others; and a thread knows which item
// it takes next while it has its own left (`next`), which tiles use to prefetch. Decode steps of the
// default spec (context 300), alternated rounds on Zen 5: batch 3 3.91 -> 3.64 ms, batch 8 7.74 -> 7.14,
// batch 32 23.5 -> 22.8; 8 x 256-token prefill 780 -> 748 ms.
class RangeQueue {
 public:
  RangeQueue(int64_t items, int threads) : threads_(threads), ranges_(new Range[threads]) {
    for (int t = 0; t < threads; ++t) {
      ranges_[t].next.store(items * t / threads, std::memory_order_relaxed);
      ranges_[t].end = items * (t + 1) / threads;
    }
  }
  int64_t take(int thread) {
    for (int k = 0; k < threads_; ++k) {
      Range& r = ranges_[(thread + k) % threads_];
      if (r.next.load(std::memory_order_relaxed) >= r.end) continue;  // no write to a line that is done
      const int64_t i = r.next.fetch_add(1, std::memory_order_relaxed);
      if (i < r.end) return i;
    }
    return -1;
  }
  // The item `thread` will take next from its own range, or -1 (a guess: another thread may take it first)
  int64_t next(int thread) const {
    const Range& r = ranges_[thread % threads_];
    const int64_t i = r.next.load(std::memory_order_relaxed);
    return i < r.end ? i : -1;
  }

 private:
  struct alignas(64) Range {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  const int threads_;
  std::unique_ptr<Range[]> ranges_;
};

// Row-wise kernels (norms, RoPE, cache writes, SiLU) with less work than this (elements) run on the
// calling thread: a decode step of a few sequences would spend more on waking the team and meeting it at
// the barrier than on the rows (10 parallel regions a layer, 300 a step of the default model). Batch-1
// decode step of the default spec, four alternated rounds on Zen 5: 3.25 -> 3.08 ms; batch 8 unchanged.
constexpr int64_t kParallelElements = 8192;

}  // namespace appliance
