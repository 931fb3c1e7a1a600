// AMX-INT8 tile multiplies for the avx512bf16 kernels' int16 row chunks (amx_tile.h), built with -mamx-tile
// -mamx-int8 on x86-64 only, and used only where amx_check passed: the CPU has AMX-TILE and AMX-INT8, the kernel
// lets this process use the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM), the CPU's multiplies give the emulated
// ones' sums on random tiles, full and partial, and the AMX rows on the CPU's multiplies give the emulated rows' bits
// on a small Q4_1 and a small Q8_0 weight (a full and a partial tile, a partial panel, three blocks). No AMX machine
// was available when this was written: the tile algorithm is tested through the emulated multiplies on every x86 CPU
// the tests run on (tests/kernels/test_amx.py), and this check is what stands between the CPU's own instructions
// (and this file) and a wrong answer.
#include <immintrin.h>

#include <cerrno>
#include <cpuid.h>
#include <cstdio>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>

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
    // Not GCC 12's _tile_loadconfig, which tells the compiler that ldtilecfg reads 8 bytes of the 64: out of line,
    // GCC dropped the stores of the rows and widths. Here the whole struct is the instruction's input.
    asm volatile("ldtilecfg %0" ::"m"(c));
  }
  // (GCC's tile intrinsics paste their tile numbers into the instruction's text: literals, not template parameters)
#define APPLIANCE_TILE(T, op) \
  if constexpr (T == 0) op(0); else if constexpr (T == 1) op(1); else if constexpr (T == 2) op(2); \
  else if constexpr (T == 3) op(3); else if constexpr (T == 4) op(4); else if constexpr (T == 5) op(5); \
  else if constexpr (T == 6) op(6); else op(7);
  // _tile_loadd does not tell the compiler that it reads memory: the barriers keep every store before it before it,
  // and every store after it after it
  template <int T>
  static void load(const void* from, int64_t stride) {
    asm volatile("" ::: "memory");
#define APPLIANCE_LOAD(n) _tile_loadd(n, from, stride)
    APPLIANCE_TILE(T, APPLIANCE_LOAD)
    asm volatile("" ::: "memory");
  }
  template <int T>
  static void store(void* to, int64_t stride) {  // (_tile_stored clobbers memory)
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
#undef APPLIANCE_DOTS
#undef APPLIANCE_DOT
#undef APPLIANCE_STORE
#undef APPLIANCE_LOAD
#undef APPLIANCE_TILE
  static void release() { _tile_release(); }
};

}  // namespace

const char* amx_check() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25)))
    return "the CPU has no AMX-TILE and AMX-INT8";
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux's arch_prctl request, the tile data state
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) {
    static char why[192];  // (amx_check runs once a process: dispatch.cpp's call_once)
    std::snprintf(why, sizeof why, "the kernel did not let this process use the tile registers (arch_prctl "
                  "ARCH_REQ_XCOMP_PERM: %s; Linux 5.16+ grants it)", std::strerror(errno));
    return why;
  }
  return amx_self_check<HardwareTmul>();
}

void amx_hardware_rows(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0) {
  if (t.layout.bits == 4) amx_rows<HardwareTmul, 4>(t, r_begin, r_end, p0);
  else amx_rows<HardwareTmul, 8>(t, r_begin, r_end, p0);
}

}  // namespace appliance::APPLIANCE_ISA
