// Linear layers on GGUF-quantized weights that stay quantized in memory (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// and the superblock types Q2_K to Q6_K and IQ4_XS as stored; where a tensor-parallel cut is off 256, the
// superblock types as convert_quant's exact blocks of 32), and on bfloat16 weights
// packed the same way (BF16: vdpbf16ps with AVX512-BF16 where it is fast, kernels.h bf16_dot; float32 FMAs
// elsewhere).
//
// A decode step reads every weight once: a Q4_1 weight is 5 bits, a float32 one 32. pack_quant (pack.cpp) repacks
// the file's rows once, at load, into panels of 16 rows whose bytes sit in the int32 lanes that VNNI's
// vpdpbusd multiplies (the layout is in kernels.h). Each packed_linear call then
//   - quantizes x per block of 32 into one or two int8 planes (ActQuant int8, int16), or keeps it float
//     (ActQuant none: the exact path);
//   - runs tiles of MR activation rows x NP panels: per block, int32 dot products of the unsigned quants
//     with the signed activation bytes, then per lane one float32 FMA with the block's scales; (none:
//     float32 FMAs on the exactly widened quants, scaled per block the same way);
//   - splits the tiles over the threads by panels (few rows: decode streams the weights once) and, for
//     many rows, by chunks of rows too (prefill: a panel's blocks stay in cache while the rows go past).
// The integer dot products are exact, so every ISA computes the same sums up to float32 rounding.
// dequantize (GGUF rows -> float) serves the weights no kernel takes, expanded at load.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

inline uint16_t u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512
#define APPLIANCE_SIMD_DEQUANT 1
// One block in two registers of 16 weights: bytes widened to int32 lanes, converted, scaled (and
// offset) with one FMA.
template <QType Q>
inline void block_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(u16(b)));
  if constexpr (Q == QType::q8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Q == QType::q4_1 ? 4 : 2))));
    const __m512 m = Q == QType::q4_1 ? _mm512_set1_ps(_cvtsh_ss(u16(b + 2))) : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), m);
    hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
  }
}

template <QType Q>
void dequant_row(const uint8_t* row, int64_t blocks, float* out) {
  constexpr int64_t bytes = Q == QType::q8_0 ? 34 : Q == QType::q4_1 ? 20 : 18;
  for (int64_t b = 0; b < blocks; ++b, row += bytes, out += kQuantBlock) {
    __m512 lo, hi;
    block_registers<Q>(row, lo, hi);
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
  }
}
#elif APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2
#define APPLIANCE_SIMD_DEQUANT 1
template <QType Q>
void dequant_row(const uint8_t* row, int64_t blocks, float* out) {  // as above, 8 weights a register
  constexpr int64_t bytes = Q == QType::q8_0 ? 34 : Q == QType::q4_1 ? 20 : 18;
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < blocks; ++b, row += bytes, out += kQuantBlock) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(u16(row)));
    if constexpr (Q == QType::q8_0) {
      for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + 8 * i));
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
    } else {
      const __m256 m = Q == QType::q4_1 ? _mm256_set1_ps(_cvtsh_ss(u16(row + 2))) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
      const uint8_t* qs = row + (Q == QType::q4_1 ? 4 : 2);
      for (int i = 0; i < 2; ++i) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)));
        _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, low4)), m));
        _mm256_storeu_ps(out + 16 + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m));
      }
    }
  }
}
#endif

#ifndef APPLIANCE_SIMD_DEQUANT
template <QType Q>
void dequant_row(const uint8_t* row, int64_t blocks, float* out) {  // plain loops the compiler vectorises
  constexpr int64_t bytes = Q == QType::q8_0 ? 34 : Q == QType::q4_1 ? 20 : 18;
  for (int64_t b = 0; b < blocks; ++b, row += bytes, out += kQuantBlock) {
    const float d = fp16_to_float(u16(row));
    if constexpr (Q == QType::q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
      for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
    } else if constexpr (Q == QType::q4_0) {
      const uint8_t* q = row + 2;
      for (int i = 0; i < 16; ++i) {
        out[i] = d * static_cast<float>(static_cast<int>(q[i] & 15) - 8);
        out[i + 16] = d * static_cast<float>(static_cast<int>(q[i] >> 4) - 8);
      }
    } else {
      const float m = fp16_to_float(u16(row + 2));
      const uint8_t* q = row + 4;
      for (int i = 0; i < 16; ++i) {
        out[i] = d * static_cast<float>(q[i] & 15) + m;
        out[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
      }
    }
  }
}
#endif

// Our own blocks (Q4_M32, Q8_M32, Q8_H32, IQ4_F32, Q4_HM32: f32 scalars, then the quants; see kernels.h) and IQ4_NL,
// plainly: they are expanded only where a shard does not fall on blocks, or for a test.
void dequant_row_f32_scaled(QType q, const uint8_t* row, int64_t blocks, float* out) {
  const int64_t bytes = quant_block_bytes(q);
  const PackedLayout L = packed_layout(q);
  const int scalars = scalar_count(L);
  for (int64_t b = 0; b < blocks; ++b, row += bytes, out += kQuantBlock) {
    float f[4] = {0.f, 0.f, 0.f, 0.f};  // d and m, or (halves) d0 and d1 (and m0, m1)
    if (L.scale_bytes == 2) f[0] = fp16_to_float(u16(row));  // IQ4_NL
    else std::memcpy(f, row, 4 * scalars);
    const uint8_t* u = row + L.scale_bytes * scalars;
    for (int i = 0; i < kQuantBlock; ++i) {
      int v = L.bits == 4 ? (u[i % 16] >> (i < 16 ? 0 : 4)) & 15 : u[i];
      if (L.lut) v = kIq4Unsigned[v];
      if (L.halves) out[i] = f[i >= 16] * static_cast<float>(v - L.zero) + f[2 + (i >= 16)];
      else out[i] = f[0] * static_cast<float>(v - L.zero) + f[1];
    }
  }
}

// Q4_0, Q4_1, Q8_0 and our blocks of 32 only: module.cpp converts K-quant and Q5 rows into those first.
void dequant_rows(QType q, const uint8_t* w, int64_t rows, int64_t k, float* out) {
  const int64_t blocks = k / kQuantBlock, bytes = blocks * quant_block_bytes(q);
  for (int64_t r = 0; r < rows; ++r) {
    if (packed_layout(q).scale_bytes == 4 || packed_layout(q).lut) dequant_row_f32_scaled(q, w + r * bytes, blocks, out + r * k);
    else if (q == QType::q8_0) dequant_row<QType::q8_0>(w + r * bytes, blocks, out + r * k);
    else if (q == QType::q4_0) dequant_row<QType::q4_0>(w + r * bytes, blocks, out + r * k);
    else dequant_row<QType::q4_1>(w + r * bytes, blocks, out + r * k);
  }
}

// ---- activations, per block of 32: x = scale * (the block's combined integers) ----

struct Activations {
  int planes = 0;             // 1 (int8: h), 2 (int16: 256 h + l); 0: float rows (ActQuant none)
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;      // [rows][blocks][planes][32]
  std::vector<float> scale;   // [rows][blocks]
  std::vector<int32_t> isum;  // [rows][blocks]: the sum of the block's combined integers
  bool halves = false;        // weights with a scale per 16 (Q3_K, Q6_K, Q8_H32): the first-half sums too
  std::vector<int32_t> isum_first;  // [rows][blocks]: the same sum over the block's first 16
  std::vector<float> fsum;    // [rows][blocks]: the sum of the block's x as the kernel sees it
  std::vector<float> fx;      // planes 0: x as float32 rows [rows][K]
  bool words = false;         // the word tiles run (Q2_K, Q3_K, Q6_K under many row tiles): xw too
  std::vector<int16_t> xw;    // [rows][blocks][32]: the combined integers 256 h + l
};

// Rows a row tile takes: int16 keeps two int32 accumulators per (row, panel) (see row_tiles).
constexpr int tile_rows(int planes) { return planes == 2 ? 3 : 4; }
// Q2_K, Q3_K and Q6_K run as words (expand_words) where a row chunk of int16 activations holds more rows than
// this (with int8's one plane, words would take twice the halves tile's multiplies): four row tiles, or for Q2_K,
// whose crumbs make 8 times their bytes of words, twelve (2,048 x 8,192 on the Xeon: Q2_K at 13-24 rows 20-30%
// slower as words; at 128, 15% faster).
inline int64_t word_rows_above(const PackedLayout& L) {
  const bool word_type = L.halves && L.scale_bytes == 1;
  return !word_type ? INT64_MAX : L.has_min ? 12 * tile_rows(2) : 4 * tile_rows(2);
}

// One block: h = round(x * 127 / max|x|) and, with two planes, l = round((x * 127 / max|x| - h) * 256),
// both in [-127, 127]; x is then max|x| / 127 * (h + l / 256) to about 2^-16 of max|x|.
template <typename T, bool kHalves>
void quantize_block(const T* x, int planes, int8_t* q, float& scale, int32_t& isum, int32_t* isum_first) {
  constexpr int V = kQuantBlock / VecF::N;
  VecF v[V];  // in registers throughout: going through a float array on the stack stalled on store forwarding
  VecF peak = VecF::zero();
  for (int c = 0; c < V; ++c) {
    v[c] = VecF::load(x + c * VecF::N);
    peak = VecF::max(peak, VecF::max(v[c], VecF::zero() - v[c]));
  }
  const float amax = peak.reduce_max();
  if (!(amax > 0.f)) {
    std::memset(q, 0, planes * kQuantBlock);
    scale = 0.f, isum = 0;
    if (kHalves) *isum_first = 0;
    return;
  }
  const VecF inv = VecF::set1(127.f / amax);
  VecF sum = VecF::zero(), first = VecF::zero();  // of the combined integers, exact in float32 (|256 h + l| * 32 < 2^24)
  for (int c = 0; c < V; ++c) {
    if (kHalves && c == V / 2) first = sum;
    const VecF y = v[c] * inv, h = VecF::round(y);
    h.store_int8(q + c * VecF::N);
    if (planes == 2) {
      const VecF l = VecF::min(VecF::max(VecF::round((y - h) * VecF::set1(256.f)), VecF::set1(-127.f)), VecF::set1(127.f));
      l.store_int8(q + kQuantBlock + c * VecF::N);
      sum = sum + VecF::fmadd(h, VecF::set1(256.f), l);
    } else {
      sum = sum + h;
    }
  }
  scale = planes == 2 ? amax / 127.f / 256.f : amax / 127.f;
  isum = static_cast<int32_t>(sum.reduce_add());  // one horizontal sum a block: they were the critical path
  if (kHalves) *isum_first = static_cast<int32_t>(first.reduce_add());
}

template <typename T>
void prepare_row(const T* x, int64_t k, Activations& a, int64_t row) {
  const int64_t at = row * a.blocks;
  if (a.planes == 0) {
    float* f = a.fx.data() + row * k;
    for (int64_t c = 0; c < k; ++c) f[c] = to_float(x[c]);
    for (int64_t b = 0; b < a.blocks; ++b) {
      float s = 0.f;
      for (int i = 0; i < kQuantBlock; ++i) s += f[b * kQuantBlock + i];
      a.fsum[at + b] = s;
    }
    return;
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    int8_t* q = a.q.data() + (at + b) * a.planes * kQuantBlock;
    if (a.halves) quantize_block<T, true>(x + b * kQuantBlock, a.planes, q, a.scale[at + b], a.isum[at + b], &a.isum_first[at + b]);
    else quantize_block<T, false>(x + b * kQuantBlock, a.planes, q, a.scale[at + b], a.isum[at + b], nullptr);
    a.fsum[at + b] = a.scale[at + b] * static_cast<float>(a.isum[at + b]);
    if (a.words) {
      int16_t* w = a.xw.data() + (at + b) * kQuantBlock;
      for (int i = 0; i < kQuantBlock; ++i) w[i] = static_cast<int16_t>(256 * q[i] + q[kQuantBlock + i]);
    }
  }
}

// Room for x's blocks, sized before any thread writes them.
void size_for(const PackedLinearArgs& p, Activations& a) {
  a.planes = static_cast<int>(p.act), a.rows = p.rows, a.blocks = p.in_features / kQuantBlock;
  a.halves = packed_layout(p.qtype).halves, a.words = false;
  const size_t cells = static_cast<size_t>(a.rows * a.blocks);
  a.fsum.resize(cells);
  if (a.planes == 0) {
    a.fx.resize(cells * kQuantBlock);
  } else {
    a.q.resize(cells * a.planes * kQuantBlock), a.scale.resize(cells), a.isum.resize(cells);
    if (a.halves) a.isum_first.resize(cells);
    a.words = a.planes == 2 && a.rows > word_rows_above(packed_layout(p.qtype));
    if (a.words) a.xw.resize(cells * kQuantBlock);
  }
}

void prepare(const PackedLinearArgs& p, Activations& a, int64_t row) {
  if (p.x_dtype == DType::f32) prepare_row(static_cast<const float*>(p.x) + row * p.x_stride, p.in_features, a, row);
  else prepare_row(static_cast<const bf16*>(p.x) + row * p.x_stride, p.in_features, a, row);
}

// ---- tiles: MR activation rows x NP panels of 16 weight rows ----

struct Tiles {  // what every tile of one call shares
  const uint8_t* weight;
  PackedLayout layout;
  int64_t blocks, panel_bytes, out_features;
  const Activations* x;  // as prepared (quantized types)
  void* out;
  DType out_dtype;
  int64_t out_stride;
  const void* x_rows;    // x as given (BF16 weights read it directly)
  DType x_dtype;
  int64_t x_stride;
};

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <typename T>
void store_lanes(const F32x16& v, T* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == kPanelRows) return v.store(out);
  }
  float lanes[kPanelRows];
  v.store(lanes);
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(lanes[i]);
}

