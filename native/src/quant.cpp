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
// Beside this file: act_quant.cpp (x's blocks), words.cpp (int16 rows as words: the K-quants' prompts, and on AVX2
// with cheap multiplies every type with one scale a block), widened.cpp (int16 prompt rows on AVX2: float32 FMAs on
// widened weights), float_tiles.cpp (the exact and BF16 tiles), dequant.cpp (rows back to float); packed.h holds
// what they share.
#include <algorithm>
#include <cstring>
#include <vector>

#include <omp.h>

#include "amx_tile.h"
#include "packed.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

// Q4_K's and Q5_K's scales as kExpanded tiles read them (expand_scales, below)
thread_local std::vector<float> expanded_scales;  // [blocks][NP][d, m][16]

// Byte weights' groups [g0, g1) of a block (4 weights each) against x's bytes: into hi and lo, the two
// planes, or with one plane alternate groups, so that enough independent chains are in flight.
// kCentered: the products of u - 128 (I32x16::centered_dot4).
template <int MR, int NP, int PLANES, bool kSmall, bool kCentered = false>
inline void byte_groups(const uint8_t* const (&blk)[NP], const int8_t* const (&xb)[MR], int g0, int g1,
                        I32x16 (&hi)[MR][NP], I32x16 (&lo)[MR][NP]) {
  const auto dot = [](I32x16 acc, I32x16 w, const int8_t* x) {
    if constexpr (kCentered) return I32x16::centered_dot4(acc, w, load4(x));
    else return I32x16::dot4<kSmall>(acc, w, load4(x));
  };
  for (int g = g0; g < g1; ++g)
    for (int j = 0; j < NP; ++j) {
      const I32x16 w = I32x16::load(blk[j] + 64 * g);
      for (int r = 0; r < MR; ++r) {
        if constexpr (PLANES == 2) {
          hi[r][j] = dot(hi[r][j], w, xb[r] + 4 * g);
          lo[r][j] = dot(lo[r][j], w, xb[r] + 32 + 4 * g);
        } else if (g % 2 == 0) {
          hi[r][j] = dot(hi[r][j], w, xb[r] + 4 * g);
        } else {
          lo[r][j] = dot(lo[r][j], w, xb[r] + 4 * g);
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
// pre >= 0: block b of panels [pre, pre + NP) is asked for too (see row_tiles). A test a block rather than a
// template parameter: instantiated both ways, quant.cpp took 1.4x as long to compile (avx2 tier: 75 s against 52)
// and was no faster (Zen 1, default model, A/B three times: decode steps of 8 and 32 rows, int16 and int8, and an
// int8 256-token prefill, whose tiles run the test and never prefetch; once on Zen 5 the test had cost a prefill ~2%).
// kLut: the nibbles index the IQ4 codebook; one vpshufb a vector maps them to their u (any byte, as Q8_0's).
// kWords: bytes as unsigned words against x's combined integers (packed.h's byte_words; x.xw).
template <int MR, int NP, int BITS, int PLANES, int SCALES, bool kMin, bool kLut, bool kWords = false>
void int_tile(const Tiles& t, int64_t r0, int64_t p0, int64_t pre) {
  // every u < 128 (Q8_M32 holds u < 32, Q5_K's BITS 5; Q8_0's and the codebook's any byte)
  constexpr bool kSmall = !kLut && (BITS <= 6 || SCALES != kFp16);
  // Any byte where dot4 is emulated: the sums are of u - 128, and `zero` below puts back what that took (AMD EPYC
  // Zen 1, AVX2, 3,072 x 768 and 768 x 1,536: Q8_0 and IQ4_NL 1.45-1.6x faster at 8-256 rows, 1.2-1.5x at 1; Q5_0
  // above 12 rows (int16; 16 with int8), where it runs as bytes, 1.5x). As words, u itself.
  constexpr bool kCentered = !kSmall && kCenteredDots && !kWords;
  const PackedLayout& L = t.layout;
  const int32_t zero = (kMin ? 0 : L.zero) - (kCentered ? 128 : 0);  // what each x's sum takes from the block's
  const Activations& x = *t.x;
  const float* expanded = SCALES == kExpanded ? expanded_scales.data() : nullptr;
  F32x16 acc[MR][NP];
  zero_all(acc);
  const int64_t ahead = blocks_ahead(t, r0);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks<NP, SCALES == kCodes || SCALES == kExpanded || SCALES == kSignedCodes>(t, p0, b, blk);
    prefetch_blocks(t, blk, b, ahead);
    if (pre >= 0) prefetch_next<NP>(t, pre, b);
    const int8_t* xb[MR];
    for (int r = 0; r < MR; ++r)
      xb[r] = x_block<kWords, PLANES>(x, r0 + r, t.blocks, b);
    I32x16 hi[MR][NP], lo[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) hi[r][j] = lo[r][j] = I32x16::zero();
    if constexpr (BITS <= 6) {
      // 4-bit u (< 16): an accumulator's 8 pair sums a block fit int16 (8 * 2 * 15 * 127 < 2^15), so they are
      // widened once a block (I32x16::pairs; AMD EPYC Zen 1, AVX2: a 256-token prefill of the default model 157 -> 198
      // tokens/s, a batch-32 decode step 342 -> 306 ms)
      constexpr bool kPairs = BITS == 4 && !kLut;
      const auto dot = [](I32x16 acc, I32x16 w, const int8_t* x) {
        if constexpr (kPairs) return I32x16::pairs(acc, w, load4(x));
        else if constexpr (kCentered) return I32x16::centered_dot4(acc, w, load4(x));
        else return I32x16::dot4<kSmall>(acc, w, load4(x));
      };
      for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NP; ++j) {
          const I32x16 v = I32x16::load(blk[j] + 64 * g);
          I32x16 wl = nibble_weights<BITS>(blk[j], v, g, 0), wh = nibble_weights<BITS>(blk[j], v, g, 1);
          if constexpr (kLut) {  // (the table's load is hoisted out of the loops)
            const I32x16 table = I32x16::table16(kIq4Unsigned);
            wl = wl.lookup(table), wh = wh.lookup(table);
          }
          if constexpr (kWords) {  // (xb: x.xw's block) hi: the words of each lane's bytes 0 and 1, lo: of 2 and 3
            const I32x16 wl0 = wl.byte_words(0), wl1 = wl.byte_words(1), wh0 = wh.byte_words(0), wh1 = wh.byte_words(1);
            for (int r = 0; r < MR; ++r) {
              hi[r][j] = I32x16::dot2(hi[r][j], wl0, load4(xb[r] + 8 * g));
              lo[r][j] = I32x16::dot2(lo[r][j], wl1, load4(xb[r] + 8 * g + 4));
              hi[r][j] = I32x16::dot2(hi[r][j], wh0, load4(xb[r] + 32 + 8 * g));
              lo[r][j] = I32x16::dot2(lo[r][j], wh1, load4(xb[r] + 32 + 8 * g + 4));
            }
            continue;
          }
          for (int r = 0; r < MR; ++r) {
            if constexpr (PLANES == 2) {
              hi[r][j] = dot(hi[r][j], wl, xb[r] + 4 * g);
              hi[r][j] = dot(hi[r][j], wh, xb[r] + 16 + 4 * g);
              lo[r][j] = dot(lo[r][j], wl, xb[r] + 32 + 4 * g);
              lo[r][j] = dot(lo[r][j], wh, xb[r] + 48 + 4 * g);
            } else {
              hi[r][j] = dot(hi[r][j], wl, xb[r] + 4 * g);
              lo[r][j] = dot(lo[r][j], wh, xb[r] + 16 + 4 * g);
            }
          }
        }
      if constexpr (kPairs)
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < NP; ++j) hi[r][j] = hi[r][j].widen_pairs(), lo[r][j] = lo[r][j].widen_pairs();
    } else if constexpr (kWords) {  // (as above)
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < NP; ++j) {
          const I32x16 u = I32x16::load(blk[j] + 64 * g), even = u.byte_words(0), odd = u.byte_words(1);
          for (int r = 0; r < MR; ++r) {
            hi[r][j] = I32x16::dot2(hi[r][j], even, load4(xb[r] + 8 * g));
            lo[r][j] = I32x16::dot2(lo[r][j], odd, load4(xb[r] + 8 * g + 4));
          }
        }
    } else {
      byte_groups<MR, NP, PLANES, kSmall, kCentered>(blk, xb, 0, 8, hi, lo);
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
        I32x16 total = PLANES == 2 && !kWords ? hi[r][j].shl8() + lo[r][j] : hi[r][j] + lo[r][j];
        if constexpr (!kMin || kCentered) total = total - I32x16::set1(zero * x.isum[cell]);
        acc[r][j] = F32x16::fmadd(total.to_float(), d[j] * scale, acc[r][j]);
        if constexpr (kMin) acc[r][j] = F32x16::fmadd(m[j], F32x16::set1(x.fsum[cell]), acc[r][j]);
      }
    }
  }
  store_tile<MR, NP>(t, r0, p0, acc);
}

