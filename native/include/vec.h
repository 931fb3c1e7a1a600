// The one header that picks the ISA implementation.
//
// Every kernel source is compiled once per ISA, with APPLIANCE_ISA set to one of the names below and
// the matching compiler flags; what it defines lands in namespace appliance::<isa>. This header gives
// those sources one vector type, VecF (float lanes), with the same operations on every ISA, so each
// kernel is written once. Loads and stores of bfloat16 widen to / round from float32 (round to nearest
// even, like torch), so kernels always accumulate in float32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#define APPLIANCE_ISA_avx512bf16 1
#define APPLIANCE_ISA_avx512 2
#define APPLIANCE_ISA_avx2 3
#define APPLIANCE_ISA_neon 4
#define APPLIANCE_ISA_portable 5
#define APPLIANCE_CAT2(a, b) a##b
#define APPLIANCE_CAT(a, b) APPLIANCE_CAT2(a, b)
#define APPLIANCE_ISA_ID APPLIANCE_CAT(APPLIANCE_ISA_, APPLIANCE_ISA)

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512 || \
    APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2
#include <immintrin.h>
#elif APPLIANCE_ISA_ID == APPLIANCE_ISA_neon
#include <arm_neon.h>
#endif

namespace appliance {

using bf16 = uint16_t;  // bfloat16 bits

inline float bf16_to_float(bf16 h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                    // round to nearest even
  return static_cast<bf16>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {  // IEEE half bits -> float (exact)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float f = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  u = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half bits: a type of its own (bf16 is a plain uint16_t), so that overloads and templates tell a float16
// KV cache from a bfloat16 one
struct f16 {
  uint16_t bits;
};

inline uint16_t float_to_fp16(float f) {  // round to nearest even, as F16C's vcvtps2ph and torch's .to(float16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN (quiet)
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // from 65,520 on (and infinity): infinity
  if (a >= 0x38800000u) {  // a normal half (from 2^-14): the exponent rebiased by 127 - 15, carries included
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
  }
  float magnitude;  // a subnormal half (or zero): m 2^-24, m rounded to nearest even (1,024 is 2^-14's bits)
  std::memcpy(&magnitude, &a, 4);
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(magnitude * 16777216.f)));
}

template <typename T> inline float to_float(T x);
template <> inline float to_float<float>(float x) { return x; }
template <> inline float to_float<bf16>(bf16 x) { return bf16_to_float(x); }
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) { return float_to_bf16(x); }
template <> inline float to_float<f16>(f16 x) { return fp16_to_float(x.bits); }
template <> inline f16 from_float<f16>(float x) { return {float_to_fp16(x)}; }

inline int32_t byte_sum(int32_t x4) {  // the sum of x4's four signed bytes
  return static_cast<int8_t>(x4) + static_cast<int8_t>(x4 >> 8) + static_cast<int8_t>(x4 >> 16) + static_cast<int8_t>(x4 >> 24);
}