template <int MR, int NP>
void store_tile(const Tiles& t, int64_t r0, int64_t p0, const F32x16 (&acc)[MR][NP]) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) {
      const int64_t col = (p0 + j) * kPanelRows, n = std::min<int64_t>(kPanelRows, t.out_features - col);
      if (n <= 0) continue;
      const int64_t at = (r0 + r) * t.out_stride + col;
      if (t.out_dtype == DType::f32) store_lanes(acc[r][j], static_cast<float*>(t.out) + at, n);
      else store_lanes(acc[r][j], static_cast<bf16*>(t.out) + at, n);
    }
}

// Block b of panel `panel` (past the heads of its superblock and those before, for the K-quants: no branch),
// and its 16 rows' scales d and mins m (zero unless the type has them; with halves, m is d1, the second 16
// weights' scale).
const uint8_t* panel_block(const Tiles& t, int64_t panel, int64_t b) {
  return t.weight + panel * t.panel_bytes + (b / kSuperBlocks + 1) * t.layout.super_head + b * t.layout.block_bytes;
}
// A K-quant block's superblock head (its 16 rows' scalars), and within it the block's codes (16, then 16;
// IQ4_XS has one code a row).
inline const uint8_t* super_head(const PackedLayout& L, const uint8_t* blk, int64_t b) {
  return blk - b % kSuperBlocks * L.block_bytes - L.super_head;
}
inline int64_t code_bytes(const PackedLayout& L) { return (L.super_head - 4 * kPanelRows) / kSuperBlocks; }
inline const uint8_t* block_codes(const PackedLayout& L, const uint8_t* head, int64_t b) {
  return head + 4 * kPanelRows + b % kSuperBlocks * code_bytes(L);
}
// The scales' kind, known at compile time in the integer tiles (a test per block in Q4_1's decode tile cost
// it 4%, A/B on Zen 5): fp16 (GGML's types), float32 (ours), or codes in the head of block b's superblock:
// Q4_K's and Q5_K's (a byte a row for the scale, one for the min) times its fp16 d and -dmin, Q3_K's and
// Q6_K's (a signed byte a row for each half) times its d, IQ4_XS's (a signed byte a row) times its d.
// Products of fp16 and a 6- or 8-bit integer: exact in float32, the same scales Q4_M32, Q8_M32, Q8_H32 and
// IQ4_F32 hold.
// Q2_K's (kHalfCodesMin: a byte a row for each half's scale and min) times its fp16 d and -dmin.
constexpr int kFp16 = 2, kF32 = 4, kCodes = 1, kHalfCodes = 3, kSignedCodes = 6, kHalfCodesMin = 7;
// kExpanded: Q4_K's and Q5_K's d and m as kCodes forms them, expanded once for a run of row tiles over the
// same panels (expand_scales), so that the tiles after the first do not form them again. (Q6_K's, which
// take fewer instructions to form, ran slower so: 2048 x 8192 at 8 and 32 rows, +4-50%.)
constexpr int kExpanded = 5;
thread_local std::vector<float> expanded_scales;  // [blocks][NP][d, m][16]
template <int SCALES>
void block_scales(const PackedLayout& L, const uint8_t* blk, int64_t b, F32x16& d, F32x16& m) {
  if constexpr (SCALES == kSignedCodes) {
    const uint8_t* head = super_head(L, blk, b);
    const int8_t* codes = reinterpret_cast<const int8_t*>(block_codes(L, head, b));
    d = F32x16::load(reinterpret_cast<const float*>(head)) * F32x16::load_i8(codes);
    m = F32x16::zero();
  } else if constexpr (SCALES == kF32) {
    const float* scales = reinterpret_cast<const float*>(blk + L.quant_bytes);
    d = F32x16::load(scales);
    m = L.has_min ? F32x16::load(scales + kPanelRows) : F32x16::zero();
  } else if constexpr (SCALES == kCodes) {
    const uint8_t* head = super_head(L, blk, b);
    const uint8_t* codes = block_codes(L, head, b);
    d = F32x16::load_half(reinterpret_cast<const uint16_t*>(head)) * F32x16::load_u8(codes);
    m = F32x16::load_half(reinterpret_cast<const uint16_t*>(head) + kPanelRows) * F32x16::load_u8(codes + kPanelRows);
  } else {
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + L.quant_bytes);
    d = F32x16::load_half(scales);
    m = L.has_min ? F32x16::load_half(scales + kPanelRows) : F32x16::zero();
  }
}
// (types with a scale per 16 weights, halves, take half_scales below)
void block_scales(const PackedLayout& L, const uint8_t* blk, int64_t b, F32x16& d, F32x16& m) {
  if (L.scale_bytes == 4) block_scales<kF32>(L, blk, b, d, m);
  else if (L.scale_bytes == 1 && L.has_min) block_scales<kCodes>(L, blk, b, d, m);
  else if (L.scale_bytes == 1) block_scales<kSignedCodes>(L, blk, b, d, m);
  else block_scales<kFp16>(L, blk, b, d, m);
}