// 2- to 6-bit weights' half h of a block against x's bytes (h = 0: weights 0..15, the low nibbles; 1: 16..31,
// the high ones; or the crumbs of vector h), into hi and lo as byte_groups does.
// kWords: as unsigned words against x's combined integers (xb: x.xw's block; packed.h's byte_words), into hi (each
// lane's bytes 0 and 1) and lo (2 and 3).
template <int MR, int NP, int BITS, int PLANES, bool kWords = false>
inline void quant_half(const uint8_t* const (&blk)[NP], const int8_t* const (&xb)[MR], int h, I32x16 (&hi)[MR][NP],
                       I32x16 (&lo)[MR][NP]) {
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < NP; ++j) {
      const I32x16 w = block_weights<BITS>(blk[j], g, h);
      if constexpr (kWords) {
        const I32x16 even = w.byte_words(0), odd = w.byte_words(1);
        for (int r = 0; r < MR; ++r) {
          hi[r][j] = I32x16::dot2(hi[r][j], even, load4(xb[r] + 2 * (16 * h + 4 * g)));
          lo[r][j] = I32x16::dot2(lo[r][j], odd, load4(xb[r] + 2 * (16 * h + 4 * g) + 4));
        }
        continue;
      }
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
// kWords: 2- to 6-bit weights as words (Q2_K, Q3_K, Q6_K under int16 x on AVX2, x.words; packed.h's byte_words).
template <int MR, int NP, int BITS, int PLANES, int SCALES, bool kMin, bool kWords = false>
void halves_tile(const Tiles& t, int64_t r0, int64_t p0) {
  if constexpr (kByteWords && !kWords && BITS <= 6 && PLANES == 2) {
    if (t.x->words) return halves_tile<MR, NP, BITS, PLANES, SCALES, kMin, true>(t, r0, p0);
  }
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
    for (int r = 0; r < MR; ++r)
      xb[r] = x_block<kWords, PLANES>(x, r0 + r, t.blocks, b);
    F32x16 d[2][NP], m[2][NP];
    if constexpr (!kCodes)
      for (int j = 0; j < NP; ++j) half_scales<SCALES, kMin>(L, blk[j], b, d[0][j], d[1][j], m[0][j], m[1][j]);
    F32x16 first_half[MR][NP];  // (codes) float(sum0)
    for (int h = 0; h < 2; ++h) {
      I32x16 hi[MR][NP], lo[MR][NP];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NP; ++j) hi[r][j] = lo[r][j] = I32x16::zero();
      if constexpr (BITS <= 6) quant_half<MR, NP, BITS, PLANES, kWords>(blk, xb, h, hi, lo);
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
          I32x16 total = PLANES == 2 && !kWords ? hi[r][j].shl8() + lo[r][j] : hi[r][j] + lo[r][j];
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

// The integer tile with any byte as words or not (t.x->words, known for the call).
template <int MR, int NP, int BITS, int PLANES, int SCALES, bool kMin, bool kLut = false>
void pick_int_tile(const Tiles& t, int64_t r0, int64_t p0, int64_t pre) {
  if constexpr (kByteWords && PLANES == 2 && (BITS == 8 || BITS == 5 || kLut)) {  // (not the pair sums)
    if (t.x->words) return int_tile<MR, NP, BITS, PLANES, SCALES, kMin, kLut, true>(t, r0, p0, pre);
  }
  int_tile<MR, NP, BITS, PLANES, SCALES, kMin, kLut>(t, r0, p0, pre);
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
      if (t.layout.scale_bytes == 1) pick_int_tile<MR, NP, BITS, PLANES, kSignedCodes, false, true>(t, r0, p0, pre);  // IQ4_XS
      else if (t.layout.scale_bytes == 4) pick_int_tile<MR, NP, BITS, PLANES, kF32, false, true>(t, r0, p0, pre);  // IQ4_F32
      else pick_int_tile<MR, NP, BITS, PLANES, kFp16, false, true>(t, r0, p0, pre);  // IQ4_NL
    }
  } else if (BITS == 4 && t.layout.high_bits) {  // 4-bit quants with a plane or two of high bits
    if constexpr (BITS == 4) {
      if (t.layout.high_bits == 2) halves_tile<MR, NP, 6, PLANES, kHalfCodes, false>(t, r0, p0);  // Q6_K
      else if (t.layout.scale_bytes == 2 && t.layout.has_min) pick_int_tile<MR, NP, 5, PLANES, kFp16, true>(t, r0, p0, pre);  // Q5_1
      else if (t.layout.scale_bytes == 2) pick_int_tile<MR, NP, 5, PLANES, kFp16, false>(t, r0, p0, pre);  // Q5_0
      else if (expanded) pick_int_tile<MR, NP, 5, PLANES, kExpanded, true>(t, r0, p0, pre);  // Q5_K
      else pick_int_tile<MR, NP, 5, PLANES, kCodes, true>(t, r0, p0, pre);
    }
  } else if (t.layout.halves) {
    if (t.layout.scale_bytes == 1) halves_tile<MR, NP, BITS, PLANES, kHalfCodes, false>(t, r0, p0);  // Q3_K, Q6_K as bytes
    else if (t.layout.has_min) halves_tile<MR, NP, BITS, PLANES, kF32, true>(t, r0, p0);  // Q4_HM32
    else halves_tile<MR, NP, BITS, PLANES, kF32, false>(t, r0, p0);  // Q8_H32
  } else if (t.layout.scale_bytes == 4) {  // Q4_M32, Q8_M32: each has a min
    pick_int_tile<MR, NP, BITS, PLANES, kF32, true>(t, r0, p0, pre);
  } else if (t.layout.scale_bytes == 1) {  // Q4_K: a min too
    if (expanded) pick_int_tile<MR, NP, BITS, PLANES, kExpanded, true>(t, r0, p0, pre);
    else pick_int_tile<MR, NP, BITS, PLANES, kCodes, true>(t, r0, p0, pre);
  } else if (t.layout.has_min) {  // Q4_1
    pick_int_tile<MR, NP, BITS, PLANES, kFp16, true>(t, r0, p0, pre);
  } else {  // Q4_0, Q8_0
    pick_int_tile<MR, NP, BITS, PLANES, kFp16, false>(t, r0, p0, pre);
  }
}

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
// Rows [r_begin, r_end) of a panel pair in row tiles of kMR rows, then one of the 1-3 rows left.
template <int kMR, int NP, int BITS, int PLANES>
void rows_in_tiles(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0, int64_t pre, bool expand) {
  auto pre_for = [&](int64_t row) {  // the second row tile, or the first where it is the only one (batch 2-3)
    return row == r_begin + kMR || (row == r_begin && r_end - r_begin <= kMR) ? pre : -1;
  };
  int64_t r = r_begin;
  for (; r + kMR <= r_end; r += kMR) tile<kMR, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand);
  switch (r_end - r) {
    case 3: tile<3, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand); break;
    case 2: tile<2, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand); break;
    case 1: tile<1, NP, BITS, PLANES>(t, r, p0, pre_for(r), expand); break;
    default: break;
  }
}