namespace APPLIANCE_ISA {

// I32x16::centered_dot4 (below) is how weights of any byte meet x: on AVX2, where dot4<false> is emulated with twice
// its multiplies. VNNI's vpdpbusd takes any byte as it is; the portable path sums in int32.
constexpr bool kCenteredDots = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2;

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512

struct VecF {
  static constexpr int N = 16;
  __m512 v;
  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecF load(const bf16* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static VecF load(const f16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(f16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  void store(bf16* p) const {
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  friend VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
  static VecF fmadd(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  static VecF min(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
  static VecF round(VecF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  // 2^n for whole-number lanes n in [-126, 127]
  static VecF pow2(VecF n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  // lanes holding whole numbers in [-127, 127] -> N int8 at p
  void store_int8(int8_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v))); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  // r[0..16) are the rows of a 16x16 matrix; afterwards they are its columns
  static void transpose(VecF* r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {  // within each 128-bit lane: pairs of rows interleaved
      t[i] = _mm512_unpacklo_ps(r[i].v, r[i + 1].v);
      t[i + 1] = _mm512_unpackhi_ps(r[i].v, r[i + 1].v);
    }
    for (int i = 0; i < 16; i += 4) {  // u[i + k], lane L: column 4L + k of rows i..i+3
      u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {  // gather lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
      __m512 even0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);  // lanes 0, 2 of each
      __m512 odd0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);   // lanes 1, 3 of each
      __m512 even1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
      __m512 odd1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
      r[k].v = _mm512_shuffle_f32x4(even0, even1, 0x88);
      r[4 + k].v = _mm512_shuffle_f32x4(odd0, odd1, 0x88);
      r[8 + k].v = _mm512_shuffle_f32x4(even0, even1, 0xdd);
      r[12 + k].v = _mm512_shuffle_f32x4(odd0, odd1, 0xdd);
    }
  }
};

#elif APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2

struct VecF {
  static constexpr int N = 8;
  __m256 v;
  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecF load(const bf16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static VecF load(const f16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(f16* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  void store(bf16* p) const {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  friend VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
  static VecF fmadd(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  static VecF min(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
  static VecF round(VecF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static VecF pow2(VecF n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
  }
  void store_int8(int8_t* p) const {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  float reduce_add() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float reduce_max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // r[0..8) are the rows of an 8x8 matrix; afterwards they are its columns
  static void transpose(VecF* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i].v, r[i + 1].v);
      t[i + 1] = _mm256_unpackhi_ps(r[i].v, r[i + 1].v);
    }
    for (int i = 0; i < 8; i += 4) {  // u[i + k], lane L: column 4L + k of rows i..i+3
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
      r[k].v = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
      r[4 + k].v = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
  }
};

#elif APPLIANCE_ISA_ID == APPLIANCE_ISA_neon

struct VecF {
  static constexpr int N = 4;
  float32x4_t v;
  static VecF zero() { return {vdupq_n_f32(0.f)}; }
  static VecF set1(float x) { return {vdupq_n_f32(x)}; }
  static VecF load(const float* p) { return {vld1q_f32(p)}; }
  static VecF load(const bf16* p) { return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))}; }
  static VecF load(const f16* p) { return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(&p->bits)))}; }
  void store(float* p) const { vst1q_f32(p, v); }
  void store(f16* p) const { vst1_u16(&p->bits, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
  void store(bf16* p) const {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    vst1_u16(p, vmovn_u32(r));
  }
  friend VecF operator+(VecF a, VecF b) { return {vaddq_f32(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {vsubq_f32(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {vmulq_f32(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {vdivq_f32(a.v, b.v)}; }
  static VecF fmadd(VecF a, VecF b, VecF c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  static VecF max(VecF a, VecF b) { return {vmaxq_f32(a.v, b.v)}; }
  static VecF min(VecF a, VecF b) { return {vminq_f32(a.v, b.v)}; }
  static VecF round(VecF a) { return {vrndnq_f32(a.v)}; }
  static VecF pow2(VecF n) {
    int32x4_t e = vaddq_s32(vcvtq_s32_f32(n.v), vdupq_n_s32(127));
    return {vreinterpretq_f32_s32(vshlq_n_s32(e, 23))};
  }
  void store_int8(int8_t* p) const {
    const int8x8_t b = vqmovn_s16(vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(v)), vdup_n_s16(0)));
    std::memcpy(p, &b, 4);
  }
  float reduce_add() const { return vaddvq_f32(v); }
  float reduce_max() const { return vmaxvq_f32(v); }
  // r[0..4) are the rows of a 4x4 matrix; afterwards they are its columns
  static void transpose(VecF* r) {
    float32x4x2_t ab = vtrnq_f32(r[0].v, r[1].v), cd = vtrnq_f32(r[2].v, r[3].v);  // (a0 b0 a2 b2), (a1 b1 a3 b3)
    r[0].v = vcombine_f32(vget_low_f32(ab.val[0]), vget_low_f32(cd.val[0]));
    r[1].v = vcombine_f32(vget_low_f32(ab.val[1]), vget_low_f32(cd.val[1]));
    r[2].v = vcombine_f32(vget_high_f32(ab.val[0]), vget_high_f32(cd.val[0]));
    r[3].v = vcombine_f32(vget_high_f32(ab.val[1]), vget_high_f32(cd.val[1]));
  }
};

#elif APPLIANCE_ISA_ID == APPLIANCE_ISA_portable

// Plain C++ that the compiler vectorises for the baseline ISA (SSE2 on x86-64, NEON on arm64).
struct VecF {
  static constexpr int N = 8;
  float v[N];
  static VecF zero() { return set1(0.f); }
  static VecF set1(float x) { VecF r; for (int i = 0; i < N; ++i) r.v[i] = x; return r; }
  template <typename T> static VecF load(const T* p) { VecF r; for (int i = 0; i < N; ++i) r.v[i] = to_float(p[i]); return r; }
  template <typename T> void store(T* p) const { for (int i = 0; i < N; ++i) p[i] = from_float<T>(v[i]); }
#define APPLIANCE_LANEWISE(expr) VecF r; for (int i = 0; i < N; ++i) r.v[i] = (expr); return r;
  friend VecF operator+(VecF a, VecF b) { APPLIANCE_LANEWISE(a.v[i] + b.v[i]) }
  friend VecF operator-(VecF a, VecF b) { APPLIANCE_LANEWISE(a.v[i] - b.v[i]) }
  friend VecF operator*(VecF a, VecF b) { APPLIANCE_LANEWISE(a.v[i] * b.v[i]) }
  friend VecF operator/(VecF a, VecF b) { APPLIANCE_LANEWISE(a.v[i] / b.v[i]) }
  static VecF fmadd(VecF a, VecF b, VecF c) { APPLIANCE_LANEWISE(a.v[i] * b.v[i] + c.v[i]) }
  static VecF max(VecF a, VecF b) { APPLIANCE_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]) }
  static VecF min(VecF a, VecF b) { APPLIANCE_LANEWISE(a.v[i] < b.v[i] ? a.v[i] : b.v[i]) }
  static VecF round(VecF a) { APPLIANCE_LANEWISE(std::nearbyint(a.v[i])) }
  static VecF pow2(VecF n) { APPLIANCE_LANEWISE(std::ldexp(1.f, static_cast<int>(n.v[i]))) }
  void store_int8(int8_t* p) const { for (int i = 0; i < N; ++i) p[i] = static_cast<int8_t>(v[i]); }
#undef APPLIANCE_LANEWISE
  float reduce_add() const { float s = 0.f; for (int i = 0; i < N; ++i) s += v[i]; return s; }
  float reduce_max() const { float m = v[0]; for (int i = 1; i < N; ++i) m = v[i] > m ? v[i] : m; return m; }
  // r[0..N) are the rows of an N x N matrix; afterwards they are its columns
  static void transpose(VecF* r) {
    for (int i = 0; i < N; ++i)
      for (int j = i + 1; j < N; ++j) std::swap(r[i].v[j], r[j].v[i]);
  }
};

#else
#error "APPLIANCE_ISA must be one of avx512bf16, avx512, avx2, neon, portable"
#endif

// Sixteen lanes on every ISA (one AVX-512 register, two AVX2 ones, plain arrays elsewhere): the kept-
// quantized linears (quant.cpp) work on panels of 16 weight rows, one lane a row, so one packed layout
// serves every ISA. I32x16 holds 64 bytes: lane j is bytes 4j..4j+3. dot4 is VNNI's vpdpbusd: each lane
// adds the products of its 4 unsigned bytes with the 4 signed bytes of x4 (exact: no saturation).
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512

struct F32x16 {
  __m512 v;
  static F32x16 zero() { return {_mm512_setzero_ps()}; }
  static F32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static F32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static F32x16 load_half(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static F32x16 load_u8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
  static F32x16 load_i8(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
  static F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend F32x16 operator*(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend F32x16 operator+(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};

struct I32x16 {
  __m512i v;
  static I32x16 zero() { return {_mm512_setzero_si512()}; }
  static I32x16 set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
  static I32x16 load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
  static I32x16 load_i8(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static I32x16 load_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  void store(uint8_t* p) const { _mm512_storeu_si512(p, v); }
  I32x16 low_nibbles() const { return {_mm512_and_si512(v, _mm512_set1_epi8(0x0f))}; }
  I32x16 high_nibbles() const { return {_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f))}; }
  I32x16 crumbs(int t) const { return {_mm512_and_si512(_mm512_srli_epi16(v, 2 * t), _mm512_set1_epi8(3))}; }  // bits 2t, 2t+1 of each byte
  // 16-bit words: bytes 0 and 1 of each lane (odd: 2 and 3), unsigned; and (w - zero) f word by word (the low 16 bits)
  I32x16 byte_words(int odd) const {
    const __m128i pick = _mm_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12, -128, 13, -128);
    return {_mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_add_epi8(pick, _mm_set1_epi16(static_cast<int16_t>(2 * odd)))))};
  }
  I32x16 words_times(int zero, I32x16 f) const {
    return {_mm512_mullo_epi16(_mm512_sub_epi16(v, _mm512_set1_epi16(static_cast<int16_t>(zero))), f.v)};
  }
  // acc + each lane's two signed words . x2's (two int16, the same for every lane)
  static I32x16 dot2(I32x16 acc, I32x16 w, int32_t x2) {
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
    return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(x2))};
#else
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(w.v, _mm512_set1_epi32(x2)))};
#endif
  }
  void keep() { asm("" : "+v"(v)); }  // the value stays in its register as computed: no reassociation
  // a 16-byte table in every 128-bit lane; lookup: each byte (below 16) replaced by its entry
  static I32x16 table16(const uint8_t* t) { return {_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)))}; }
  I32x16 lookup(I32x16 table) const { return {_mm512_shuffle_epi8(table.v, v)}; }
  // `value` added to each byte whose bit is set in the 64 bits at `bits` (bit n of byte k: byte 8k + n)
  I32x16 plus_where(const uint8_t* bits, int value) const {
    uint64_t mask;
    std::memcpy(&mask, bits, 8);
    return {_mm512_mask_add_epi8(v, _cvtu64_mask64(mask), v, _mm512_set1_epi8(static_cast<char>(value)))};
  }
  template <int I> I32x16 byte() const { return {_mm512_and_si512(_mm512_srli_epi32(v, 8 * I), _mm512_set1_epi32(0xff))}; }
  I32x16 shl8() const { return {_mm512_slli_epi32(v, 8)}; }
  friend I32x16 operator+(I32x16 a, I32x16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
  friend I32x16 operator-(I32x16 a, I32x16 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
  friend I32x16 operator*(I32x16 a, I32x16 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
  F32x16 to_float() const { return {_mm512_cvtepi32_ps(v)}; }
  // each lane's two bfloat16 (a packed BF16 weight pair) as floats: the low half, the high half (exact)
  F32x16 bf16_low() const { return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))}; }
  F32x16 bf16_high() const { return {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))))}; }
  // kSmall: every byte of w is below 128 (4-bit quants, Q8_M32, Q8_H32), which the emulation below can use
  template <bool kSmall>
  static I32x16 dot4(I32x16 acc, I32x16 w, int32_t x4) {
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16  // this tier has AVX512-VNNI too (every BF16 CPU does)
    return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))};
