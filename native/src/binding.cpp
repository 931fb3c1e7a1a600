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

std::string bind_memory(const std::vector<int>& nodes, bool interleave) {
  if (nodes.empty()) return "memory: not bound (no NUMA node given)";
  Libnuma numa;
  if (!numa.load()) return "memory: not bound (libnuma.so.1 not found; install libnuma1)";
  if (numa.available() < 0) return "memory: not bound (the kernel has no NUMA support)";
  void* mask = numa.allocate_nodemask();
  std::ostringstream list;
  for (size_t i = 0; i < nodes.size(); ++i) {
    numa.bitmask_setbit(mask, static_cast<unsigned>(nodes[i]));
    list << (i ? "," : "") << nodes[i];
  }
  if (interleave) numa.set_interleave_mask(mask);
  else numa.set_membind(mask);
  numa.bitmask_free(mask);
  return std::string("memory: ") + (interleave ? "interleaved over" : "bound to") + " NUMA node(s) " + list.str();
}

}  // namespace

std::string bind_threads(const std::vector<int>& cpus, const std::vector<int>& nodes, bool interleave) {
  const int n = static_cast<int>(cpus.size());
  std::vector<long> tids(n, 0);
  std::vector<int> errors(n, 0);
  omp_set_num_threads(n);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[i], &set);
    tids[i] = syscall(SYS_gettid);
    errors[i] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
  }
  std::ostringstream report;
  report << "threads: " << n << " OpenMP thread(s) pinned";
  for (int i = 0; i < n; ++i) {
    report << "\n  thread " << i << " (tid " << tids[i] << ") -> CPU " << cpus[i];
    if (errors[i]) report << " FAILED (errno " << errors[i] << ")";
  }
  report << "\n" << bind_memory(nodes, interleave);
  return report.str();
}

}  // namespace appliance