// The x86 SIMD kernels' int16 row chunks of a full AMX tile and more (amx_tile.h, kernels.h amx_in_force): on the
// CPU's tile multiplies (avx512bf16 kernels), or emulated (tests).
constexpr bool kAmxTiers = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512 ||
                           APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2;

template <int NP, int BITS, int PLANES>
void row_tiles(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0, int64_t pre) {
  constexpr int kMR = tile_rows(PLANES);
  if constexpr (kAmxTiers && PLANES == 2 && (BITS == 4 || BITS == 8)) {
    static_assert(NP == 2, "AMX rows run panel pairs");
    if (r_end - r_begin >= kAmxRows && amx_type(t.layout)) {
      const AmxRows amx = amx_in_force();
      if (amx == AmxRows::emulated) return count_amx_row_chunk(), amx_rows<EmulatedTmul, BITS>(t, r_begin, r_end, p0);
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
      if (amx == AmxRows::hardware) return amx_hardware_rows(t, r_begin, r_end, p0);
#endif
    }
  }
  // Q2_K, Q3_K, Q6_K; where expands_words, the types with one scale a block
  if constexpr (PLANES == 2 && BITS != 16) {
    static_assert(NP == 2, "row tiles run panel pairs, as word_rows does");
    if (t.x->words && r_end - r_begin > word_rows_above(t.layout)) return word_rows(t, r_begin, r_end, p0, pre);
  }
  if constexpr ((BITS == 2 || BITS == 4) && PLANES != 0) {
    if (t.layout.high_bits && r_end - r_begin > 4 * kMR) {
      const Tiles bytes = BITS == 2 ? expand_quants<NP, 3>(t, p0, r_begin, pre)
                          : t.layout.high_bits == 2 ? expand_quants<NP, 6>(t, p0, r_begin, pre)
                                                    : expand_quants<NP, 5>(t, p0, r_begin, pre);
      return row_tiles<NP, 8, PLANES>(bytes, r_begin, r_end, 0, -1);
    }
  }
  // Q4_K, Q5_K under more than two row tiles: their scales formed once, not once a row tile
  const bool expand = PLANES != 0 && BITS != 16 && t.layout.scale_bytes == 1 && t.layout.has_min && !t.layout.halves &&
                      r_end - r_begin > 2 * kMR;
  if (expand) expand_scales<NP>(t, p0);
  if constexpr (kByteWords && BITS == 8 && PLANES == 2) {  // bytes as words: narrow too, or 2 rows (packed.h)
    if (t.x->words) {
      if (wide_int_tiles()) return rows_in_tiles<kWideWordRows, NP, BITS, PLANES>(t, r_begin, r_end, p0, pre, expand);
      return rows_in_tiles<narrow_tile_rows(PLANES), NP, BITS, PLANES>(t, r_begin, r_end, p0, pre, expand);
    }
  }
  if constexpr (kNarrowTiles && BITS == 4 && PLANES != 0) {
    const PackedLayout& L = t.layout;  // Q4_0, Q4_1, Q4_K, Q4_M32: int_tile's pair sums (int16: narrow or not, packed.h)
    if (!L.lut && !L.high_bits && !L.halves && (PLANES == 1 || !wide_int_tiles()))
      return rows_in_tiles<narrow_tile_rows(PLANES), NP, BITS, PLANES>(t, r_begin, r_end, p0, pre, expand);
  }
  rows_in_tiles<kMR, NP, BITS, PLANES>(t, r_begin, r_end, p0, pre, expand);
}