// A block's scales where it has one per 16 weights (halves): d0 and d1, and with kMin (Q2_K, Q4_HM32) the
// mins m0 and m1, else zero.
template <int SCALES, bool kMin>
void half_scales(const PackedLayout& L, const uint8_t* blk, int64_t b, F32x16& d0, F32x16& d1, F32x16& m0, F32x16& m1) {
  m0 = m1 = F32x16::zero();
  if constexpr (SCALES == kHalfCodesMin) {  // Q2_K
    const uint8_t* head = super_head(L, blk, b);
    const uint8_t* codes = block_codes(L, head, b);
    const F32x16 d = F32x16::load_half(reinterpret_cast<const uint16_t*>(head));
    const F32x16 dmin = F32x16::load_half(reinterpret_cast<const uint16_t*>(head) + kPanelRows);  // -dmin
    d0 = d * F32x16::load_u8(codes), d1 = d * F32x16::load_u8(codes + kPanelRows);
    if constexpr (kMin) m0 = dmin * F32x16::load_u8(codes + 2 * kPanelRows), m1 = dmin * F32x16::load_u8(codes + 3 * kPanelRows);
  } else if constexpr (SCALES == kF32) {  // Q8_H32, Q4_HM32
    const float* scales = reinterpret_cast<const float*>(blk + L.quant_bytes);
    d0 = F32x16::load(scales), d1 = F32x16::load(scales + kPanelRows);
    if constexpr (kMin) m0 = F32x16::load(scales + 2 * kPanelRows), m1 = F32x16::load(scales + 3 * kPanelRows);
  } else {  // kHalfCodes: Q3_K, Q6_K (f32 d, a signed code for each half)
    const uint8_t* head = super_head(L, blk, b);
    const int8_t* codes = reinterpret_cast<const int8_t*>(block_codes(L, head, b));
    const F32x16 scale = F32x16::load(reinterpret_cast<const float*>(head));
    d0 = scale * F32x16::load_i8(codes), d1 = scale * F32x16::load_i8(codes + kPanelRows);
  }
}
void half_scales(const PackedLayout& L, const uint8_t* blk, int64_t b, F32x16& d0, F32x16& d1, F32x16& m0, F32x16& m1) {
  if (L.scale_bytes == 4 && L.has_min) half_scales<kF32, true>(L, blk, b, d0, d1, m0, m1);
  else if (L.scale_bytes == 4) half_scales<kF32, false>(L, blk, b, d0, d1, m0, m1);
  else if (L.has_min) half_scales<kHalfCodesMin, true>(L, blk, b, d0, d1, m0, m1);
  else half_scales<kHalfCodes, false>(L, blk, b, d0, d1, m0, m1);
}

// Every tile starts its accumulators at zero and reads block b of its NP panels.
template <int MR, int NP>
void zero_all(F32x16 (&acc)[MR][NP]) {
  for (auto& row : acc)
    for (auto& a : row) a = F32x16::zero();
}
template <int NP>
void panel_blocks(const Tiles& t, int64_t p0, int64_t b, const uint8_t* (&blk)[NP]) {
  for (int j = 0; j < NP; ++j) blk[j] = panel_block(t, p0 + j, b);
}
// The same where the layout is known at compile time: types without superblocks skip their heads' term
// (with it, a default-spec decode step at batch 8 took ~3% longer).
template <int NP, bool kSuper>
void panel_blocks(const Tiles& t, int64_t p0, int64_t b, const uint8_t* (&blk)[NP]) {
  if constexpr (kSuper) return panel_blocks(t, p0, b, blk);
  for (int j = 0; j < NP; ++j) blk[j] = t.weight + (p0 + j) * t.panel_bytes + b * t.layout.block_bytes;
}

constexpr int64_t kRowChunk = 64;  // rows a work item takes: their activations (K x 2 bytes each) stay in L2

// A step reads each weight from DRAM once, in the first row tile of a work item (the next tiles find its
// panels in L1/L2). A panel of the default model is ~6 KiB, so the hardware prefetchers, which restart at
// every 4 KiB page, left that tile waiting on memory: it asks for its panels' blocks ~2 KiB ahead.
// Decode step, default spec, context 300, A/B x 4 on Zen 5: batch 1 4.05 -> 3.45 ms, 8 10.55 -> 9.15, 32 28.2 -> 27.3.
constexpr int64_t kPrefetchBytes = 2048;
inline int64_t blocks_ahead(const Tiles& t, int64_t r0) {
  return r0 % kRowChunk == 0 ? std::max<int64_t>(1, kPrefetchBytes / t.layout.mean_block_bytes()) : 0;
}
template <int NP>
inline void prefetch_blocks(const Tiles& t, const uint8_t* const (&blk)[NP], int64_t b, int64_t ahead) {
  if (ahead == 0 || b + ahead >= t.blocks) return;
  const int64_t stride = t.layout.mean_block_bytes();  // (a K-quant superblock's head spread over its blocks)
  for (int j = 0; j < NP; ++j)
    for (int64_t line = 0; line < stride; line += 64) __builtin_prefetch(blk[j] + ahead * stride + line, 0, 3);
  // Keeps GCC from dropping prefetches as side-effect free (see attention.cpp). It also makes the compiler
  // reload what it kept of memory in registers, once a block in the first tile: measured as a net gain.
  asm volatile("" ::: "memory");
}

// The panels a thread's next row tile of a new panel pair will read first ([pre, pre + NP), block b), into
// L2 while this thread's later row tiles rework panels already in L1 (see row_tiles).
template <int NP>
inline void prefetch_next(const Tiles& t, int64_t pre, int64_t b) {
  for (int j = 0; j < NP; ++j) {
    const uint8_t* block = panel_block(t, pre + j, b);
    if (t.layout.super_head && b % kSuperBlocks == 0)  // a superblock's head, as its first block is asked for
      for (int64_t line = 0; line < t.layout.super_head; line += 64) __builtin_prefetch(block - t.layout.super_head + line, 0, 2);
    for (int64_t line = 0; line < t.layout.block_bytes; line += 64) __builtin_prefetch(block + line, 0, 2);
  }
  asm volatile("" ::: "memory");  // as in prefetch_blocks
}

// Vector g of half h of a block (weights 16h+4g..16h+4g+3 of its rows, kernels.h): its `low` low bits w, plus
// bit low + p from each of `planes` planes after them, one masked byte add a plane (Q3_K, Q5_0, Q5_1, Q5_K:
// one; Q6_K: two). The tiles pass constants; the float tile the layout's.
inline I32x16 plus_planes(I32x16 w, const uint8_t* blk, int g, int h, int low, int planes) {
  for (int p = 0; p < planes; ++p) w = w.plus_where(blk + high_bits_offset(p, g, h, low), 1 << (low + p));
  return w;
}
// BITS 4 to 6: the low bits are vector g's low (h = 0) or high (h = 1) nibbles, v (loaded once for both).
template <int BITS>
inline I32x16 nibble_weights(const uint8_t* blk, const I32x16& v, int g, int h) {
  return plus_planes(h == 0 ? v.low_nibbles() : v.high_nibbles(), blk, g, h, 4, BITS - 4);
}
// BITS 2 to 6: BITS 2 and 3 (Q2_K; Q3_K) hold their low bits as crumbs, bits 2g and 2g + 1 of vector h.
template <int BITS>
inline I32x16 block_weights(const uint8_t* blk, int g, int h) {
  if constexpr (BITS < 4) return plus_planes(I32x16::load(blk + 64 * h).crumbs(g), blk, g, h, 2, BITS - 2);
  else return nibble_weights<BITS>(blk, I32x16::load(blk + 64 * g), g, h);
}

// Byte weights' groups [g0, g1) of a block (4 weights each) against x's bytes: into hi and lo, the two
// planes, or with one plane alternate groups, so that enough independent chains are in flight.
template <int MR, int NP, int PLANES, bool kSmall>
inline void byte_groups(const uint8_t* const (&blk)[NP], const int8_t* const (&xb)[MR], int g0, int g1,
                        I32x16 (&hi)[MR][NP], I32x16 (&lo)[MR][NP]) {
  for (int g = g0; g < g1; ++g)
    for (int j = 0; j < NP; ++j) {
      const I32x16 w = I32x16::load(blk[j] + 64 * g);
      for (int r = 0; r < MR; ++r) {
        if constexpr (PLANES == 2) {
          hi[r][j] = I32x16::dot4<kSmall>(hi[r][j], w, load4(xb[r] + 4 * g));
          lo[r][j] = I32x16::dot4<kSmall>(lo[r][j], w, load4(xb[r] + 32 + 4 * g));
        } else if (g % 2 == 0) {
          hi[r][j] = I32x16::dot4<kSmall>(hi[r][j], w, load4(xb[r] + 4 * g));
        } else {
          lo[r][j] = I32x16::dot4<kSmall>(lo[r][j], w, load4(xb[r] + 4 * g));
        }
      }
    }
}

