// Linear layers on GGUF-quantized weights that stay quantized in memory (Q4_0, Q4_1, Q8_0).
//
// A decode step reads every weight once: a Q4_1 weight is 5 bits, a float32 one 32. Two paths, both
// float32 FMAs on exactly dequantized weights, so the result equals dequantize-then-matmul in float32
// up to the order of the sums:
//   - up to 4 activation rows (AVX-512): each block is widened into two registers and used at once;
//   - otherwise each thread dequantizes a group of output rows into a float32 scratch it keeps in
//     L2, then runs every activation row against them in 4 x 4 register tiles of (activation row,
//     weight row) dot products: the blocks are read from memory once per call, whatever the batch.
// Prompts (many rows) do not come here: app/model/quant.py expands the weight for torch's GEMM.
#include <algorithm>
#include <vector>

#include <omp.h>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
namespace {

constexpr int NB = 4;      // weight rows in a register tile
constexpr int MB = 4;      // activation rows in a register tile
constexpr int64_t GN = 64;  // most weight rows a thread dequantizes at a time (64 x K floats: in L2)

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

void dequant_rows(QType q, const uint8_t* w, int64_t rows, int64_t k, float* out) {
  const int64_t blocks = k / kQuantBlock, bytes = blocks * quant_block_bytes(q);
  for (int64_t r = 0; r < rows; ++r) {
    if (q == QType::q8_0) dequant_row<QType::q8_0>(w + r * bytes, blocks, out + r * k);
    else if (q == QType::q4_0) dequant_row<QType::q4_0>(w + r * bytes, blocks, out + r * k);
    else dequant_row<QType::q4_1>(w + r * bytes, blocks, out + r * k);
  }
}

// r[i][j] = dot(x row i, w row j) for M activation rows (at x_stride) and NB weight rows (at k)
template <int M>
inline void tile(const float* x, int64_t x_stride, const float* w, int64_t k, float r[MB][NB]) {
  VecF acc[M][NB];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = VecF::zero();
  for (int64_t c = 0; c < k; c += VecF::N) {  // k is a multiple of 32, so of every VecF::N
    VecF wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = VecF::load(w + j * k + c);
    for (int i = 0; i < M; ++i) {
      const VecF xv = VecF::load(x + i * x_stride + c);
      for (int j = 0; j < NB; ++j) acc[i][j] = VecF::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NB; ++j) r[i][j] = acc[i][j].reduce_add();
}

template <typename T>
void store_tile(const QuantLinearArgs& a, int64_t m0, int mv, int64_t n0, int nv, const float r[MB][NB]) {
  T* out = static_cast<T*>(a.out);
  for (int i = 0; i < mv; ++i)
    for (int j = 0; j < nv; ++j) out[(m0 + i) * a.out_stride + n0 + j] = from_float<T>(r[i][j]);
}

// x as float32 rows: the caller's own memory when it already is, else a converted copy in `buffer`
const float* float_rows(const QuantLinearArgs& a, std::vector<float>& buffer, int64_t& stride) {
  if (a.x_dtype == DType::f32) {
    stride = a.x_stride;
    return static_cast<const float*>(a.x);
  }
  const bf16* x = static_cast<const bf16*>(a.x);
  buffer.resize(a.rows * a.in_features);
  for (int64_t s = 0; s < a.rows; ++s)
    for (int64_t c = 0; c < a.in_features; ++c) buffer[s * a.in_features + c] = bf16_to_float(x[s * a.x_stride + c]);
  stride = a.in_features;
  return buffer.data();
}

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512
// Few activation rows (decode): each block is dequantized into two registers and used at once, with
// no trip through memory; two weight rows at a time keep independent FMA chains in flight.
constexpr int64_t kRegisterPathRows = 4;
constexpr int64_t kPrefetchRows = 16;

template <QType Q, int M>
void gemv_rows(const QuantLinearArgs& a, const float* x, int64_t x_stride, int64_t row_bytes) {
  constexpr int64_t bytes = Q == QType::q8_0 ? 34 : Q == QType::q4_1 ? 20 : 18;
  const int64_t blocks = a.in_features / kQuantBlock, pairs = (a.out_features + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t v0 = 2 * p, v1 = std::min(v0 + 1, a.out_features - 1);  // an odd last row is done twice
    const uint8_t* r0 = a.weight + v0 * row_bytes;
    const uint8_t* r1 = a.weight + v1 * row_bytes;
    if (v0 + kPrefetchRows + 2 <= a.out_features) {  // a few rows ahead: more bytes in flight than the prefetcher keeps
      const char* ahead = reinterpret_cast<const char*>(a.weight + (v0 + kPrefetchRows) * row_bytes);
      for (int64_t off = 0; off < 2 * row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    __m512 acc0[M], acc1[M];
    for (int i = 0; i < M; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 lo0, hi0, lo1, hi1;
      block_registers<Q>(r0 + b * bytes, lo0, hi0);
      block_registers<Q>(r1 + b * bytes, lo1, hi1);
      for (int i = 0; i < M; ++i) {
        const __m512 xlo = _mm512_loadu_ps(x + i * x_stride + b * kQuantBlock);
        const __m512 xhi = _mm512_loadu_ps(x + i * x_stride + b * kQuantBlock + 16);
        acc0[i] = _mm512_fmadd_ps(xhi, hi0, _mm512_fmadd_ps(xlo, lo0, acc0[i]));
        acc1[i] = _mm512_fmadd_ps(xhi, hi1, _mm512_fmadd_ps(xlo, lo1, acc1[i]));
      }
    }
    for (int i = 0; i < M; ++i) {
      const float s0 = _mm512_reduce_add_ps(acc0[i]), s1 = _mm512_reduce_add_ps(acc1[i]);
      if (a.out_dtype == DType::f32) {
        float* out = static_cast<float*>(a.out) + i * a.out_stride;
        out[v0] = s0, out[v1] = s1;
      } else {
        bf16* out = static_cast<bf16*>(a.out) + i * a.out_stride;
        out[v0] = float_to_bf16(s0), out[v1] = float_to_bf16(s1);
      }
    }
  }
}

template <QType Q>
void gemv(const QuantLinearArgs& a, const float* x, int64_t x_stride, int64_t row_bytes) {
  switch (a.rows) {
    case 1: gemv_rows<Q, 1>(a, x, x_stride, row_bytes); break;
    case 2: gemv_rows<Q, 2>(a, x, x_stride, row_bytes); break;
    case 3: gemv_rows<Q, 3>(a, x, x_stride, row_bytes); break;
    default: gemv_rows<Q, 4>(a, x, x_stride, row_bytes); break;
  }
}
#endif

}  // namespace

void quant_linear(const QuantLinearArgs& a) {
  const int64_t k = a.in_features, n = a.out_features, m = a.rows;
  const int64_t row_bytes = k / kQuantBlock * quant_block_bytes(a.qtype);
  std::vector<float> converted;
  int64_t x_stride = 0;
  const float* x = float_rows(a, converted, x_stride);
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512
  if (m <= kRegisterPathRows) {
    if (a.qtype == QType::q8_0) gemv<QType::q8_0>(a, x, x_stride, row_bytes);
    else if (a.qtype == QType::q4_0) gemv<QType::q4_0>(a, x, x_stride, row_bytes);
    else gemv<QType::q4_1>(a, x, x_stride, row_bytes);
    return;
  }
#endif
  // groups of weight rows: a few per thread at least (balance), at most GN (scratch in L2)
  const int64_t threads = omp_get_max_threads();
  const int64_t per = (n + 4 * threads - 1) / (4 * threads);
  const int64_t group = std::clamp<int64_t>((per + NB - 1) / NB * NB, NB, GN);
  const int64_t groups = (n + group - 1) / group;
#pragma omp parallel
  {
    thread_local std::vector<float> scratch;  // kept between calls: no allocation or page faults per call
    if (scratch.size() < static_cast<size_t>(group * k)) scratch.resize(group * k);
    float* w = scratch.data();
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n_begin = g * group, rows = std::min(group, n - n_begin);
      dequant_rows(a.qtype, a.weight + n_begin * row_bytes, rows, k, w);
      const int64_t padded = (rows + NB - 1) / NB * NB;
      std::fill(w + rows * k, w + padded * k, 0.f);  // the last tile's missing rows
      for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const int mv = static_cast<int>(std::min<int64_t>(MB, m - m0));
        for (int64_t j0 = 0; j0 < rows; j0 += NB) {
          float r[MB][NB];
          const float* xs = x + m0 * x_stride;
          const float* ws = w + j0 * k;
          switch (mv) {
            case 4: tile<4>(xs, x_stride, ws, k, r); break;
            case 3: tile<3>(xs, x_stride, ws, k, r); break;
            case 2: tile<2>(xs, x_stride, ws, k, r); break;
            default: tile<1>(xs, x_stride, ws, k, r); break;
          }
          const int nv = static_cast<int>(std::min<int64_t>(NB, rows - j0));
          if (a.out_dtype == DType::f32) store_tile<float>(a, m0, mv, n_begin + j0, nv, r);
          else store_tile<bf16>(a, m0, mv, n_begin + j0, nv, r);
        }
      }
    }
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
