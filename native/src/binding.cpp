// Thread pinning and NUMA memory binding for the calling process, with a readable report.
//
// Each OpenMP thread pins itself from inside a parallel region, so the threads pinned are the very
// pool later kernels (and torch's, which shares this OpenMP runtime) run on. libnuma is loaded with
// dlopen: a machine without it still runs, and the report says memory was not bound.
#include <dlfcn.h>
#include <cerrno>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include "binding.h"

namespace appliance {
namespace {

struct Libnuma {
  void* handle = nullptr;
  int (*available)() = nullptr;
  void* (*allocate_nodemask)() = nullptr;
  void* (*bitmask_setbit)(void*, unsigned) = nullptr;
  void (*set_membind)(void*) = nullptr;
  void (*set_interleave_mask)(void*) = nullptr;
  void (*bitmask_free)(void*) = nullptr;

  bool load() {
    handle = dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) return false;
    available = reinterpret_cast<int (*)()>(dlsym(handle, "numa_available"));
    allocate_nodemask = reinterpret_cast<void* (*)()>(dlsym(handle, "numa_allocate_nodemask"));
    bitmask_setbit = reinterpret_cast<void* (*)(void*, unsigned)>(dlsym(handle, "numa_bitmask_setbit"));
    set_membind = reinterpret_cast<void (*)(void*)>(dlsym(handle, "numa_set_membind"));
    set_interleave_mask = reinterpret_cast<void (*)(void*)>(dlsym(handle, "numa_set_interleave_mask"));
    bitmask_free = reinterpret_cast<void (*)(void*)>(dlsym(handle, "numa_bitmask_free"));
    return available && allocate_nodemask && bitmask_setbit && set_membind && set_interleave_mask && bitmask_free;
  }
};

// A memory policy (set_mempolicy) belongs to one thread, and threads inherit it only when created.
// The OpenMP pool usually exists before binding (torch starts it), so every pool thread sets the
// policy itself: pages first touched by any kernel thread then land where the plan says.
class MemoryBinding {
 public:
  MemoryBinding(const std::vector<int>& nodes, bool interleave) : interleave_(interleave) {
    if (nodes.empty()) { skipped_ = "not bound (no NUMA node given)"; return; }
    if (!numa_.load()) { skipped_ = "not bound (libnuma.so.1 not found; install libnuma1)"; return; }
    if (numa_.available() < 0) { skipped_ = "not bound (the kernel has no NUMA support)"; return; }
    mask_ = numa_.allocate_nodemask();
    for (size_t i = 0; i < nodes.size(); ++i) {
      numa_.bitmask_setbit(mask_, static_cast<unsigned>(nodes[i]));
      list_ += (i ? "," : "") + std::to_string(nodes[i]);
    }
  }
  ~MemoryBinding() { if (mask_ != nullptr) numa_.bitmask_free(mask_); }

  // On the calling thread: set the policy, and say whether the kernel now reports it for this thread.
  bool apply() const {
    if (mask_ == nullptr) return false;
    if (interleave_) numa_.set_interleave_mask(mask_);
    else numa_.set_membind(mask_);
    int mode = -1;
    if (syscall(SYS_get_mempolicy, &mode, nullptr, 0, nullptr, 0) != 0) return false;
    return mode == (interleave_ ? kInterleave : kBind);
  }

  std::string report(int threads, int applied) const {
    if (mask_ == nullptr) return "memory: " + skipped_;
    std::string what = interleave_ ? "interleaved over" : "bound to";
    std::string result = "memory: " + what + " NUMA node(s) " + list_ + " on " + std::to_string(applied) + " of " +
                         std::to_string(threads) + " thread(s)";
    return applied == threads ? result : result + " (the others keep the default policy)";
  }

 private:
  static constexpr int kBind = 2, kInterleave = 3;  // MPOL_BIND, MPOL_INTERLEAVE
  Libnuma numa_;
  void* mask_ = nullptr;
  bool interleave_;
  std::string list_, skipped_;
};

}  // namespace

std::vector<int> memory_nodes() {
  constexpr int kMaxNodes = 1024;  // at least the kernel's possible nodes, or get_mempolicy fails (EINVAL)
  constexpr int kBind = 2, kInterleave = 3, kWeightedInterleave = 6;  // MPOL_* (numaif.h)
  constexpr int kBits = 8 * sizeof(unsigned long);
  unsigned long mask[kMaxNodes / kBits] = {};
  int mode = -1;
  if (syscall(SYS_get_mempolicy, &mode, mask, kMaxNodes, nullptr, 0) != 0) return {};
  if (mode != kBind && mode != kInterleave && mode != kWeightedInterleave) return {};
  std::vector<int> nodes;
  for (int n = 0; n < kMaxNodes; ++n)
    if (mask[n / kBits] >> (n % kBits) & 1) nodes.push_back(n);
  return nodes;
}

std::string bind_threads(const std::vector<int>& cpus, const std::vector<int>& nodes, bool interleave) {
  const int n = static_cast<int>(cpus.size());
  std::vector<long> tids(n, 0);
  std::vector<int> errors(n, 0);
  std::vector<char> bound(n, 0);
  const MemoryBinding memory(nodes, interleave);
  omp_set_num_threads(n);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[i], &set);
    tids[i] = syscall(SYS_gettid);
    errors[i] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
    bound[i] = memory.apply();  // thread 0 is the calling thread
  }
  std::ostringstream report;
  report << "threads: " << n << " OpenMP thread(s) pinned";
  for (int i = 0; i < n; ++i) {
    report << "\n  thread " << i << " (tid " << tids[i] << ") -> CPU " << cpus[i];
    if (errors[i]) report << " FAILED (errno " << errors[i] << ")";
  }
  int applied = 0;
  for (char b : bound) applied += b;
  report << "\n" << memory.report(n, applied);
  return report.str();
}

}  // namespace appliance