// Integer tile. Per block: int32 dot products into two accumulators per (row, panel) (the two planes,
// or with one plane the two halves of the block, so that enough independent chains are in flight),
// then acc += float(sum - zero * sum(x)) * d * scale (+ m * sum(x) for Q4_1).
// kMin: the type has a min per block and no zero point (Q4_1, Q5_1, Q4_K, Q5_K, Q4_M32, Q8_M32), else a zero
// point and no min (Q4_0, Q5_0, Q8_0, the IQ4 types); known at compile time, so that neither costs a test or a dead
// broadcast per block and row.
// kPre: block b of panels [pre, pre + NP) is asked for too (see row_tiles).
// kLut: the nibbles index the IQ4 codebook; one vpshufb a vector maps them to their u (any byte, as Q8_0's).
template <int MR, int NP, int BITS, int PLANES, int SCALES, bool kMin, bool kPre, bool kLut>
void int_tile(const Tiles& t, int64_t r0, int64_t p0, int64_t pre) {
  // every u < 128 (Q8_M32 holds u < 32, Q5_K's BITS 5; Q8_0's and the codebook's any byte)
  constexpr bool kSmall = !kLut && (BITS <= 6 || SCALES != kFp16);
  const PackedLayout& L = t.layout;
  const Activations& x = *t.x;
  const float* expanded = SCALES == kExpanded ? expanded_scales.data() : nullptr;
  F32x16 acc[MR][NP];
  zero_all(acc);
  const int64_t ahead = blocks_ahead(t, r0);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks<NP, SCALES == kCodes || SCALES == kExpanded || SCALES == kSignedCodes>(t, p0, b, blk);
    prefetch_blocks(t, blk, b, ahead);
    if constexpr (kPre) prefetch_next<NP>(t, pre, b);
    const int8_t* xb[MR];
    for (int r = 0; r < MR; ++r) xb[r] = x.q.data() + ((r0 + r) * t.blocks + b) * PLANES * kQuantBlock;
    I32x16 hi[MR][NP], lo[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) hi[r][j] = lo[r][j] = I32x16::zero();
    if constexpr (BITS <= 6) {
      for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NP; ++j) {
          const I32x16 v = I32x16::load(blk[j] + 64 * g);
          I32x16 wl = nibble_weights<BITS>(blk[j], v, g, 0), wh = nibble_weights<BITS>(blk[j], v, g, 1);
          if constexpr (kLut) {  // (the table's load is hoisted out of the loops)
            const I32x16 table = I32x16::table16(kIq4Unsigned);
            wl = wl.lookup(table), wh = wh.lookup(table);
          }
          for (int r = 0; r < MR; ++r) {
            if constexpr (PLANES == 2) {
              hi[r][j] = I32x16::dot4<kSmall>(hi[r][j], wl, load4(xb[r] + 4 * g));
              hi[r][j] = I32x16::dot4<kSmall>(hi[r][j], wh, load4(xb[r] + 16 + 4 * g));
              lo[r][j] = I32x16::dot4<kSmall>(lo[r][j], wl, load4(xb[r] + 32 + 4 * g));
              lo[r][j] = I32x16::dot4<kSmall>(lo[r][j], wh, load4(xb[r] + 48 + 4 * g));
            } else {
              hi[r][j] = I32x16::dot4<kSmall>(hi[r][j], wl, load4(xb[r] + 4 * g));
              lo[r][j] = I32x16::dot4<kSmall>(lo[r][j], wh, load4(xb[r] + 16 + 4 * g));
            }
          }
        }
    } else {
      byte_groups<MR, NP, PLANES, kSmall>(blk, xb, 0, 8, hi, lo);
    }
    F32x16 d[NP], m[NP];
    if constexpr (SCALES == kExpanded) {
      for (int j = 0; j < NP; ++j) {
        const float* dm = expanded + (b * NP + j) * 2 * kPanelRows;
        d[j] = F32x16::load(dm), m[j] = F32x16::load(dm + kPanelRows);
      }
    } else {
      for (int j = 0; j < NP; ++j) block_scales<SCALES>(L, blk[j], b, d[j], m[j]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t cell = (r0 + r) * t.blocks + b;
      const F32x16 scale = F32x16::set1(x.scale[cell]);
      for (int j = 0; j < NP; ++j) {
        I32x16 total = PLANES == 2 ? hi[r][j].shl8() + lo[r][j] : hi[r][j] + lo[r][j];
        if constexpr (!kMin) total = total - I32x16::set1(L.zero * x.isum[cell]);
        acc[r][j] = F32x16::fmadd(total.to_float(), d[j] * scale, acc[r][j]);
        if constexpr (kMin) acc[r][j] = F32x16::fmadd(m[j], F32x16::set1(x.fsum[cell]), acc[r][j]);
      }
    }
  }
  store_tile<MR, NP>(t, r0, p0, acc);
}

// 2- to 6-bit weights' half h of a block against x's bytes (h = 0: weights 0..15, the low nibbles; 1: 16..31,
// the high ones; or the crumbs of vector h), into hi and lo as byte_groups does.
template <int MR, int NP, int BITS, int PLANES>
inline void quant_half(const uint8_t* const (&blk)[NP], const int8_t* const (&xb)[MR], int h, I32x16 (&hi)[MR][NP],
                       I32x16 (&lo)[MR][NP]) {
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < NP; ++j) {
      const I32x16 w = block_weights<BITS>(blk[j], g, h);
      for (int r = 0; r < MR; ++r) {
        if constexpr (PLANES == 2) {
          hi[r][j] = I32x16::dot4<true>(hi[r][j], w, load4(xb[r] + 16 * h + 4 * g));
          lo[r][j] = I32x16::dot4<true>(lo[r][j], w, load4(xb[r] + 32 + 16 * h + 4 * g));
        } else if (g % 2 == 0) {
          hi[r][j] = I32x16::dot4<true>(hi[r][j], w, load4(xb[r] + 16 * h + 4 * g));
        } else {
          lo[r][j] = I32x16::dot4<true>(lo[r][j], w, load4(xb[r] + 16 * h + 4 * g));
        }
      }
    }
}

// Integer tile for weights with a scale per 16 (Q8_H32; Q6_K's nibbles and Q3_K's crumbs, with their planes; with a
// min per 16, Q2_K's crumbs and Q4_HM32's nibbles): as int_tile, each half of a block summed apart with its own
// share of the zero correction. Their u < 64, so the 16-bit pairs of the emulated dot4 cannot saturate (kSmall).
// Float32 scales (Q8_H32, Q4_HM32): each half folded into the float accumulators under its own scale (kMin: and
// its min times the half's x). Scale codes (Q2_K, Q3_K, Q6_K): each half's integer sum times its code, then
// float(sum0) + float(sum1) under d scale (kMin: then m0 and m1 times each half's x), the word tile's sums in its
// order, so that a row's result does not depend on which of the two its batch took (|sum_h| < 2^31: word_tile).
template <int MR, int NP, int BITS, int PLANES, int SCALES, bool kMin>
void halves_tile(const Tiles& t, int64_t r0, int64_t p0) {
  constexpr bool kSmall = true;
  constexpr bool kCodes = SCALES == kHalfCodes || SCALES == kHalfCodesMin;
  const PackedLayout& L = t.layout;
  const Activations& x = *t.x;
  F32x16 acc[MR][NP];
  zero_all(acc);
  const int64_t ahead = blocks_ahead(t, r0);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks<NP, kCodes>(t, p0, b, blk);
    prefetch_blocks(t, blk, b, ahead);
    const int8_t* xb[MR];
    for (int r = 0; r < MR; ++r) xb[r] = x.q.data() + ((r0 + r) * t.blocks + b) * PLANES * kQuantBlock;
    F32x16 d[2][NP], m[2][NP];
    if constexpr (!kCodes)
      for (int j = 0; j < NP; ++j) half_scales<SCALES, kMin>(L, blk[j], b, d[0][j], d[1][j], m[0][j], m[1][j]);
    F32x16 first_half[MR][NP];  // (codes) float(sum0)
    for (int h = 0; h < 2; ++h) {
      I32x16 hi[MR][NP], lo[MR][NP];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NP; ++j) hi[r][j] = lo[r][j] = I32x16::zero();
      if constexpr (BITS <= 6) quant_half<MR, NP, BITS, PLANES>(blk, xb, h, hi, lo);
      else byte_groups<MR, NP, PLANES, kSmall>(blk, xb, 4 * h, 4 * h + 4, hi, lo);
      I32x16 code[NP];
      if constexpr (kCodes)
        for (int j = 0; j < NP; ++j) {
          const uint8_t* codes = block_codes(L, super_head(L, blk[j], b), b) + kPanelRows * h;
          code[j] = SCALES == kHalfCodesMin ? I32x16::load_u8(codes) : I32x16::load_i8(reinterpret_cast<const int8_t*>(codes));
        }
      for (int r = 0; r < MR; ++r) {
        const int64_t cell = (r0 + r) * t.blocks + b;
        const int32_t first = x.isum_first[cell], part = h == 0 ? first : x.isum[cell] - first;
        const F32x16 scale = F32x16::set1(x.scale[cell]);
        const I32x16 correction = I32x16::set1(L.zero * part);
        const F32x16 xsum = F32x16::set1(x.scale[cell] * static_cast<float>(part));  // the half's x, as quantized
        for (int j = 0; j < NP; ++j) {
          I32x16 total = PLANES == 2 ? hi[r][j].shl8() + lo[r][j] : hi[r][j] + lo[r][j];
          if constexpr (!kMin) total = total - correction;
          if constexpr (kCodes) {
            if (h == 0) {
              first_half[r][j] = (total * code[j]).to_float();
              continue;
            }
            const F32x16 sums = first_half[r][j] + (total * code[j]).to_float();
            const uint8_t* head = super_head(L, blk[j], b);
            const F32x16 dj = SCALES == kHalfCodesMin ? F32x16::load_half(reinterpret_cast<const uint16_t*>(head))
                                                      : F32x16::load(reinterpret_cast<const float*>(head));
            acc[r][j] = F32x16::fmadd(sums, dj * scale, acc[r][j]);
            if constexpr (kMin) {  // -dmin m_h times each half's x
              const uint8_t* mins = block_codes(L, head, b) + 2 * kPanelRows;
              const F32x16 dmin = F32x16::load_half(reinterpret_cast<const uint16_t*>(head) + kPanelRows);
              const F32x16 x0 = F32x16::set1(x.scale[cell] * static_cast<float>(first));
              acc[r][j] = F32x16::fmadd(dmin * F32x16::load_u8(mins), x0, acc[r][j]);
              acc[r][j] = F32x16::fmadd(dmin * F32x16::load_u8(mins + kPanelRows), xsum, acc[r][j]);
            }
          } else {
            acc[r][j] = F32x16::fmadd(total.to_float(), d[h][j] * scale, acc[r][j]);
            if constexpr (kMin) acc[r][j] = F32x16::fmadd(m[h][j], xsum, acc[r][j]);
          }
        }
      }
    }
  }
  store_tile<MR, NP>(t, r0, p0, acc);
}

