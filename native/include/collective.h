// Collectives of one tensor-parallel group over a shared-memory segment (/dev/shm): an all-reduce
// for the layers and a byte broadcast for the steps. No Python runs between the ranks' calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <atomic>
#include <string>
#include <vector>

namespace appliance {

struct SegmentHeader;

class ShmGroup {
 public:
  // Rank 0 creates the segment `name` (as shm_open names it: "/something"); the others attach,
  // waiting up to `timeout` seconds for it to appear. `slot_bytes` bounds one all-reduce chunk per
  // rank, `broadcast_bytes` one broadcast message.
  ShmGroup(const std::string& name, int rank, int world, size_t slot_bytes, size_t broadcast_bytes, double timeout);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Every rank calls this with its own tensor of the same length; afterwards each holds the sum,
  // bit-identical on every rank (summed in rank order, in float32). dtype: 0 float32, 1 bfloat16.
  void all_reduce(void* data, int64_t count, int dtype);
  // Rank 0 sends `message`; every other rank receives it (its `message` is ignored), waiting up to
  // `timeout` seconds (0: forever) and returning nothing if none came by then.
  std::optional<std::string> broadcast(const std::string& message, double timeout);
  // Wait until every rank has attached, then remove the name: the memory lives on while mapped, and
  // nothing is left in /dev/shm however the processes end.
  void wait_attached(double timeout);
  // Mark the group failed: every rank waiting in a collective raises at once.
  void abort(const std::string& reason);
  void close();

  // How long this rank has been waiting in a collective for a live peer that has not arrived, in seconds (0: not
  // waiting), and for which; safe to call from another thread (an engine's heartbeat thread: a peer that is
  // stopped, not dead, holds rank 0 in a step while its heartbeats would otherwise go on).
  double waiting_seconds() const;
  int waiting_peer() const { return waiting_peer_.load(std::memory_order_relaxed); }
  int rank() const { return rank_; }
  int world() const { return world_; }
  double timeout = 120.0;  // seconds one collective may wait for the others

 private:
  void wait_for(int peer, uint64_t epoch, double limit, const char* what);
  void check_peers(const char* what);
  std::byte* slot(int parity, int rank) const;

  std::string name_;
  int rank_, world_;
  size_t slot_bytes_, broadcast_bytes_, size_ = 0;
  SegmentHeader* header_ = nullptr;
  std::byte* base_ = nullptr;
  uint64_t epoch_ = 0, broadcasts_ = 0;
  std::atomic<int64_t> waiting_since_ns_{0};  // steady clock, 0: not waiting
  std::atomic<int> waiting_peer_{-1};
  bool unlinked_ = false;
};

}  // namespace appliance