#else  // pairs of u8 x s8 into int16 (no saturation for bytes below 128: x is in [-127, 127]), pairs of those into int32
    const __m512i x = _mm512_set1_epi32(x4), ones = _mm512_set1_epi16(1);
    if (kSmall) return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.v, x), ones))};
    const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(w.low_nibbles().v, x), ones);
    const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(w.high_nibbles().v, x), ones);
    return {_mm512_add_epi32(acc.v, _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)))};
#endif
  }
  // dot4 of small weights in two steps: pairs adds each lane's two int16 pair sums (vpmaddubsw) without widening,
  // widen_pairs makes them the lane's int32 sum (vpmaddwd by ones). Emulated, n dot4 take 2n multiplies and n pairs
  // then one widen_pairs n + 1: the multiplier is what limits the integer tiles on CPUs without VNNI. The caller
  // keeps the int16 sums in range: at most 32,767 / (2 * 127 * max u) pairs between widenings. (VNNI: dot4 itself.)
  static I32x16 pairs(I32x16 acc, I32x16 w, int32_t x4) {
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
    return dot4<true>(acc, w, x4);
#else
    return {_mm512_add_epi16(acc.v, _mm512_maddubs_epi16(w.v, _mm512_set1_epi32(x4)))};
#endif
  }
  I32x16 widen_pairs() const {
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
    return *this;
#else
    return {_mm512_madd_epi16(v, _mm512_set1_epi16(1))};
#endif
  }
  static I32x16 centered_dot4(I32x16 acc, I32x16 w, int32_t x4) {  // (kCenteredDots is false here)
    return dot4<false>(acc, w, x4) - set1(128 * byte_sum(x4));
  }
};