// Float tile (ActQuant none): the quants widened exactly to float32 (u - zero), four weights of each of
// the 16 rows at a time, FMAs with broadcast x; per block acc += part * d (+ m * sum(x)).
template <int MR, int NP, int BITS>
void float_tile(const Tiles& t, int64_t r0, int64_t p0) {
  const PackedLayout& L = t.layout;
  const Activations& x = *t.x;
  const int64_t k = t.blocks * kQuantBlock;
  const I32x16 zero = I32x16::set1(L.zero), table = I32x16::table16(kIq4Unsigned);
  auto weights = [&](const uint8_t* block, int g, int h) {  // as block_weights, through the codebook for IQ4
    I32x16 w = BITS == 2 ? I32x16::load(block + 64 * h).crumbs(g)
                         : h == 0 ? I32x16::load(block + 64 * g).low_nibbles() : I32x16::load(block + 64 * g).high_nibbles();
    w = plus_planes(w, block, g, h, BITS, L.high_bits);
    return L.lut ? w.lookup(table) : w;
  };
  F32x16 acc[MR][NP];
  zero_all(acc);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks(t, p0, b, blk);
    const float* xb[MR];
    for (int r = 0; r < MR; ++r) xb[r] = x.fx.data() + (r0 + r) * k + b * kQuantBlock;
    F32x16 part[MR][NP];
    zero_all(part);
    auto group = [&](int j, const I32x16& w, int k0) {  // weights k0..k0+3 of the panel's rows
      const F32x16 w0 = (w.byte<0>() - zero).to_float(), w1 = (w.byte<1>() - zero).to_float();
      const F32x16 w2 = (w.byte<2>() - zero).to_float(), w3 = (w.byte<3>() - zero).to_float();
      for (int r = 0; r < MR; ++r) {
        F32x16 p = F32x16::fmadd(w0, F32x16::set1(xb[r][k0]), part[r][j]);
        p = F32x16::fmadd(w1, F32x16::set1(xb[r][k0 + 1]), p);
        p = F32x16::fmadd(w2, F32x16::set1(xb[r][k0 + 2]), p);
        part[r][j] = F32x16::fmadd(w3, F32x16::set1(xb[r][k0 + 3]), p);
      }
    };
    // With halves: each half's sums under its own scale (and min, times x's sum over the half), as it ends.
    F32x16 hd[2][NP], hm[2][NP], xsum[2][MR] = {};
    if (L.halves) {
      for (int j = 0; j < NP; ++j) half_scales(L, blk[j], b, hd[0][j], hd[1][j], hm[0][j], hm[1][j]);
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < 2; ++h) {
          float sum = 0.f;
          for (int i = 0; i < 16; ++i) sum += xb[r][16 * h + i];
          xsum[h][r] = F32x16::set1(sum);
        }
    }
    auto half_under_its_scale = [&](int h) {
      for (int j = 0; j < NP; ++j)
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = F32x16::fmadd(part[r][j], hd[h][j], acc[r][j]), part[r][j] = F32x16::zero();
          if (L.has_min) acc[r][j] = F32x16::fmadd(hm[h][j], xsum[h][r], acc[r][j]);
        }
    };
    if constexpr (BITS <= 4) {
      if (L.halves) {  // Q2_K, Q3_K, Q6_K, Q4_HM32: the first half (the low nibbles, or crumb vector 0), then the second
        for (int g = 0; g < 4; ++g)
          for (int j = 0; j < NP; ++j) group(j, weights(blk[j], g, 0), 4 * g);
        half_under_its_scale(0);
        for (int g = 0; g < 4; ++g)
          for (int j = 0; j < NP; ++j) group(j, weights(blk[j], g, 1), 16 + 4 * g);
      } else {
        for (int g = 0; g < 4; ++g)
          for (int j = 0; j < NP; ++j) {
            group(j, weights(blk[j], g, 0), 4 * g);
            group(j, weights(blk[j], g, 1), 16 + 4 * g);
          }
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        for (int j = 0; j < NP; ++j) group(j, I32x16::load(blk[j] + 64 * g), 4 * g);
        if (L.halves && g == 3) half_under_its_scale(0);
      }
    }
    if (L.halves) {
      half_under_its_scale(1);
      continue;
    }
    for (int j = 0; j < NP; ++j) {
      F32x16 d, m;
      block_scales(L, blk[j], b, d, m);
      for (int r = 0; r < MR; ++r) {
        acc[r][j] = F32x16::fmadd(part[r][j], d, acc[r][j]);
        if (L.has_min) acc[r][j] = F32x16::fmadd(m, F32x16::set1(x.fsum[(r0 + r) * t.blocks + b]), acc[r][j]);
      }
    }
  }
  store_tile<MR, NP>(t, r0, p0, acc);
}

// BF16 tile: no scales, so one accumulator per (row, panel) runs over the whole row.
template <int MR, int NP, typename X>
void bf16_tile(const Tiles& t, int64_t r0, int64_t p0) {
  F32x16 acc[MR][NP];
  zero_all(acc);
  const X* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = static_cast<const X*>(t.x_rows) + (r0 + r) * t.x_stride;
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks(t, p0, b, blk);
    for (int g = 0; g < kQuantBlock / 2; ++g)
      for (int j = 0; j < NP; ++j) {
        const I32x16 w = I32x16::load(blk[j] + 64 * g);
        for (int r = 0; r < MR; ++r) acc[r][j] = pair_dot(acc[r][j], w, xr[r] + b * kQuantBlock + 2 * g);
      }
  }
  store_tile<MR, NP>(t, r0, p0, acc);
}

// The integer tile with the next panels' prefetch (pre >= 0) or without: two instantiations, so that the
// tiles that do not ask (all of a prefill's) carry none of it; a test in their block loop cost a 128-token
// prefill ~2%.
template <int MR, int NP, int BITS, int PLANES, int SCALES, bool kMin, bool kLut = false>
void int_tile_pre(const Tiles& t, int64_t r0, int64_t p0, int64_t pre) {
  if constexpr (NP == 2) {  // (row_tiles' width: the only tiles given a `pre`)
    if (pre >= 0) return int_tile<MR, NP, BITS, PLANES, SCALES, kMin, true, kLut>(t, r0, p0, pre);
  }
  int_tile<MR, NP, BITS, PLANES, SCALES, kMin, false, kLut>(t, r0, p0, pre);
}

