// A tensor-parallel group's collectives over one shared-memory segment.
//
// Layout: a header (magic, sizes, a failure flag, the broadcast sequence, one cache line per rank),
// then two sets of per-rank slots (all-reduce chunks alternate between them), then the broadcast
// buffer. An all-reduce chunk is one barrier: each rank copies its chunk into its slot of the
// current set and publishes its epoch; once every rank has published it, each sums all slots in rank
// order (float32 accumulation), so every rank gets the same bits. A rank may write a set again only
// two epochs later, by which time every rank has finished reading it (they have published the
// epoch in between), so no second barrier is needed. Waits spin, then yield; the broadcast wait
// sleeps on a futex. While waiting, peers are checked: a dead process or a failed group raises.
#include "collective.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() asm volatile("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

namespace appliance {

namespace {

constexpr uint32_t kMagic = 0x41505447;  // "APTG"
constexpr int kMaxRanks = 64;
constexpr size_t kPage = 4096;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// A process that exited is dead even while its parent has not reaped it (a zombie answers kill(pid, 0)).
bool process_gone(int32_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return false;  // no /proc: trust kill()
  char buffer[512];
  const size_t n = std::fread(buffer, 1, sizeof buffer - 1, file);
  std::fclose(file);
  buffer[n] = '\0';
  const char* close = std::strrchr(buffer, ')');  // the command name may hold spaces and parentheses
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

struct alignas(64) RankState {
  std::atomic<uint64_t> epoch;      // all-reduce chunks this rank has published
  std::atomic<uint32_t> received;   // broadcasts this rank has copied out
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> attached;
};

struct SegmentHeader {
  std::atomic<uint32_t> magic;  // written last by rank 0: the segment is ready
  uint32_t world;
  uint64_t slot_bytes, broadcast_bytes;
  alignas(64) std::atomic<uint32_t> failed;
  char reason[256];
  alignas(64) std::atomic<uint32_t> broadcast_seq;  // a futex word: the number of broadcasts sent
  uint64_t broadcast_size;
  RankState ranks[kMaxRanks];
};

ShmGroup::ShmGroup(const std::string& name, int rank, int world, size_t slot_bytes, size_t broadcast_bytes,
                   double attach_timeout)
    : name_(name), rank_(rank), world_(world), slot_bytes_(round_up(slot_bytes, 64)),
      broadcast_bytes_(round_up(broadcast_bytes, 64)) {
  if (world < 1 || world > kMaxRanks) throw std::invalid_argument("world size must be 1-64");
  if (rank < 0 || rank >= world) throw std::invalid_argument("rank must be in [0, world)");
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos)
    throw std::invalid_argument("segment name must look like /name");
  size_ = round_up(sizeof(SegmentHeader), kPage) + 2 * world_ * slot_bytes_ + broadcast_bytes_;
  int fd = -1;
  if (rank == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("shm_open(" + name + "): " + std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(size_)) != 0) {
      int err = errno;
      ::close(fd);
      shm_unlink(name.c_str());
      throw std::runtime_error("sizing " + name + " to " + std::to_string(size_) + " bytes: " + std::strerror(err) +
                               " (is /dev/shm large enough? containers need shm_size)");
    }
  } else {
    const auto start = Clock::now();
    while ((fd = shm_open(name.c_str(), O_RDWR, 0600)) < 0) {
      if (errno != ENOENT || seconds_since(start) > attach_timeout)
        throw std::runtime_error("attaching to " + name + ": " + std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    struct stat st{};
    while (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) < size_) {  // rank 0 is still sizing it
      if (seconds_since(start) > attach_timeout) {
        ::close(fd);
        throw std::runtime_error(name + " is smaller than this group needs: different sizes on different ranks?");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  void* mapped = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mapped == MAP_FAILED) throw std::runtime_error("mmap(" + name + "): " + std::strerror(errno));
  base_ = static_cast<std::byte*>(mapped);
  header_ = reinterpret_cast<SegmentHeader*>(base_);
  if (rank == 0) {
    header_->world = static_cast<uint32_t>(world);
    header_->slot_bytes = slot_bytes_;
    header_->broadcast_bytes = broadcast_bytes_;
    header_->magic.store(kMagic, std::memory_order_release);
  } else {
    const auto start = Clock::now();
    while (header_->magic.load(std::memory_order_acquire) != kMagic) {
      if (seconds_since(start) > attach_timeout) {
        close();
        throw std::runtime_error(name + " was never initialised by rank 0");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (header_->world != static_cast<uint32_t>(world) || header_->slot_bytes != slot_bytes_ ||
        header_->broadcast_bytes != broadcast_bytes_) {
      close();
      throw std::runtime_error(name + " was made for another group shape (world, slot or broadcast size differ)");
    }
  }
  RankState& me = header_->ranks[rank];
  me.pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  me.attached.store(1, std::memory_order_release);
}

ShmGroup::~ShmGroup() { close(); }

void ShmGroup::close() {
  if (base_ != nullptr) {
    if (rank_ == 0 && !unlinked_) shm_unlink(name_.c_str());
    unlinked_ = true;
    munmap(base_, size_);
    base_ = nullptr;
    header_ = nullptr;
  }
}

std::byte* ShmGroup::slot(int parity, int rank) const {
  return base_ + round_up(sizeof(SegmentHeader), kPage) + (static_cast<size_t>(parity) * world_ + rank) * slot_bytes_;
}

void ShmGroup::wait_attached(double limit) {
  if (header_ == nullptr) throw std::runtime_error("the group is closed");
  const auto start = Clock::now();
  for (int r = 0; r < world_; ++r) {
    while (header_->ranks[r].attached.load(std::memory_order_acquire) == 0) {
      if (header_->failed.load(std::memory_order_acquire)) throw std::runtime_error(header_->reason);
      if (seconds_since(start) > limit)
        throw std::runtime_error("TP rank " + std::to_string(r) + " did not attach in " + std::to_string(limit) + " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  if (rank_ == 0 && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

void ShmGroup::abort(const std::string& reason) {
  if (header_ == nullptr) return;
  uint32_t expected = 0;
  if (header_->failed.compare_exchange_strong(expected, 1)) {
    std::strncpy(header_->reason, reason.c_str(), sizeof header_->reason - 1);
    header_->reason[sizeof header_->reason - 1] = '\0';
  }
  header_->broadcast_seq.fetch_add(0);  // make the flag visible before waking sleepers
  futex(&header_->broadcast_seq, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmGroup::check_peers(const char* what) {
  if (header_->failed.load(std::memory_order_acquire)) {
    throw std::runtime_error(std::string("the TP group failed during ") + what + ": " + header_->reason);
  }
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const int32_t pid = header_->ranks[r].pid.load(std::memory_order_relaxed);
    if (pid > 0 && process_gone(pid)) {
      std::string reason = "TP rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") died";
      abort(reason);
      throw std::runtime_error(reason + " during " + what);
    }
  }
}

void ShmGroup::wait_for(int peer, uint64_t epoch, double limit, const char* what) {
  const std::atomic<uint64_t>& flag = header_->ranks[peer].epoch;
  for (int i = 0; i < 4096; ++i) {
    if (flag.load(std::memory_order_acquire) >= epoch) return;
    CPU_RELAX();
  }
  const auto start = Clock::now();
  auto checked = start;
  struct Waiting {  // the stall gauge (waiting_seconds), cleared however the wait ends
    ShmGroup& group;
    ~Waiting() { group.waiting_since_ns_.store(0, std::memory_order_relaxed); }
  } waiting{*this};
  waiting_peer_.store(peer, std::memory_order_relaxed);
  waiting_since_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(start.time_since_epoch()).count(),
                          std::memory_order_release);  // (the peer before it: a reader that sees the time sees it)
  while (flag.load(std::memory_order_acquire) < epoch) {
    sched_yield();
    const auto now = Clock::now();
    if (now - checked > std::chrono::milliseconds(20)) {
      checked = now;
      check_peers(what);
      if (limit > 0 && seconds_since(start) > limit) {
        std::string reason = "TP rank " + std::to_string(peer) + " did not reach " + what + " in " +
                             std::to_string(static_cast<int>(limit)) + " s";
        abort(reason);
        throw std::runtime_error(reason);
      }
    }
  }
}

double ShmGroup::waiting_seconds() const {
  const int64_t since = waiting_since_ns_.load(std::memory_order_acquire);
  if (since == 0) return 0.0;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  return static_cast<double>(now - since) * 1e-9;
}

void ShmGroup::all_reduce(void* data, int64_t count, int dtype) {
  if (header_ == nullptr) throw std::runtime_error("the group is closed");
  if (dtype != 0 && dtype != 1) throw std::invalid_argument("all_reduce: dtype must be float32 or bfloat16");
  if (world_ == 1 || count == 0) return;
  const size_t elem = dtype == 0 ? 4 : 2;
  const int64_t per_chunk = static_cast<int64_t>(slot_bytes_ / elem);
  std::byte* bytes = static_cast<std::byte*>(data);
  for (int64_t done = 0; done < count; done += per_chunk) {
    const int64_t n = std::min(per_chunk, count - done);
    const uint64_t epoch = ++epoch_;
    const int parity = static_cast<int>(epoch & 1);
    std::byte* mine = bytes + done * elem;
    const bool threads = n * static_cast<int64_t>(elem) >= (1 << 16);
    const int64_t grain = 4096;  // elements per task: whole cache lines
    const int64_t tasks = (n + grain - 1) / grain;
#pragma omp parallel for if (threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t lo = t * grain, len = std::min(grain, n - lo);
      std::memcpy(slot(parity, rank_) + lo * elem, mine + lo * elem, len * elem);
    }
    header_->ranks[rank_].epoch.store(epoch, std::memory_order_release);
    for (int r = 0; r < world_; ++r)
      if (r != rank_) wait_for(r, epoch, timeout, "an all-reduce");
#pragma omp parallel for if (threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t lo = t * grain, hi = std::min(lo + grain, n);
      if (dtype == 0) {
        float* out = reinterpret_cast<float*>(mine);
        const float* first = reinterpret_cast<const float*>(slot(parity, 0));
        for (int64_t i = lo; i < hi; ++i) out[i] = first[i];
        for (int r = 1; r < world_; ++r) {
          const float* in = reinterpret_cast<const float*>(slot(parity, r));
          for (int64_t i = lo; i < hi; ++i) out[i] += in[i];
        }
      } else {
        uint16_t* out = reinterpret_cast<uint16_t*>(mine);
        float acc[4096];
        const uint16_t* first = reinterpret_cast<const uint16_t*>(slot(parity, 0));
        for (int64_t i = lo; i < hi; ++i) acc[i - lo] = bf16_to_float(first[i]);
        for (int r = 1; r < world_; ++r) {
          const uint16_t* in = reinterpret_cast<const uint16_t*>(slot(parity, r));
          for (int64_t i = lo; i < hi; ++i) acc[i - lo] += bf16_to_float(in[i]);
        }
        for (int64_t i = lo; i < hi; ++i) out[i] = float_to_bf16(acc[i - lo]);
      }
    }
  }
}

std::optional<std::string> ShmGroup::broadcast(const std::string& message, double limit) {
  if (header_ == nullptr) throw std::runtime_error("the group is closed");
  std::byte* buffer = base_ + size_ - broadcast_bytes_;
  const uint32_t seq = ++broadcasts_;
  if (rank_ == 0) {
    if (message.size() > broadcast_bytes_)
      throw std::invalid_argument("broadcast: " + std::to_string(message.size()) + " bytes, more than the " +
                                  std::to_string(broadcast_bytes_) + " the group was made for");
    // the buffer is free once every rank has copied out the previous message
    const auto start = Clock::now();
    for (int r = 1; r < world_; ++r) {
      while (header_->ranks[r].received.load(std::memory_order_acquire) + 1 < seq) {
        sched_yield();
        if (seconds_since(start) > 0.02) check_peers("a broadcast");
        if (limit > 0 && seconds_since(start) > limit) throw std::runtime_error("broadcast: a rank stopped reading");
      }
    }
    std::memcpy(buffer, message.data(), message.size());
    header_->broadcast_size = message.size();
    header_->broadcast_seq.store(seq, std::memory_order_release);
    futex(&header_->broadcast_seq, FUTEX_WAKE, INT_MAX, nullptr);
    return message;
  }
  const auto start = Clock::now();
  for (int i = 0; header_->broadcast_seq.load(std::memory_order_acquire) < seq; ++i) {
    if (i < 4096) {
      CPU_RELAX();
      continue;
    }
    const uint32_t seen = header_->broadcast_seq.load(std::memory_order_acquire);
    if (seen >= seq) break;
    timespec wait{0, 50 * 1000 * 1000};  // wake up to look at the peers every 50 ms
    futex(&header_->broadcast_seq, FUTEX_WAIT, seen, &wait);
    check_peers("a broadcast");
    if (limit > 0 && seconds_since(start) > limit) {
      --broadcasts_;  // nothing came: the next call waits for the same message
      return std::nullopt;
    }
  }
  std::string out(reinterpret_cast<const char*>(buffer), header_->broadcast_size);
  header_->ranks[rank_].received.store(seq, std::memory_order_release);
  return out;
}

}  // namespace appliance