#elif APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2

struct F32x16 {
  __m256 a, b;
  static F32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static F32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F32x16 load_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static F32x16 load_u8(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  static F32x16 load_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  static F32x16 fmadd(F32x16 x, F32x16 y, F32x16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  friend F32x16 operator*(F32x16 x, F32x16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  friend F32x16 operator+(F32x16 x, F32x16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  void store(float* p) const { _mm256_storeu_ps(p, a), _mm256_storeu_ps(p + 8, b); }
};

struct I32x16 {
  __m256i a, b;
  static I32x16 zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I32x16 set1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
  static I32x16 load(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static I32x16 load_i8(const int8_t* p) {
    return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static I32x16 load_u8(const uint8_t* p) {
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  void store(uint8_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a), _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), b);
  }
  static __m256i low(__m256i x) { return _mm256_and_si256(x, _mm256_set1_epi8(0x0f)); }
  static __m256i high(__m256i x) { return _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(0x0f)); }
  I32x16 low_nibbles() const { return {low(a), low(b)}; }
  I32x16 high_nibbles() const { return {high(a), high(b)}; }
  I32x16 crumbs(int t) const {
    const __m256i m = _mm256_set1_epi8(3);
    return {_mm256_and_si256(_mm256_srli_epi16(a, 2 * t), m), _mm256_and_si256(_mm256_srli_epi16(b, 2 * t), m)};
  }
  I32x16 byte_words(int odd) const {
    const __m128i pick = _mm_add_epi8(_mm_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12, -128, 13, -128),
                                      _mm_set1_epi16(static_cast<int16_t>(2 * odd)));
    const __m256i both = _mm256_broadcastsi128_si256(pick);
    return {_mm256_shuffle_epi8(a, both), _mm256_shuffle_epi8(b, both)};
  }
  I32x16 words_times(int zero, I32x16 f) const {
    const __m256i z = _mm256_set1_epi16(static_cast<int16_t>(zero));
    return {_mm256_mullo_epi16(_mm256_sub_epi16(a, z), f.a), _mm256_mullo_epi16(_mm256_sub_epi16(b, z), f.b)};
  }
  static I32x16 dot2(I32x16 acc, I32x16 w, int32_t x2) {
    const __m256i x = _mm256_set1_epi32(x2);
    return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(w.a, x)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(w.b, x))};
  }
  void keep() { asm("" : "+x"(a), "+x"(b)); }  // (as above)
  static I32x16 table16(const uint8_t* t) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
    return {table, table};
  }
  I32x16 lookup(I32x16 table) const { return {_mm256_shuffle_epi8(table.a, a), _mm256_shuffle_epi8(table.b, b)}; }
  // 32 bits as 32 bytes: `value` where the bit is set, else 0 (byte k's bits to bytes 8k..8k+7)
  static __m256i where(const uint8_t* bits, int value) {
    int32_t word;
    std::memcpy(&word, bits, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(word), _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201u));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(static_cast<char>(value)));
  }
  I32x16 plus_where(const uint8_t* bits, int value) const {
    return {_mm256_add_epi8(a, where(bits, value)), _mm256_add_epi8(b, where(bits + 4, value))};
  }
  template <int I> I32x16 byte() const {
    const __m256i m = _mm256_set1_epi32(0xff);
    return {_mm256_and_si256(_mm256_srli_epi32(a, 8 * I), m), _mm256_and_si256(_mm256_srli_epi32(b, 8 * I), m)};
  }
  I32x16 shl8() const { return {_mm256_slli_epi32(a, 8), _mm256_slli_epi32(b, 8)}; }
  friend I32x16 operator+(I32x16 x, I32x16 y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
  friend I32x16 operator-(I32x16 x, I32x16 y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
  friend I32x16 operator*(I32x16 x, I32x16 y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
  F32x16 to_float() const { return {_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b)}; }
  F32x16 bf16_low() const { return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))}; }
  F32x16 bf16_high() const {
    const __m256i m = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    return {_mm256_castsi256_ps(_mm256_and_si256(a, m)), _mm256_castsi256_ps(_mm256_and_si256(b, m))};
  }
  template <bool kSmall>
  static __m256i dot4_half(__m256i acc, __m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (kSmall) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low(w), x), ones);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(high(w), x), ones);
    return _mm256_add_epi32(acc, _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4)));
  }
  template <bool kSmall>
  static I32x16 dot4(I32x16 acc, I32x16 w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    return {dot4_half<kSmall>(acc.a, w.a, x), dot4_half<kSmall>(acc.b, w.b, x)};
  }
  static I32x16 pairs(I32x16 acc, I32x16 w, int32_t x4) {  // (as the AVX-512 tier's)
    const __m256i x = _mm256_set1_epi32(x4);
    return {_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(w.a, x)), _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(w.b, x))};
  }
  I32x16 widen_pairs() const {
    const __m256i ones = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)};
  }
  // acc + each lane's 4 bytes less 128 . x4's, for any byte: s = u - 128 is a signed byte, and |s| (up to 128,
  // unsigned) times x with s's sign (vpsignb; x is in [-127, 127]) keeps every pair within int16 (2 * 128 * 127),
  // so one vpmaddubsw and one vpmaddwd take what dot4<false> takes two of each for.
  static I32x16 centered_dot4(I32x16 acc, I32x16 w, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4), flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    const auto half = [&](__m256i acc_half, __m256i u) {
      const __m256i s = _mm256_xor_si256(u, flip);
      return _mm256_add_epi32(acc_half, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(x, s)), ones));
    };
    return {half(acc.a, w.a), half(acc.b, w.b)};
  }
};