template <int MR, int NP, int BITS, int PLANES>
void tile(const Tiles& t, int64_t r0, int64_t p0, int64_t pre = -1, bool expanded = false) {
  if constexpr (BITS == 16) {
    if (t.x_dtype == DType::f32) bf16_tile<MR, NP, float>(t, r0, p0);
    else bf16_tile<MR, NP, bf16>(t, r0, p0);
  } else if constexpr (PLANES == 0) {
    float_tile<MR, NP, BITS>(t, r0, p0);
  } else if constexpr (BITS == 2) {  // crumbs, a scale per 16
    if (t.layout.has_min) halves_tile<MR, NP, 2, PLANES, kHalfCodesMin, true>(t, r0, p0);  // Q2_K
    else halves_tile<MR, NP, 3, PLANES, kHalfCodes, false>(t, r0, p0);  // Q3_K: a plane of third bits
  } else if (BITS == 4 && t.layout.lut) {  // the IQ4 types: a zero point (128), no min
    if constexpr (BITS == 4) {
      if (t.layout.scale_bytes == 1) int_tile_pre<MR, NP, BITS, PLANES, kSignedCodes, false, true>(t, r0, p0, pre);  // IQ4_XS
      else if (t.layout.scale_bytes == 4) int_tile_pre<MR, NP, BITS, PLANES, kF32, false, true>(t, r0, p0, pre);  // IQ4_F32
      else int_tile_pre<MR, NP, BITS, PLANES, kFp16, false, true>(t, r0, p0, pre);  // IQ4_NL
    }
  } else if (BITS == 4 && t.layout.high_bits) {  // 4-bit quants with a plane or two of high bits
    if constexpr (BITS == 4) {
      if (t.layout.high_bits == 2) halves_tile<MR, NP, 6, PLANES, kHalfCodes, false>(t, r0, p0);  // Q6_K
      else if (t.layout.scale_bytes == 2 && t.layout.has_min) int_tile_pre<MR, NP, 5, PLANES, kFp16, true>(t, r0, p0, pre);  // Q5_1
      else if (t.layout.scale_bytes == 2) int_tile_pre<MR, NP, 5, PLANES, kFp16, false>(t, r0, p0, pre);  // Q5_0
      else if (expanded) int_tile_pre<MR, NP, 5, PLANES, kExpanded, true>(t, r0, p0, pre);  // Q5_K
      else int_tile_pre<MR, NP, 5, PLANES, kCodes, true>(t, r0, p0, pre);
    }
  } else if (t.layout.halves) {
    if (t.layout.scale_bytes == 1) halves_tile<MR, NP, BITS, PLANES, kHalfCodes, false>(t, r0, p0);  // Q3_K, Q6_K as bytes
    else if (t.layout.has_min) halves_tile<MR, NP, BITS, PLANES, kF32, true>(t, r0, p0);  // Q4_HM32
    else halves_tile<MR, NP, BITS, PLANES, kF32, false>(t, r0, p0);  // Q8_H32
  } else if (t.layout.scale_bytes == 4) {  // Q4_M32, Q8_M32: each has a min
    int_tile_pre<MR, NP, BITS, PLANES, kF32, true>(t, r0, p0, pre);
  } else if (t.layout.scale_bytes == 1) {  // Q4_K: a min too
    if (expanded) int_tile_pre<MR, NP, BITS, PLANES, kExpanded, true>(t, r0, p0, pre);
    else int_tile_pre<MR, NP, BITS, PLANES, kCodes, true>(t, r0, p0, pre);
  } else if (t.layout.has_min) {  // Q4_1
    int_tile_pre<MR, NP, BITS, PLANES, kFp16, true>(t, r0, p0, pre);
  } else {  // Q4_0, Q8_0
    int_tile_pre<MR, NP, BITS, PLANES, kFp16, false>(t, r0, p0, pre);
  }
}

// int16 keeps two int32 accumulators per (row, panel) besides the float one: at 4 rows x 2 panels that
// is 24 of the 32 vector registers before weights and broadcasts, and the compiler spilled them to the
// stack every block; 3 rows fit (256-token prefill of the default model about 10% faster, A/B on Zen 4).
//
// The first row tile of a panel pair reads its weights from DRAM; the later ones find them in L1. The
// second row tile therefore asks for the panels the thread will take up next (`pre`: the next pair of
// its work item, or the first pair of its next item, RangeQueue::next), so that the next first row
// tile finds them in L2 instead of waiting on memory while the memory bus idles through the reworking.
// Decode step of the default spec (Q4_1, int16), context 300, three alternated rounds in separate
// processes on Zen 5: batch 8 7.6-8.3 -> 6.2-6.4 ms, batch 32 23.1-23.5 -> 21.7-22.6; batch 1 (its own
// path above) and prefills (several row chunks: no `pre`) unchanged. With 2-3 rows the one row tile asks
// itself: batch 2 3.8-4.0 -> 3.3-3.4 ms, batch 3 4.3-4.5 -> 3.5-3.8 (three rounds; batch 4 and 8 as they
// were). Integer tiles only: the BF16 tile (a panel block is 1 KiB there) was 2-6% slower with it.
// Q4_K's and Q5_K's scales for panels [p0, p0 + NP), every block, into expanded_scales (see kExpanded).
template <int NP>
void expand_scales(const Tiles& t, int64_t p0) {
  expanded_scales.resize(static_cast<size_t>(t.blocks * NP * 2 * kPanelRows));
  for (int64_t b = 0; b < t.blocks; ++b)
    for (int j = 0; j < NP; ++j) {
      F32x16 d, m;
      block_scales<kCodes>(t.layout, panel_block(t, p0 + j, b), b, d, m);
      float* dm = expanded_scales.data() + (b * NP + j) * 2 * kPanelRows;
      d.store(dm), m.store(dm + kPanelRows);
    }
}

// A thread's copy of panels [p0, p0 + NP) in layout L (see expand_quants, expand_words) in `storage`, on cache lines
// as the packed weights (a vector split across two lines loads at half speed); its panel 0 is t's p0, so its output
// starts at p0's columns. expand(b, from, to) writes block b of a panel from the packed block `from`, the blocks
// visited in order with a first row tile's prefetches.
template <int NP, typename Expand>
Tiles expanded(const Tiles& t, const PackedLayout& L, std::vector<uint8_t>& storage, int64_t p0, int64_t r0, int64_t pre,
               Expand expand) {
  Tiles e = t;
  e.layout = L, e.panel_bytes = packed_panel_bytes(L, t.blocks);
  storage.resize(static_cast<size_t>(NP * e.panel_bytes + 63));
  uint8_t* buffer = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  e.weight = buffer;
  e.out = static_cast<char*>(t.out) + p0 * kPanelRows * (t.out_dtype == DType::f32 ? 4 : 2);
  e.out_features = t.out_features - p0 * kPanelRows;
  const int64_t ahead = blocks_ahead(t, r0);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* from[NP];
    panel_blocks(t, p0, b, from);
    prefetch_blocks(t, from, b, ahead);
    if (pre >= 0) prefetch_next<NP>(t, pre, b);
    for (int j = 0; j < NP; ++j) expand(b, from[j], buffer + (panel_block(e, j, b) - e.weight));
  }
  return e;
}

// Q5_0, Q5_1, Q5_K (and, with int8 activations, Q3_K and Q6_K) under more than four row tiles: panels [p0, p0 + NP) with their high bits added
// once, into the byte layout (8 vectors a block, as Q8_0's; scales and superblock heads as they are), which the
// row tiles then run as bytes. Adding them in every row tile made a 2,048 x 8,192 linear 25% (Q5_K) and 27%
// (Q6_K) slower at 128 rows than the bytes these types were stored as before, 20-30% at 32; expanded, 3-4%
// and 8%. At 8 rows expanding cost more than it saved (Q5_K 1.13 ms against 0.97-1.0, medians of 30; Xeon).
thread_local std::vector<uint8_t> expanded_quants;
template <int NP, int BITS>
Tiles expand_quants(const Tiles& t, int64_t p0, int64_t r0, int64_t pre) {
  PackedLayout L = t.layout;
  const int64_t scale_bytes = L.block_bytes - L.quant_bytes;
  // (Q5_0's and Q5_1's 32 and 64 bytes of scales padded to a cache line, so that every block's vectors sit on lines)
  L.bits = 8, L.high_bits = 0, L.quant_bytes = 8 * 64, L.block_bytes = L.quant_bytes + (scale_bytes + 63) / 64 * 64;
  return expanded<NP>(t, L, expanded_quants, p0, r0, pre, [&](int64_t b, const uint8_t* from, uint8_t* to) {
    if (L.super_head && b % kSuperBlocks == 0) std::memcpy(to - L.super_head, from - L.super_head, L.super_head);
    for (int h = 0; h < 2; ++h)  // weights 16h+4g..16h+4g+3 of each row into vector 4h + g
      for (int g = 0; g < 4; ++g) block_weights<BITS>(from, g, h).store(to + 64 * (4 * h + g));
    std::memcpy(to + L.quant_bytes, from + t.layout.quant_bytes, scale_bytes);
  });
}

