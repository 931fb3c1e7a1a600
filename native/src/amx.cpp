// AMX-INT8 tile multiplies for the avx512bf16 kernels' int16 row chunks (amx_tile.h), built with -mamx-tile
// -mamx-int8 on x86-64 only, and used only where amx_check passed: the CPU has AMX-TILE and AMX-INT8, the kernel
// lets this process use the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM), and the CPU's multiplies give the
// emulated ones' sums on random tiles, full and partial. No AMX machine was available when this was written: the
// tile algorithm is tested through the emulated multiplies on every CPU (tests/kernels/test_amx.py), and this check
// is what stands between the CPU's own instructions and a wrong answer.
#include <immintrin.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <random>

#include "amx_tile.h"

namespace appliance::APPLIANCE_ISA {
namespace {

struct HardwareTmul {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes[16] = {};
    uint8_t rows[16] = {};
  };
  // as EmulatedTmul::configure: tiles 0-1 A (rows x 32 bytes), 2-3 B (8 x 64), 4-7 C (rows x 64)
  static void configure(int rows) {
    Config c;
    for (int i = 0; i < 8; ++i) {
      c.rows[i] = static_cast<uint8_t>(i == 2 || i == 3 ? 8 : rows);
      c.bytes[i] = static_cast<uint16_t>(i < 2 ? 32 : 64);
    }
    _tile_loadconfig(&c);
  }
  // (GCC's tile intrinsics paste their tile numbers into the instruction's text: literals, not template parameters)
#define APPLIANCE_TILE(T, op) \
  if constexpr (T == 0) op(0); else if constexpr (T == 1) op(1); else if constexpr (T == 2) op(2); \
  else if constexpr (T == 3) op(3); else if constexpr (T == 4) op(4); else if constexpr (T == 5) op(5); \
  else if constexpr (T == 6) op(6); else op(7);
  template <int T>
  static void load(const void* from, int64_t stride) {
#define APPLIANCE_LOAD(n) _tile_loadd(n, from, stride)
    APPLIANCE_TILE(T, APPLIANCE_LOAD)
  }
  template <int T>
  static void store(void* to, int64_t stride) {
#define APPLIANCE_STORE(n) _tile_stored(n, to, stride)
    APPLIANCE_TILE(T, APPLIANCE_STORE)
  }
  template <int T>
  static void zero() { APPLIANCE_TILE(T, _tile_zero) }
  // C += A B for the pairs amx_rows and same_sums take: A 0 or 1, B 2 or 3, C 4 to 7
  template <int C, int A, int B>
  static void dot() {
    static_assert(C >= 4 && (A == 0 || A == 1) && (B == 2 || B == 3), "A in tiles 0-1, B in 2-3, C in 4-7");
#define APPLIANCE_DOT(c, a, b) if constexpr (C == c && A == a && B == b) _tile_dpbsud(c, a, b);
#define APPLIANCE_DOTS(c) APPLIANCE_DOT(c, 0, 2) APPLIANCE_DOT(c, 1, 2) APPLIANCE_DOT(c, 0, 3) APPLIANCE_DOT(c, 1, 3)
    APPLIANCE_DOTS(4) APPLIANCE_DOTS(5) APPLIANCE_DOTS(6) APPLIANCE_DOTS(7)
  }
  static void release() { _tile_release(); }
};

// The CPU's multiplies against the emulated ones: random A and B, C tiles started from random sums, rows 16 and 5.
template <typename Tmul>
void multiply(int rows, const int8_t* a, const uint8_t* b, const int32_t* c, int32_t* out) {
  Tmul::configure(rows);
  Tmul::template load<0>(a, 32);
  Tmul::template load<3>(b, 64);
  Tmul::template load<5>(c, 64);
  Tmul::template dot<5, 0, 3>();
  Tmul::template store<5>(out, 64);
  Tmul::release();
}

// null where the sums agree, else what differed
const char* same_sums() {
  std::mt19937 rng(7);
  alignas(64) int8_t a[16 * 32];
  alignas(64) uint8_t b[8 * 64];
  alignas(64) int32_t c[16 * 16], cpu[16 * 16], emulated[16 * 16];
  for (int round = 0; round < 4; ++round) {
    for (auto& v : a) v = static_cast<int8_t>(rng());
    for (auto& v : b) v = static_cast<uint8_t>(rng());
    for (auto& v : c) v = static_cast<int32_t>(rng() % 2000001) - 1000000;
    const int rows = round % 2 == 0 ? 16 : 5;
    multiply<HardwareTmul>(rows, a, b, c, cpu);
    multiply<EmulatedTmul>(rows, a, b, c, emulated);
    if (std::memcmp(cpu, emulated, sizeof(int32_t) * 16 * rows) != 0)
      return rows == 16 ? "the CPU's tile multiplies differ from the emulated ones (16 rows)"
                        : "the CPU's tile multiplies differ from the emulated ones (5 rows)";
  }
  return nullptr;
}

}  // namespace

const char* amx_check() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25)))
    return "the CPU has no AMX-TILE and AMX-INT8";
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux's arch_prctl request, the tile data state
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0)
    return "the kernel did not let this process use the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+)";
  return same_sums();
}

void amx_hardware_rows(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0) {
  if (t.layout.bits == 4) amx_rows<HardwareTmul, 4>(t, r_begin, r_end, p0);
  else amx_rows<HardwareTmul, 8>(t, r_begin, r_end, p0);
}

}  // namespace appliance::APPLIANCE_ISA
