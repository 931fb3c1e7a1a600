// What the CPU's instructions cost, measured where the datasheets disagree with the machine: vdpbf16ps'
// issue rate against vfmadd231ps' (kernels.h, bf16_dot; only the avx512bf16 kernels have vdpbf16ps), and
// vpmaddubsw's on ymm registers against vfmadd231ps' (kernels.h, wide_int_tiles; the avx2 kernels).
#include <algorithm>
#include <chrono>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {

namespace {
// `other`'s issue rate over `base`'s (instructions a second, measured by each), each one's best of seven
// alternated timings, so that a preempted or throttled one does not count; 0 where `base` measured nothing.
template <typename Base, typename Other>
[[maybe_unused]] double issue_ratio(Base base, Other other) {
  double b = 0.0, o = 0.0;
  for (int trial = 0; trial < 7; ++trial) {
    b = std::max(b, base());
    o = std::max(o, other());
  }
  return b > 0.0 ? o / b : 0.0;
}
}  // namespace

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
namespace {

constexpr int kRounds = 4096;  // of 16 instructions: 65k a timing, tens of microseconds

// Instructions a second for kRounds x 16 of one instruction in 16 independent chains (enough to cover either
// one's latency), each chain a named register: as an array the chains went through memory, and the FMAs
// measured at a third of their rate.
#define APPLIANCE_16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
template <bool kDot>
__attribute__((noinline)) double issue_rate() {
#define APPLIANCE_INIT(i) __m512 a##i = _mm512_set1_ps(static_cast<float>(i));
  APPLIANCE_16(APPLIANCE_INIT)
  __m512 x = _mm512_set1_ps(1e-3f), y = _mm512_set1_ps(1.f);
  __m512bh px = _mm512_cvtne2ps_pbh(x, x), py = _mm512_cvtne2ps_pbh(y, y);
  asm volatile("" : "+v"(x), "+v"(y), "+v"(px), "+v"(py));  // unknown values: fma(a, 1, x) stays an FMA
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRounds; ++i) {
    if constexpr (kDot) {
#define APPLIANCE_DOT(i) a##i = _mm512_dpbf16_ps(a##i, px, py);
      APPLIANCE_16(APPLIANCE_DOT)
    } else {
#define APPLIANCE_FMA(i) a##i = _mm512_fmadd_ps(a##i, y, x);
      APPLIANCE_16(APPLIANCE_FMA)
    }
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
    asm volatile("" : "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11), "+v"(a12), "+v"(a13), "+v"(a14), "+v"(a15));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
#define APPLIANCE_SUM(i) +_mm512_reduce_add_ps(a##i)
  volatile float sink = 0.f APPLIANCE_16(APPLIANCE_SUM);  // the results are used: nothing above is dead
  (void)sink;
  return seconds > 0.0 ? kRounds * 16 / seconds : 0.0;
}
#undef APPLIANCE_16
#undef APPLIANCE_INIT
#undef APPLIANCE_DOT
#undef APPLIANCE_FMA
#undef APPLIANCE_SUM

}  // namespace

// (an Intel Xeon, family 6 model 207: vdpbf16ps 1.35 G/s a core, vfmadd231ps 5.46, ratio 0.25)
double bf16_dot_issue_ratio() { return issue_ratio(issue_rate<false>, issue_rate<true>); }
#else
double bf16_dot_issue_ratio() { return 0.0; }
#endif

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2
namespace {

constexpr int kRounds = 4096;  // of 12 instructions: ~50k a timing, tens of microseconds

// Instructions a second for kRounds x 12 of one instruction in 12 independent chains (AVX2 has 16 registers:
// 12 chains and the operands; 12 cover either one's latency at two a cycle), each chain a named register.
#define APPLIANCE_12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define APPLIANCE_ISSUE_RATE(name, V, init, step, bits)                                         \
  __attribute__((noinline)) double name() {                                                   \
    APPLIANCE_12(init)                                                                        \
    __m256 x = _mm256_set1_ps(1e-3f), y = _mm256_set1_ps(1.f);                                \
    __m256i w = _mm256_set1_epi8(3);                                                          \
    asm volatile("" : "+x"(x), "+x"(y), "+x"(w)); /* unknown values: nothing folds */         \
    const auto start = std::chrono::steady_clock::now();                                      \
    for (int i = 0; i < kRounds; ++i) {                                                       \
      APPLIANCE_12(step)                                                                      \
      asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));          \
      asm volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));        \
    }                                                                                         \
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); \
    __m256i acc = _mm256_setzero_si256();                                                     \
    APPLIANCE_12(bits)                                                                        \
    volatile int sink = _mm256_extract_epi32(acc, 0); /* the results are used */              \
    (void)sink;                                                                               \
    return seconds > 0.0 ? kRounds * 12 / seconds : 0.0;                                      \
  }
#define APPLIANCE_MUL_INIT(i) __m256i a##i = _mm256_set1_epi8(static_cast<char>(i));
#define APPLIANCE_MUL(i) a##i = _mm256_maddubs_epi16(a##i, w);
#define APPLIANCE_MUL_BITS(i) acc = _mm256_xor_si256(acc, a##i);
#define APPLIANCE_FMA_INIT(i) __m256 a##i = _mm256_set1_ps(static_cast<float>(i));
#define APPLIANCE_FMA(i) a##i = _mm256_fmadd_ps(a##i, y, x);
#define APPLIANCE_FMA_BITS(i) acc = _mm256_xor_si256(acc, _mm256_castps_si256(a##i));
APPLIANCE_ISSUE_RATE(mul_rate, __m256i, APPLIANCE_MUL_INIT, APPLIANCE_MUL, APPLIANCE_MUL_BITS)
APPLIANCE_ISSUE_RATE(fma_rate, __m256, APPLIANCE_FMA_INIT, APPLIANCE_FMA, APPLIANCE_FMA_BITS)
#undef APPLIANCE_12
#undef APPLIANCE_ISSUE_RATE
#undef APPLIANCE_MUL_INIT
#undef APPLIANCE_MUL
#undef APPLIANCE_MUL_BITS
#undef APPLIANCE_FMA_INIT
#undef APPLIANCE_FMA
#undef APPLIANCE_FMA_BITS

}  // namespace

// (AMD EPYC Zen 3, family 25 model 1: 1.00-1.32 at each start; Zen 1, family 23 model 1: vpmaddubsw ymm 1.24 G/s
// a core, vfmadd231ps 2.39, ~0.52)
double int_mul_issue_ratio() { return issue_ratio(fma_rate, mul_rate); }
#else
double int_mul_issue_ratio() { return 0.0; }
#endif

}  // namespace appliance::APPLIANCE_ISA