// Q2_K, Q3_K and Q6_K under more than four row tiles of int16 activations: panels [p0, p0 + NP) as signed words
// w = (u - zero) sc_h, each half's scale code taken into its weights (exact: |w| <= 4,096), and per block the
// superblock's d (and Q2_K's mins, -dmin m_h) in float32, 16 each: 16 vectors of words a block, word pair v of a
// row its weights 2v and 2v + 1 (byte_words). Beside its 16 vpdpbusd a block, row
// and panel, the halves tile spends ~14 operations on the two halves' planes, zero points and codes; the word
// tile's vpdpwssd (as many: two words a lane against a pair of x's) leave 5. A 2,048 x 8,192 linear at 128 rows
// (Xeon): Q6_K 15.8-16.1 -> 12.1-13.1 ms, Q3_K 14.9-15.5 -> 11.7-12.8, Q2_K 18.1 -> 14.8-15.9; at 8 rows the
// words cost more to make than they save (Q6_K 1.6 against 1.35 ms).
thread_local std::vector<uint8_t> expanded_words;
template <int NP, int BITS>
Tiles expand_words(const Tiles& t, int64_t p0, int64_t r0, int64_t pre) {
  const PackedLayout& from_layout = t.layout;
  const bool q2_k = from_layout.has_min;
  const PackedLayout L{8, 0, q2_k, false, 4, 16 * 64, 16 * 64 + (q2_k ? 3 : 1) * 4 * kPanelRows};
  return expanded<NP>(t, L, expanded_words, p0, r0, pre, [&](int64_t b, const uint8_t* from, uint8_t* to) {
    const uint8_t* head = super_head(from_layout, from, b);
    const uint8_t* codes = block_codes(from_layout, head, b);
    alignas(64) int16_t factor[2][2 * kPanelRows];  // each half's scale code, twice a row (both words of its lane)
    float* scalars = reinterpret_cast<float*>(to + L.quant_bytes);  // d, then Q2_K's m0, m1
    for (int row = 0; row < kPanelRows; ++row) {
      for (int h = 0; h < 2; ++h)
        factor[h][2 * row] = factor[h][2 * row + 1] =
            q2_k ? codes[kPanelRows * h + row] : static_cast<int8_t>(codes[kPanelRows * h + row]);
      if (q2_k) {  // fp16 d and -dmin
        const uint16_t* halfs = reinterpret_cast<const uint16_t*>(head);
        scalars[row] = fp16_to_float(halfs[row]);
        for (int h = 0; h < 2; ++h)
          scalars[kPanelRows * (1 + h) + row] = fp16_to_float(halfs[kPanelRows + row]) * static_cast<float>(codes[kPanelRows * (2 + h) + row]);
      } else {  // f32 d
        std::memcpy(&scalars[row], head + 4 * row, 4);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const I32x16 f = I32x16::load(reinterpret_cast<const uint8_t*>(factor[h]));
      for (int g = 0; g < 4; ++g) {  // weights 16h+4g.. : group 4h + g, word vectors 2(4h + g) and the next
        const I32x16 u = block_weights<BITS>(from, g, h);
        u.byte_words(0).words_times(from_layout.zero, f).store(to + 128 * (4 * h + g));
        u.byte_words(1).words_times(from_layout.zero, f).store(to + 128 * (4 * h + g) + 64);
      }
    }
  });
}

// Word tile (expand_words' panels): per block and half, int32 sums of the words against x's combined integers
// (Activations::xw), then acc += (float(sum0) + float(sum1)) d scale (kMin: then
// m0 and m1 times each half's x), as halves_tile sums the same rows. A half's sum fits int32 (Q6_K's |w| <= 4,096
// against |x| <= 32,639, 16 of them: < 2^31), a block's may not.
template <int MR, int NP, bool kMin>
void word_tile(const Tiles& t, int64_t r0, int64_t p0) {
  const Activations& x = *t.x;
  F32x16 acc[MR][NP];
  zero_all(acc);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks<NP, false>(t, p0, b, blk);
    const int8_t* xw[MR];
    for (int r = 0; r < MR; ++r) xw[r] = reinterpret_cast<const int8_t*>(x.xw.data() + ((r0 + r) * t.blocks + b) * kQuantBlock);
    I32x16 sum[2][MR][NP];
    auto half = [&](int h, I32x16 (&s)[MR][NP]) {  // (one array a half: indexed by a loop's half, GCC kept them on the stack)
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NP; ++j) s[r][j] = I32x16::zero();
#pragma GCC unroll 4
      for (int group = 4 * h; group < 4 * h + 4; ++group)
        for (int j = 0; j < NP; ++j) {
          const I32x16 even = I32x16::load(blk[j] + 128 * group), odd = I32x16::load(blk[j] + 128 * group + 64);
          for (int r = 0; r < MR; ++r) {
            s[r][j] = I32x16::dot2(s[r][j], even, load4(xw[r] + 8 * group));
            s[r][j] = I32x16::dot2(s[r][j], odd, load4(xw[r] + 8 * group + 4));
          }
        }
    };
    half(0, sum[0]);
    half(1, sum[1]);
    for (int r = 0; r < MR; ++r) {
      const int64_t cell = (r0 + r) * t.blocks + b;
      const F32x16 scale = F32x16::set1(x.scale[cell]);
      const int32_t first = x.isum_first[cell];
      const F32x16 x0 = F32x16::set1(x.scale[cell] * static_cast<float>(first));
      const F32x16 x1 = F32x16::set1(x.scale[cell] * static_cast<float>(x.isum[cell] - first));
      for (int j = 0; j < NP; ++j) {
        const float* scalars = reinterpret_cast<const float*>(blk[j] + t.layout.quant_bytes);
        const F32x16 total = sum[0][r][j].to_float() + sum[1][r][j].to_float();
        acc[r][j] = F32x16::fmadd(total, F32x16::load(scalars) * scale, acc[r][j]);
        if constexpr (kMin) {
          acc[r][j] = F32x16::fmadd(F32x16::load(scalars + kPanelRows), x0, acc[r][j]);
          acc[r][j] = F32x16::fmadd(F32x16::load(scalars + 2 * kPanelRows), x1, acc[r][j]);
        }
      }
    }
  }
  store_tile<MR, NP>(t, r0, p0, acc);
}

template <int MR, int NP>
void word_tile(const Tiles& t, int64_t r0, int64_t p0) {
  if (t.layout.has_min) word_tile<MR, NP, true>(t, r0, p0);  // Q2_K
  else word_tile<MR, NP, false>(t, r0, p0);  // Q3_K, Q6_K
}

template <int NP, int PLANES>
void word_rows(const Tiles& t, int64_t r_begin, int64_t r_end) {
  constexpr int kMR = tile_rows(PLANES);
  int64_t r = r_begin;
  for (; r + kMR <= r_end; r += kMR) word_tile<kMR, NP>(t, r, 0);
  switch (r_end - r) {
    case 3: word_tile<3, NP>(t, r, 0); break;
    case 2: word_tile<2, NP>(t, r, 0); break;
    case 1: word_tile<1, NP>(t, r, 0); break;
    default: break;
  }
}

template <int NP, int BITS, int PLANES>
void row_tiles(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0, int64_t pre) {
  int64_t r = r_begin;
  constexpr int kMR = tile_rows(PLANES);
  if constexpr ((BITS == 2 || BITS == 4) && PLANES != 0) {
    if (t.x->words && r_end - r_begin > word_rows_above(t.layout)) {  // Q2_K, Q3_K, Q6_K
      const Tiles words = BITS == 2 ? (t.layout.has_min ? expand_words<NP, 2>(t, p0, r_begin, pre) : expand_words<NP, 3>(t, p0, r_begin, pre))
                                    : expand_words<NP, 6>(t, p0, r_begin, pre);
      return word_rows<NP, PLANES>(words, r_begin, r_end);
    }
    if (t.layout.high_bits && r_end - r_begin > 4 * kMR) {
      const Tiles bytes = BITS == 2 ? expand_quants<NP, 3>(t, p0, r_begin, pre)
                          : t.layout.high_bits == 2 ? expand_quants<NP, 6>(t, p0, r_begin, pre)
                                                    : expand_quants<NP, 5>(t, p0, r_begin, pre);
      return row_tiles<NP, 8, PLANES>(bytes, r_begin, r_end, 0, -1);
    }
  }
  auto pre_for = [&](int64_t row) {  // the second row tile, or the first where it is the only one (batch 2-3)
    return row == r_begin + kMR || (row == r_begin && r_end - r_begin <= kMR) ? pre : -1;
  };
  // Q4_K, Q5_K under more than two row tiles: their scales formed once, not once a row tile
  const bool expand = PLANES != 0 && BITS != 16 && t.layout.scale_bytes == 1 && t.layout.has_min && !t.layout.halves &&
                      r_end - r_begin > 2 * kMR;
  if (expand) expand_scales<NP>(t, p0);
  for (; r + kMR <= r_end; r += kMR) tile<kMR, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand);
  switch (r_end - r) {
    case 3: tile<3, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand); break;
    case 2: tile<2, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand); break;
    case 1: tile<1, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand); break;
    default: break;
  }
}

// x is quantized into `prepared` first (unless it is null: BF16 weights read x as it is), in the same
// parallel region as the tiles when there are several rows: each thread quantizes a share of them, and
// no thread waits through a serial quantization (it was one below 16 rows) or a region of its own.
template <int BITS, int PLANES>
void run(const Tiles& t, const PackedLinearArgs& a, Activations* prepared) {
  const int64_t panels = packed_panels(t.out_features), rows = a.rows;
  // Decode of one sequence: four panels a tile keep eight independent chains in flight. Static: handed
  // out dynamically, single-stream TPOT under the server went from 6.5 to 10.5 ms (A/B, Zen 4). Each
  // thread takes an even share of the panels, whole tiles and a tile of two at its end: whole tiles
  // alone left one of two threads 5 of the 9 tiles of a 576-row matrix (o and down in the default model).
  if (rows == 1) {
    if (prepared) prepare(a, *prepared, 0);
#pragma omp parallel
    {
      const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num(), pairs = panels / 2;
      const int64_t end = pairs * (id + 1) / threads * 2;
      int64_t p = pairs * id / threads * 2;
      for (; p + 4 <= end; p += 4) tile<1, 4, BITS, PLANES>(t, 0, p);
      if (p < end) tile<1, 2, BITS, PLANES>(t, 0, p);
    }
    return;
  }
  // Work items: a chunk of rows x a run of panels, handed out dynamically, at least 16 a thread: on a
  // small machine the HTTP frontend shares the engine's cores, and a thread it preempts must not leave
  // the others waiting at the region's end (c32 under the server +5-9%, A/B). Runs of panels are as
  // short as two (one row tile's width) where that is what it takes: runs of four left one of two
  // threads 5 of the 9 runs of a 576-row matrix (7 alternated rounds on Zen 5: batch 8 8.5 -> 8.4 ms,
  // batch 32 24.8 -> 24.5, 256-token prefill 2777 -> 2849 tokens/s).
  const int64_t row_chunks = (rows + kRowChunk - 1) / kRowChunk;
  const int64_t wanted = std::max<int64_t>(1, 16 * omp_get_max_threads() / row_chunks);
  const int64_t per = std::max<int64_t>(2, (panels / std::min(wanted, panels / 2)) / 2 * 2);
  const int64_t panel_runs = (panels + per - 1) / per;
  const int64_t items = row_chunks * panel_runs;
  RangeQueue queue(items, omp_get_max_threads());
#pragma omp parallel
  {
    if (prepared) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) prepare(a, *prepared, r);
    }  // (the loop's barrier: every row is ready before any tile reads it)
    const int id = omp_get_thread_num();
    for (int64_t item = queue.take(id); item >= 0; item = queue.take(id)) {
      const int64_t rc = item / panel_runs, pr = item % panel_runs;
      const int64_t r_begin = rc * kRowChunk, r_end = std::min(rows, r_begin + kRowChunk);
      const int64_t p_end = std::min(panels, (pr + 1) * per);
      // Decode-sized steps (one row chunk) only: there the first row tile of each panel pair waits on
      // memory. The item this thread takes next is the next of its range, while it has one.
      const int64_t guess = queue.next(id);
      const int64_t after = guess >= 0 ? guess * per : -1;
      for (int64_t p = pr * per; p < p_end; p += 2)
        row_tiles<2, BITS, PLANES>(t, r_begin, r_end, p, row_chunks > 1 ? -1 : p + 2 < p_end ? p + 2 : after);
    }
  }
}