#else  // portable and NEON: plain loops the compiler vectorises

struct F32x16 {
  float v[16];
#define APPLIANCE_LANES(expr) F32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = (expr); return r;
  static F32x16 zero() { APPLIANCE_LANES(0.f) }
  static F32x16 set1(float x) { APPLIANCE_LANES(x) }
  static F32x16 load(const float* p) { APPLIANCE_LANES(p[i]) }
  static F32x16 load_half(const uint16_t* p) { APPLIANCE_LANES(fp16_to_float(p[i])) }
  static F32x16 load_u8(const uint8_t* p) { APPLIANCE_LANES(static_cast<float>(p[i])) }
  static F32x16 load_i8(const int8_t* p) { APPLIANCE_LANES(static_cast<float>(p[i])) }
  static F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) { APPLIANCE_LANES(a.v[i] * b.v[i] + c.v[i]) }
  friend F32x16 operator*(F32x16 a, F32x16 b) { APPLIANCE_LANES(a.v[i] * b.v[i]) }
  friend F32x16 operator+(F32x16 a, F32x16 b) { APPLIANCE_LANES(a.v[i] + b.v[i]) }
#undef APPLIANCE_LANES
  void store(float* p) const { for (int i = 0; i < 16; ++i) p[i] = v[i]; }
};

