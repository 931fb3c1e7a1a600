// Pin this process's OpenMP threads to CPUs and bind its memory to NUMA nodes.
#pragma once

#include <string>
#include <vector>

namespace appliance {

// Thread i of the OpenMP pool runs on cpus[i] (the pool is resized to cpus.size()); memory is bound
// to `nodes` (or interleaved over them). Returns a readable report of what was bound.
std::string bind_threads(const std::vector<int>& cpus, const std::vector<int>& nodes, bool interleave);

}  // namespace appliance
