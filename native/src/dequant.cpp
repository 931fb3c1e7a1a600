// Quantized rows back to float: dequantize (GGUF rows of the blocks of 32: the weights no kernel takes, expanded
// at load) and packed_rows (rows of packed weights, kernels.h's layout: an embedding lookup, or a whole weight where
// the exact path hands a prompt's many rows to torch's GEMM).
#include "packed.h"

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