struct I32x16 {
  int32_t v[16];
#define APPLIANCE_LANES(expr) I32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = (expr); return r;
  static I32x16 zero() { APPLIANCE_LANES(0) }
  static I32x16 set1(int32_t x) { APPLIANCE_LANES(x) }
  static I32x16 load(const uint8_t* p) { I32x16 r; std::memcpy(r.v, p, 64); return r; }  // little-endian lanes
  static I32x16 load_i8(const int8_t* p) { APPLIANCE_LANES(p[i]) }
  static I32x16 load_u8(const uint8_t* p) { APPLIANCE_LANES(p[i]) }
  void store(uint8_t* p) const { std::memcpy(p, v, 64); }
  I32x16 low_nibbles() const { APPLIANCE_LANES(v[i] & 0x0f0f0f0f) }
  I32x16 high_nibbles() const { APPLIANCE_LANES(static_cast<int32_t>((static_cast<uint32_t>(v[i]) >> 4) & 0x0f0f0f0fu)) }
  I32x16 crumbs(int t) const { APPLIANCE_LANES(static_cast<int32_t>((static_cast<uint32_t>(v[i]) >> (2 * t)) & 0x03030303u)) }
  I32x16 byte_words(int odd) const {
    APPLIANCE_LANES(static_cast<int32_t>((static_cast<uint32_t>(v[i]) >> (16 * odd) & 0xffu) | (static_cast<uint32_t>(v[i]) >> (16 * odd + 8) & 0xffu) << 16))
  }
  static int32_t word(int32_t lane, int w) { return static_cast<int16_t>(static_cast<uint16_t>(static_cast<uint32_t>(lane) >> (16 * w))); }
  static uint32_t words(int32_t low, int32_t high) { return static_cast<uint16_t>(low) | static_cast<uint32_t>(static_cast<uint16_t>(high)) << 16; }
  I32x16 words_times(int zero, I32x16 f) const {
    APPLIANCE_LANES(static_cast<int32_t>(words((word(v[i], 0) - zero) * word(f.v[i], 0), (word(v[i], 1) - zero) * word(f.v[i], 1))))
  }
  static I32x16 dot2(I32x16 acc, I32x16 w, int32_t x2) {
    APPLIANCE_LANES(acc.v[i] + word(w.v[i], 0) * word(x2, 0) + word(w.v[i], 1) * word(x2, 1))
  }
  void keep() {}  // (as above)
  static I32x16 table16(const uint8_t* t) { I32x16 r{}; std::memcpy(r.v, t, 16); return r; }  // (lanes 4.. unused)
  I32x16 lookup(I32x16 table) const {
    const uint8_t* entries = reinterpret_cast<const uint8_t*>(table.v);
    const uint8_t* in = reinterpret_cast<const uint8_t*>(v);
    I32x16 r;
    uint8_t* out = reinterpret_cast<uint8_t*>(r.v);
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_neon  // one tbl a 16 bytes (the indices are below 16)
    const uint8x16_t t = vld1q_u8(entries);
    for (int i = 0; i < 64; i += 16) vst1q_u8(out + i, vqtbl1q_u8(t, vld1q_u8(in + i)));
#else
    for (int i = 0; i < 64; ++i) out[i] = entries[in[i] & 15];
#endif
    return r;
  }
  I32x16 plus_where(const uint8_t* bits, int value) const {
    I32x16 r;
    const uint8_t* in = reinterpret_cast<const uint8_t*>(v);
    uint8_t* out = reinterpret_cast<uint8_t*>(r.v);
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_neon  // each bit tested in its own byte: 0xff where set, and-ed with value
    const uint8x16_t select = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201u)), add = vdupq_n_u8(static_cast<uint8_t>(value));
    for (int i = 0; i < 64; i += 16) {
      const uint8x16_t spread = vcombine_u8(vdup_n_u8(bits[i / 8]), vdup_n_u8(bits[i / 8 + 1]));
      vst1q_u8(out + i, vaddq_u8(vld1q_u8(in + i), vandq_u8(vtstq_u8(spread, select), add)));
    }
