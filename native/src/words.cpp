// int16 x's row chunks as 16-bit words, each panel of a row chunk expanded once and multiplied with x's
// combined integers 256 h + l (vpdpwssd; vpmaddwd without VNNI). Called by quant.cpp's row_tiles above
// word_rows_above:
//   - Q2_K, Q3_K and Q6_K (prompts; on AVX2 above one row tile) as signed words (u - zero) sc_h; the halves tile
//     (quant.cpp) runs them for fewer rows and folds its sums in the same order;
//   - where expands_words (AVX2 with cheap multiplies, packed.h), the types with one scale a block as unsigned words
//     u, whose sums and float32 steps are int_tile's.
// Either way a row's result does not depend on which tile ran it.
#include "packed.h"

namespace appliance::APPLIANCE_ISA {
namespace {

// Q2_K, Q3_K and Q6_K above word_rows_above of int16 activations: panels [p0, p0 + NP) as signed words
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
// Kept out of line: inlined into word_rows with the expansion, Q2_K's tile ran ~13% slower (a 2,048 x 8,192 linear at
// 128 rows, 15.1-15.2 -> 17.1-17.3 ms, Xeon).
template <int MR, int NP, bool kMin>
[[gnu::noinline]] void word_tile(const Tiles& t, int64_t r0, int64_t p0) {
  const Activations& x = *t.x;
  F32x16 acc[MR][NP];
  zero_all(acc);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[NP];
    panel_blocks<NP, false>(t, p0, b, blk);
    const int8_t* xw[MR];
    for (int r = 0; r < MR; ++r) xw[r] = x_block<true, 2>(x, r0 + r, t.blocks, b);
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

// Where expands_words (packed.h), the types with one scale a block above kExpandedWordRows: one panel as unsigned
// words u (bytes, nibbles, a Q5 type's nibbles and high bit, a codebook's bytes), word pair v of a block its
// weights 2v and 2v + 1 as the word tile reads them (16 vectors of 64 bytes), then the block's d and m in float32
// as block_scales gives them to the integer tiles (16 each).
template <int BITS, bool kLut>
void block_words(const uint8_t* from, uint8_t* to) {
  if constexpr (BITS == 8) {
    for (int g = 0; g < 8; ++g) {  // vector g: weights 4g..4g+3, word pairs 2g and 2g + 1
      const I32x16 u = I32x16::load(from + 64 * g);
      u.byte_words(0).store(to + 128 * g), u.byte_words(1).store(to + 128 * g + 64);
    }
  } else {
    for (int g = 0; g < 4; ++g) {  // vector g, half h: weights 16h+4g.., word pairs 8h + 2g and the next
      const I32x16 v = I32x16::load(from + 64 * g);
      for (int h = 0; h < 2; ++h) {
        I32x16 u = nibble_weights<BITS>(from, v, g, h);
        if constexpr (kLut) u = u.lookup(I32x16::table16(kIq4Unsigned));
        u.byte_words(0).store(to + 64 * (8 * h + 2 * g)), u.byte_words(1).store(to + 64 * (8 * h + 2 * g) + 64);
      }
    }
  }
}
thread_local std::vector<uint8_t> unsigned_words;
Tiles expand_unsigned_words(const Tiles& t, int64_t panel, int64_t r0, int64_t pre) {
  const PackedLayout& from_layout = t.layout;
  // (the tile reads only zero, has_min, quant_bytes and block_bytes of this layout; bits 4: no byte_words)
  const PackedLayout L{4, from_layout.zero, from_layout.has_min, false, 4, 16 * 64, 16 * 64 + 2 * 4 * kPanelRows};
  void (*words)(const uint8_t*, uint8_t*) = from_layout.bits == 8 ? block_words<8, false>
                                            : from_layout.lut ? block_words<4, true>
                                            : from_layout.high_bits ? block_words<5, false> : block_words<4, false>;
  return expanded<1>(t, L, unsigned_words, panel, r0, pre, [&](int64_t b, const uint8_t* from, uint8_t* to) {
    words(from, to);
    F32x16 d, m;
    block_scales(from_layout, from, b, d, m);
    float* scalars = reinterpret_cast<float*>(to + L.quant_bytes);
    d.store(scalars), m.store(scalars + kPanelRows);
  });
}

// Rows [r0, r0 + MR) against one panel of expand_unsigned_words: per block the int32 sum of u against x's combined
// integers, then as int_tile: acc += float(sum - zero sum(x)) d scale (kMin: sum(x) is not taken, m times x's
// sum is added), so that a row gets int_tile's bits. keep() holds each sum in its register in order: without it
// GCC reassociated the adds into a tree of products kept in memory (a standalone copy ran at ~0.4x).
// Unsigned words: |sum| <= 255 x 32,639 x 32 < 2^31.
template <int MR, bool kMin>
[[gnu::noinline]] void unsigned_word_tile(const Tiles& t, int64_t r0, int64_t panel) {
  const Activations& x = *t.x;
  const int32_t zero = t.layout.zero;
  F32x16 acc[MR][1];
  zero_all(acc);
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk = panel_block(t, panel, b);
    const int8_t* xw[MR];
    for (int r = 0; r < MR; ++r) xw[r] = x_block<true, 2>(x, r0 + r, t.blocks, b);
    I32x16 sum[MR];
    for (int r = 0; r < MR; ++r) sum[r] = I32x16::zero();
#pragma GCC unroll 16
    for (int v = 0; v < 16; ++v) {
      const I32x16 w = I32x16::load(blk + 64 * v);
      for (int r = 0; r < MR; ++r) {
        sum[r] = I32x16::dot2(sum[r], w, load4(xw[r] + 4 * v));
        sum[r].keep();
      }
    }
    const float* scalars = reinterpret_cast<const float*>(blk + t.layout.quant_bytes);
    const F32x16 d = F32x16::load(scalars), m = kMin ? F32x16::load(scalars + kPanelRows) : F32x16::zero();
    for (int r = 0; r < MR; ++r) {
      const int64_t cell = (r0 + r) * t.blocks + b;
      const F32x16 scale = F32x16::set1(x.scale[cell]);
      I32x16 total = sum[r];
      if constexpr (!kMin) total = total - I32x16::set1(zero * x.isum[cell]);
      acc[r][0] = F32x16::fmadd(total.to_float(), d * scale, acc[r][0]);
      if constexpr (kMin) acc[r][0] = F32x16::fmadd(m, F32x16::set1(x.fsum[cell]), acc[r][0]);
    }
  }
  store_tile<MR, 1>(t, r0, panel, acc);
}

// One expanded panel's rows in tiles of 3 (AVX2: 6 sums, 6 accumulators, a weight vector and a broadcast in 16
// registers; 4 measured the same), then the 1 or 2 left
template <bool kMin>
void unsigned_word_rows(const Tiles& t, int64_t r_begin, int64_t r_end) {
  constexpr int kMR = tile_rows(2);
  int64_t r = r_begin;
  for (; r + kMR <= r_end; r += kMR) unsigned_word_tile<kMR, kMin>(t, r, 0);
  if (r_end - r == 2) unsigned_word_tile<2, kMin>(t, r, 0);
  else if (r_end - r == 1) unsigned_word_tile<1, kMin>(t, r, 0);
}

}  // namespace

void word_rows(const Tiles& packed, int64_t r_begin, int64_t r_end, int64_t p0, int64_t pre) {
  constexpr int NP = 2;
  const PackedLayout& L = packed.layout;
  if (expands_words(L)) {
    // a panel at a time, so that its words (~20 KiB at K = 576) stay in L1 for its row tiles (both panels
    // expanded first: Zen 3, paired, the default model's Q4_1 linears at 8 / 32 / 256 rows 1.02 / 1.01 / 1.02x)
    for (int j = 0; j < NP; ++j) {
      const Tiles t = expand_unsigned_words(packed, p0 + j, r_begin, pre >= 0 ? pre + j : -1);
      L.has_min ? unsigned_word_rows<true>(t, r_begin, r_end) : unsigned_word_rows<false>(t, r_begin, r_end);
    }
    return;
  }
  const Tiles t = L.bits == 4 ? expand_words<NP, 6>(packed, p0, r_begin, pre)
                  : L.has_min ? expand_words<NP, 2>(packed, p0, r_begin, pre) : expand_words<NP, 3>(packed, p0, r_begin, pre);
  constexpr int kMR = tile_rows(2);  // 3: then 2 or 1 rows are left
  int64_t r = r_begin;
  for (; r + kMR <= r_end; r += kMR) word_tile<kMR, NP>(t, r, 0);
  if (r_end - r == 2) word_tile<2, NP>(t, r, 0);
  else if (r_end - r == 1) word_tile<1, NP>(t, r, 0);
}

}  // namespace appliance::APPLIANCE_ISA