// One row's panels [p, end) (a thread's share, even in number): four-panel tiles, each asking for the next (see run)
template <int BITS, int PLANES>
void one_row_panels(const Tiles& t, int64_t p, int64_t end) {
  for (; p + 4 <= end; p += 4) tile<1, 4, BITS, PLANES>(t, 0, p, p + 8 <= end ? p + 4 : p + 4 < end ? p + 2 : -1);
  if (p < end) tile<1, 2, BITS, PLANES>(t, 0, p);
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
  // Each int_tile (halves_tile, Q2_K's, Q3_K's and Q6_K's, does not) asks for the thread's next tile's four
  // panels as it goes (`pre`, block b of each at its own block b), so that the next tile finds them in L2: a
  // panel is 6-10 KiB, and each tile began by waiting on DRAM for its panels' first blocks (prefetch_blocks
  // asks only ~2 KiB ahead inside a panel).
  // Zen 4 (2 vCPUs), alternated: default-spec decode step at batch 1 6.7-7.5 -> 4.9-5.6 ms (4 rounds), the
  // Q8_0 file's 8.0-8.3 -> 6.8-7.5 (3); a 240 MB Q8_0 matrix from DRAM 15-22 -> 25-30 GB/s. Two tiles
  // ahead measured the same. The BF16 tile (its panels 18 KiB, which the hardware prefetchers follow) was
  // unchanged with it: 10.0-10.8 against 10.1-11.1 ms. A thread's last four-panel tile asks for the tile of two
  // after it (panels p + 2 .. p + 5: its own last two, already in cache, and those two), which had waited on DRAM:
  // three such a layer in the default model (q/k/v, o, down). Zen 4, both ways alternated in one process, 16
  // blocks of 40 steps, paired medians: batch-1 step 0.988 and 0.984 of before (default spec), 0.993 (Q8_0 file).
  if (rows == 1) {
    if (prepared) prepare(a, *prepared, 0);
#pragma omp parallel
    {
      const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num(), pairs = panels / 2;
      one_row_panels<BITS, PLANES>(t, pairs * id / threads * 2, pairs * (id + 1) / threads * 2);
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

// What every tile of call `a` shares (its weight's layout L; x prepared into `x`)
Tiles call_tiles(const PackedLinearArgs& a, const PackedLayout& L, const Activations* x) {
  const int64_t blocks = a.in_features / kQuantBlock;
  return {a.weight, L, blocks, packed_panel_bytes(L, blocks), a.out_features, x, a.out, a.out_dtype, a.out_stride,
          a.x, a.x_dtype, a.x_stride};
}

// The call's tiles with x as float32 rows: as given, or bfloat16 rows widened into `x.fx` (this thread's: x is
// thread_local, the team's threads have their own).
Tiles float_rows(const Tiles& t, const PackedLinearArgs& a, Activations& x) {
  Tiles wide = t;
  if (a.x_dtype == DType::f32) return wide;
  x.fx.resize(static_cast<size_t>(a.rows * a.in_features));
  float* wide_rows = x.fx.data();
  const bf16* rows = static_cast<const bf16*>(a.x);
#pragma omp parallel for schedule(static) if (a.rows * a.in_features >= kParallelElements)
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.in_features; ++c) wide_rows[r * a.in_features + c] = bf16_to_float(rows[r * a.x_stride + c]);
  wide.x_rows = wide_rows, wide.x_dtype = DType::f32, wide.x_stride = a.in_features;
  return wide;
}

}  // namespace

void packed_linear(const PackedLinearArgs& a) {
  thread_local Activations x;  // kept between calls: no allocation per call
  const PackedLayout L = packed_layout(a.qtype);
  const Tiles t = call_tiles(a, L, &x);
  const int bits = L.bits;
  if (bits == 16) {  // BF16 weights take x as it is (act does not apply)
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
    // float32 FMAs where vdpbf16ps is slow (kernels.h, bf16_dot): x widened once. For every row count, so
    // that a row's result does not depend on its batch (a seeded request's tokens must not). On the Xeon of
    // kernels.h, a BF16 SmolLM2's decode step: batch 8 21.7-23.2 ms against 24.7-26.0, a 256-token prefill
    // 1.4x faster, but batch 1 12.2 against 11.7 ms (medians of eight): one row streams the weights from
    // memory, where vdpbf16ps' fewer instructions help; keeping it there made rows batch-dependent.
    if (a.x_dtype == DType::bf16 && !bf16_dot()) return run<16, 0>(float_rows(t, a, x), a, nullptr);
#endif
    return run<16, 0>(t, a, nullptr);
  }
  if (kWidenPrompts && a.prompt && a.act == ActQuant::int16 && !expands_words(L))
    return widened_linear(float_rows(t, a, x), a.rows);  // widened.cpp
  size_for(a, x);
  if (a.act == ActQuant::int16) bits == 4 ? run<4, 2>(t, a, &x) : bits == 2 ? run<2, 2>(t, a, &x) : run<8, 2>(t, a, &x);
  else if (a.act == ActQuant::int8) bits == 4 ? run<4, 1>(t, a, &x) : bits == 2 ? run<2, 1>(t, a, &x) : run<8, 1>(t, a, &x);
  else bits == 4 ? run<4, 0>(t, a, &x) : bits == 2 ? run<2, 0>(t, a, &x) : run<8, 0>(t, a, &x);
}

namespace {

// One-row calls' panel pairs, [first_pair[c], first_pair[c + 1]) call c's, split evenly over the threads in one
// region: each thread runs its share as the one-row path of run() does.
template <int BITS, int PLANES>
void one_row_calls(const std::vector<Tiles>& calls, const std::vector<int64_t>& first_pair) {
  const int64_t n = static_cast<int64_t>(calls.size()), pairs = first_pair[n];
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = pairs * id / threads, end = pairs * (id + 1) / threads;
    int64_t c = std::upper_bound(first_pair.begin(), first_pair.end(), begin) - first_pair.begin() - 1;
    for (; c < n && first_pair[c] < end; ++c) {
      one_row_panels<BITS, PLANES>(calls[c], (std::max(begin, first_pair[c]) - first_pair[c]) * 2,
                                   (std::min(end, first_pair[c + 1]) - first_pair[c]) * 2);
    }
  }
}

}  // namespace