#else
    for (int i = 0; i < 64; ++i) out[i] = static_cast<uint8_t>(in[i] + ((bits[i / 8] >> (i % 8)) & 1) * value);
#endif
    return r;
  }
  template <int I> I32x16 byte() const { APPLIANCE_LANES(static_cast<int32_t>((static_cast<uint32_t>(v[i]) >> (8 * I)) & 0xffu)) }
  I32x16 shl8() const { APPLIANCE_LANES(static_cast<int32_t>(static_cast<uint32_t>(v[i]) << 8)) }
  friend I32x16 operator+(I32x16 a, I32x16 b) { APPLIANCE_LANES(a.v[i] + b.v[i]) }
  friend I32x16 operator-(I32x16 a, I32x16 b) { APPLIANCE_LANES(a.v[i] - b.v[i]) }
  friend I32x16 operator*(I32x16 a, I32x16 b) { APPLIANCE_LANES(static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) * static_cast<uint32_t>(b.v[i]))) }
#undef APPLIANCE_LANES
  F32x16 to_float() const { F32x16 r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(v[i]); return r; }
  F32x16 bf16_low() const { return bits(0); }
  F32x16 bf16_high() const { return bits(16); }
  F32x16 bits(int shift) const {  // the bfloat16 at bit `shift` of each lane, as float
    F32x16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_float(static_cast<bf16>(static_cast<uint32_t>(v[i]) >> shift));
    return r;
  }
  template <bool kSmall>
  static I32x16 dot4(I32x16 acc, I32x16 w, int32_t x4) {
    for (int i = 0; i < 16; ++i) {
      const uint32_t u = static_cast<uint32_t>(w.v[i]);
      int32_t s = 0;
      for (int b = 0; b < 4; ++b) s += static_cast<int32_t>((u >> (8 * b)) & 0xffu) * static_cast<int8_t>(x4 >> (8 * b));
      acc.v[i] += s;
    }
    return acc;
  }
  static I32x16 pairs(I32x16 acc, I32x16 w, int32_t x4) { return dot4<true>(acc, w, x4); }  // (int32 throughout)
  I32x16 widen_pairs() const { return *this; }
  static I32x16 centered_dot4(I32x16 acc, I32x16 w, int32_t x4) {  // (kCenteredDots is false here)
    return dot4<false>(acc, w, x4) - set1(128 * byte_sum(x4));
  }
};

