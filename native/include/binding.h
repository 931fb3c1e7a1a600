// Pin this process's OpenMP threads to CPUs and bind its memory to NUMA nodes.
#pragma once

#include <string>
#include <vector>

namespace appliance {

// Thread i of the OpenMP pool runs on cpus[i] (the pool is resized to cpus.size()); memory is bound
// to `nodes` (or interleaved over them). Returns a readable report of what was bound.
std::string bind_threads(const std::vector<int>& cpus, const std::vector<int>& nodes, bool interleave);

// The NUMA nodes the calling thread's memory policy confines its new pages to (bound or interleaved, as
// bind_threads sets it, or as numactl --membind / --interleave started the process), ascending; empty where any
// node will do (the default or a preferred policy) or the kernel has no get_mempolicy.
std::vector<int> memory_nodes();

}  // namespace appliance