template <typename T>
void dequant_packed_row(const uint8_t* w, const PackedLayout& L, int64_t panel_bytes, int64_t blocks, int64_t id, T* out) {
  const int64_t j = id % kPanelRows;
  for (int64_t b = 0; b < blocks; ++b, out += kQuantBlock) {
    const uint8_t* blk = w + id / kPanelRows * panel_bytes + (b / kSuperBlocks + 1) * L.super_head + b * L.block_bytes;
    float d[2] = {0.f, 0.f}, m[2] = {0.f, 0.f};  // each half's scale and min (the same without halves)
    if (L.scale_bytes == 1) {  // codes times the superblock's scalars (as block_scales)
      const uint8_t* head = super_head(L, blk, b);
      const uint8_t* codes = block_codes(L, head, b);
      const uint16_t* halfs = reinterpret_cast<const uint16_t*>(head);
      if (L.halves && L.has_min) {  // Q2_K: fp16 d and -dmin, unsigned codes: sc0, sc1, m0, m1
        for (int h = 0; h < 2; ++h) {
          d[h] = fp16_to_float(halfs[j]) * static_cast<float>(codes[kPanelRows * h + j]);
          m[h] = fp16_to_float(halfs[kPanelRows + j]) * static_cast<float>(codes[kPanelRows * (2 + h) + j]);
        }
      } else if (!L.has_min) {  // Q3_K, Q6_K: f32 d, signed codes per half; IQ4_XS: one code
        float scale;
        std::memcpy(&scale, head + 4 * j, 4);
        d[0] = d[1] = scale * static_cast<float>(static_cast<int8_t>(codes[j]));
        if (L.halves) d[1] = scale * static_cast<float>(static_cast<int8_t>(codes[kPanelRows + j]));
      } else {  // Q4_K, Q5_K: fp16 d and -dmin, unsigned codes
        d[0] = d[1] = fp16_to_float(halfs[j]) * static_cast<float>(codes[j]);
        m[0] = m[1] = fp16_to_float(halfs[kPanelRows + j]) * static_cast<float>(codes[kPanelRows + j]);
      }
    } else if (L.scale_bytes == 4) {  // d (d0, d1 with halves), then m (m0, m1)
      float f[4] = {0.f, 0.f, 0.f, 0.f};
      for (int c = 0; c < scalar_count(L); ++c) std::memcpy(&f[c], blk + L.quant_bytes + 4 * (c * kPanelRows + j), 4);
      if (L.halves) d[0] = f[0], d[1] = f[1], m[0] = f[2], m[1] = f[3];
      else d[0] = d[1] = f[0], m[0] = m[1] = f[1];
    } else if (L.scale_bytes == 2) {
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + L.quant_bytes);
      d[0] = d[1] = fp16_to_float(scales[j]), m[0] = m[1] = L.has_min ? fp16_to_float(scales[kPanelRows + j]) : 0.f;
    }
    if (L.bits == 16) {  // weight i of row j: vector i / 2, lane j, half i % 2
      const bf16* v = reinterpret_cast<const bf16*>(blk);
      for (int i = 0; i < kQuantBlock; ++i) out[i] = from_float<T>(bf16_to_float(v[32 * (i / 2) + 2 * j + i % 2]));
      continue;
    }
    for (int i = 0; i < kQuantBlock; ++i) {
      int u;
      if (L.bits <= 4) {
        const int64_t n = 4 * j + i % 4;  // weight i's byte in vector g of half h
        const int g = i % 16 / 4, h = i / 16;
        u = L.bits == 4 ? (blk[64 * g + n] >> (4 * h)) & 15 : (blk[64 * h + n] >> (2 * g)) & 3;
        for (int p = 0; p < L.high_bits; ++p) u |= (blk[high_bits_offset(p, g, h, L.bits) + n / 8] >> (n % 8) & 1) << (L.bits + p);
      } else {
        u = blk[64 * (i / 4) + 4 * j + i % 4];
      }
      if (L.lut) u = kIq4Unsigned[u];
      out[i] = from_float<T>(d[i >= 16] * static_cast<float>(u - L.zero) + m[i >= 16]);
    }
  }
}

}  // namespace

void packed_linear(const PackedLinearArgs& a) {
  thread_local Activations x;  // kept between calls: no allocation per call
  const PackedLayout L = packed_layout(a.qtype);
  const int64_t blocks = a.in_features / kQuantBlock;
  const Tiles t{a.weight, L, blocks, packed_panel_bytes(L, blocks), a.out_features, &x, a.out, a.out_dtype, a.out_stride,
                a.x, a.x_dtype, a.x_stride};
  const int bits = L.bits;
  if (bits == 16) {  // BF16 weights take x as it is (act does not apply)
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
    // float32 FMAs where vdpbf16ps is slow (kernels.h, bf16_dot): x widened once. For every row count, so
    // that a row's result does not depend on its batch (a seeded request's tokens must not). On the Xeon of
    // kernels.h, a BF16 SmolLM2's decode step: batch 8 21.7-23.2 ms against 24.7-26.0, a 256-token prefill
    // 1.4x faster, but batch 1 12.2 against 11.7 ms (medians of eight): one row streams the weights from
    // memory, where vdpbf16ps' fewer instructions help; keeping it there made rows batch-dependent.
    if (a.x_dtype == DType::bf16 && !bf16_dot()) {
      x.fx.resize(static_cast<size_t>(a.rows * a.in_features));
      float* wide_rows = x.fx.data();  // this thread's: x is thread_local, the team's threads have their own
      const bf16* rows = static_cast<const bf16*>(a.x);
#pragma omp parallel for schedule(static) if (a.rows * a.in_features >= kParallelElements)
      for (int64_t r = 0; r < a.rows; ++r)
        for (int64_t c = 0; c < a.in_features; ++c) wide_rows[r * a.in_features + c] = bf16_to_float(rows[r * a.x_stride + c]);
      Tiles wide = t;
      wide.x_rows = wide_rows, wide.x_dtype = DType::f32, wide.x_stride = a.in_features;
      return run<16, 0>(wide, a, nullptr);
    }
#endif
    return run<16, 0>(t, a, nullptr);
  }
  size_for(a, x);
  if (a.act == ActQuant::int16) bits == 4 ? run<4, 2>(t, a, &x) : bits == 2 ? run<2, 2>(t, a, &x) : run<8, 2>(t, a, &x);
  else if (a.act == ActQuant::int8) bits == 4 ? run<4, 1>(t, a, &x) : bits == 2 ? run<2, 1>(t, a, &x) : run<8, 1>(t, a, &x);
  else bits == 4 ? run<4, 0>(t, a, &x) : bits == 2 ? run<2, 0>(t, a, &x) : run<8, 0>(t, a, &x);
}

void packed_rows(const PackedRowsArgs& a) {
  const PackedLayout L = packed_layout(a.qtype);
  const int64_t blocks = a.in_features / kQuantBlock, panel_bytes = packed_panel_bytes(L, blocks);
#pragma omp parallel for schedule(static) if (a.count >= 64)
  for (int64_t i = 0; i < a.count; ++i) {
    if (a.out_dtype == DType::f32)
      dequant_packed_row(a.weight, L, panel_bytes, blocks, a.ids[i], static_cast<float*>(a.out) + i * a.out_stride);
    else
      dequant_packed_row(a.weight, L, panel_bytes, blocks, a.ids[i], static_cast<bf16*>(a.out) + i * a.out_stride);
  }
}

void dequantize(const DequantArgs& a) {
  const int64_t k = a.in_features, row_bytes = k / kQuantBlock * quant_block_bytes(a.qtype);
#pragma omp parallel
  {
    std::vector<float> row(a.out_dtype == DType::f32 ? 0 : k);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      if (a.out_dtype == DType::f32) {
        dequant_rows(a.qtype, a.weight + r * row_bytes, 1, k, static_cast<float*>(a.out) + r * a.out_stride);
      } else {
        dequant_rows(a.qtype, a.weight + r * row_bytes, 1, k, row.data());
        bf16* out = static_cast<bf16*>(a.out) + r * a.out_stride;
        for (int64_t c = 0; c < k; ++c) out[c] = float_to_bf16(row[c]);
      }
    }
  }
}

}  // namespace appliance::APPLIANCE_ISA