// A decode step's routed experts (decoder.cpp, mixture) at one row each: one region for all their panels, not a
// region (and a wait at its end) and a quantization of x for each. Other calls run one at a time.
void packed_linears(const PackedLinearArgs* calls, int64_t n) {
  bool together = n > 1;
  const int bits = n > 0 ? packed_layout(calls[0].qtype).bits : 0;
  for (int64_t c = 0; c < n && together; ++c) {
    const PackedLinearArgs& a = calls[c];
    const PackedLayout L = packed_layout(a.qtype);
    together = a.rows == 1 && a.act == calls[0].act && L.bits == bits && bits != 16 && a.act != ActQuant::none &&
               !(kWidenPrompts && a.prompt && a.act == ActQuant::int16 && !expands_words(L));
  }
  if (!together) {
    for (int64_t c = 0; c < n; ++c) packed_linear(calls[c]);
    return;
  }
  thread_local std::vector<Activations> xs;  // kept between calls, as packed_linear's
  thread_local std::vector<Tiles> tiles;
  thread_local std::vector<int64_t> first_pair;
  if (static_cast<int64_t>(xs.size()) < n) xs.resize(n);
  tiles.clear(), first_pair.assign(1, 0);
  for (int64_t c = 0; c < n; ++c) {
    const PackedLinearArgs& a = calls[c];
    size_for(a, xs[c]);
    prepare(a, xs[c], 0);
    tiles.push_back(call_tiles(a, packed_layout(a.qtype), &xs[c]));
    first_pair.push_back(first_pair.back() + packed_panels(a.out_features) / 2);
  }
  if (calls[0].act == ActQuant::int16)
    bits == 4 ? one_row_calls<4, 2>(tiles, first_pair) : bits == 2 ? one_row_calls<2, 2>(tiles, first_pair)
              : one_row_calls<8, 2>(tiles, first_pair);
  else
    bits == 4 ? one_row_calls<4, 1>(tiles, first_pair) : bits == 2 ? one_row_calls<2, 1>(tiles, first_pair)
              : one_row_calls<8, 1>(tiles, first_pair);
}

}  // namespace appliance::APPLIANCE_ISA

#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512 || \
    APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2
// amx.cpp's start check with the emulated multiplies on both sides, in these kernels: tests run it, so that the check
// an AMX CPU runs before using its tiles is known to run to its end (in the avx512bf16 kernels' build too, where CI
// has AVX-512) and pass where nothing differs.
const char* appliance::APPLIANCE_ISA::amx_emulated_self_check() { return amx_self_check<EmulatedTmul>(); }
#endif