#endif

// One pair of bfloat16 in each of the 16 lanes (packed BF16 weights, a bfloat16 KV cache) times the pair
// x[0], x[1]: vdpbf16ps where the CPU has it (float32 products of bfloat16 x, exact, summed in float32),
// else two FMAs on the widened pair; float32 x always takes the FMAs, so x is never rounded.
inline F32x16 pair_dot(F32x16 acc, const I32x16& w, const float* x) {
  return F32x16::fmadd(w.bf16_high(), F32x16::set1(x[1]), F32x16::fmadd(w.bf16_low(), F32x16::set1(x[0]), acc));
}
inline F32x16 pair_dot(F32x16 acc, const I32x16& w, const bf16* x) {
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<const __m512bh&>(w.v), reinterpret_cast<const __m512bh&>(
                                                                                 static_cast<const __m512i&>(_mm512_set1_epi32(pair))))};
#else
  return F32x16::fmadd(w.bf16_high(), F32x16::set1(bf16_to_float(x[1])),
                       F32x16::fmadd(w.bf16_low(), F32x16::set1(bf16_to_float(x[0])), acc));
#endif
}

// exp(x) to about 2 ulp: x = n*ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, times 2^n.
inline VecF exp(VecF x) {
  x = VecF::min(VecF::max(x, VecF::set1(-87.3f)), VecF::set1(88.3f));
  VecF n = VecF::round(x * VecF::set1(1.44269504088896341f));
  VecF r = VecF::fmadd(n, VecF::set1(-0.693359375f), x);
  r = VecF::fmadd(n, VecF::set1(2.12194440e-4f), r);
  VecF p = VecF::set1(1.9875691500e-4f);
  p = VecF::fmadd(p, r, VecF::set1(1.3981999507e-3f));
  p = VecF::fmadd(p, r, VecF::set1(8.3334519073e-3f));
  p = VecF::fmadd(p, r, VecF::set1(4.1665795894e-2f));
  p = VecF::fmadd(p, r, VecF::set1(1.6666665459e-1f));
  p = VecF::fmadd(p, r, VecF::set1(5.0000001201e-1f));
  p = VecF::fmadd(p * r, r, r + VecF::set1(1.f));
  return p * VecF::pow2(n);
}

}  // namespace APPLIANCE_ISA
}  // namespace appliance
