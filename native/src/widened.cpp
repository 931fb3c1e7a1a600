// Prompt rows under int16 activations on AVX2 (PackedLinearArgs::prompt): float32 FMAs on the weights widened
// to float32 a panel pair at a time, instead of the integer tiles.
//
// Without VNNI, the integer tiles' multiplies (vpmaddubsw, then vpmaddwd to widen the pair sums) share one
// pipe, and int16's two planes take two of them for every 32 products: AMD EPYC Zen 1 issues 1.24 G of them
// a second a core against 2.39 G vfmadd231ps (8 products each). A prompt's rows reuse each weight many times,
// so widening it once a row chunk (d (u - zero) + m, one FMA: the value gguf's dequantization gives, to a
// rounding) costs little beside them, and a tile of 6 rows x 16 weight rows keeps 12 accumulators, a weight
// and a broadcast x in AVX2's 16 registers.
//
// The default model's four linears (960, 576, 3,072 x 576; 576 x 1,536), Q4_1, Zen 1, two alternated rounds:
// 16 rows 19.8-20.7 -> 25.6-25.8 GMAC/s, 32 rows 21.7-21.8 -> 30.0, 256 rows 22.2-22.3 -> 33.8-33.9 (torch's
// float32 GEMM on the same shapes, dequantized beforehand: 30.5); 8 rows the same (18.6-19.1), 2 rows 1.6x
// slower (widening dominates). A decode row therefore keeps the int16 tiles, and a row's path depends only on
// its own role (prompt or not), never on how many rows share its step, so that its result is the same bits in
// any batch. The products are those of the reference (float32 x, dequantized float32 weights), so prompt rows
// agree with it more closely than int16's (~2^-16 of a block's largest x) ever did.
//
// The VNNI tiers keep the integer tiles: vpdpbusd makes 64 products an instruction there, the FMA 16.
#include <omp.h>

#include <vector>

#include "packed.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

constexpr int kWideRows = 6;           // a tile's rows (see above)
constexpr int64_t kWideRowChunk = 256;  // rows an item takes: a pair is widened once for them

thread_local std::vector<float> widened;  // [2 panels][K][16 weight rows]

// Panels [p0, p0 + 2) into `w` as float32, [panel][k][16]: what float_tile multiplies, with the scales in.
template <int BITS>
void widen_pair(const Tiles& t, int64_t p0, float* w, bool prefetch) {
  const PackedLayout& L = t.layout;
  const int64_t k = t.blocks * kQuantBlock;
  const I32x16 zero = I32x16::set1(L.zero), table = I32x16::table16(kIq4Unsigned);
  const int64_t ahead = prefetch ? blocks_ahead(t, 0) : 0;
  auto weights = [&](const uint8_t* block, int g, int h) {  // as float_tile's
    I32x16 v = BITS == 2 ? I32x16::load(block + 64 * h).crumbs(g)
                         : h == 0 ? I32x16::load(block + 64 * g).low_nibbles() : I32x16::load(block + 64 * g).high_nibbles();
    v = plus_planes(v, block, g, h, BITS, L.high_bits);
    return L.lut ? v.lookup(table) : v;
  };
  for (int64_t b = 0; b < t.blocks; ++b) {
    const uint8_t* blk[2];
    panel_blocks(t, p0, b, blk);
    prefetch_blocks(t, blk, b, ahead);
    for (int j = 0; j < 2; ++j) {
      F32x16 d[2], m[2];  // each half's (the same for types with one scale a block)
      if (L.halves) {
        half_scales(L, blk[j], b, d[0], d[1], m[0], m[1]);
      } else {
        block_scales(L, blk[j], b, d[0], m[0]);
        d[1] = d[0], m[1] = m[0];
      }
      float* out = w + (j * k + b * kQuantBlock) * kPanelRows;
      auto put = [&](const I32x16& v, int k0, int h) {  // weights k0..k0+3 of the 16 rows
        F32x16::fmadd((v.byte<0>() - zero).to_float(), d[h], m[h]).store(out + (k0 + 0) * kPanelRows);
        F32x16::fmadd((v.byte<1>() - zero).to_float(), d[h], m[h]).store(out + (k0 + 1) * kPanelRows);
        F32x16::fmadd((v.byte<2>() - zero).to_float(), d[h], m[h]).store(out + (k0 + 2) * kPanelRows);
        F32x16::fmadd((v.byte<3>() - zero).to_float(), d[h], m[h]).store(out + (k0 + 3) * kPanelRows);
      };
      if constexpr (BITS == 8) {
        for (int g = 0; g < 8; ++g) put(I32x16::load(blk[j] + 64 * g), 4 * g, g / 4);
      } else {
        for (int h = 0; h < 2; ++h)
          for (int g = 0; g < 4; ++g) put(weights(blk[j], g, h), 16 * h + 4 * g, h);
      }
    }
  }
}

// Rows [r0, r0 + MR) of x against one widened panel: each row's sum runs over k in order, one FMA at a time,
// so a row gets the same bits in a tile of any height.
template <int MR>
void wide_tile(const Tiles& t, const float* w, int64_t r0, int64_t panel) {
  const int64_t k = t.blocks * kQuantBlock;
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const float*>(t.x_rows) + (r0 + r) * t.x_stride;
  F32x16 acc[MR][1];
  zero_all(acc);
  for (int64_t i = 0; i < k; ++i) {
    const F32x16 wi = F32x16::load(w + i * kPanelRows);
    for (int r = 0; r < MR; ++r) acc[r][0] = F32x16::fmadd(wi, F32x16::set1(x[r][i]), acc[r][0]);
  }
  store_tile<MR, 1>(t, r0, panel, acc);
}

void wide_rows(const Tiles& t, const float* w, int64_t r_begin, int64_t r_end, int64_t panel) {
  int64_t r = r_begin;
  for (; r + kWideRows <= r_end; r += kWideRows) wide_tile<kWideRows>(t, w, r, panel);
  switch (r_end - r) {
    case 5: return wide_tile<5>(t, w, r, panel);
    case 4: return wide_tile<4>(t, w, r, panel);
    case 3: return wide_tile<3>(t, w, r, panel);
    case 2: return wide_tile<2>(t, w, r, panel);
    case 1: return wide_tile<1>(t, w, r, panel);
    default: return;
  }
}

template <int BITS>
void run_widened(const Tiles& t, int64_t rows) {
  const int64_t pairs = packed_panels(t.out_features) / 2, k = t.blocks * kQuantBlock;
  const int64_t chunks = (rows + kWideRowChunk - 1) / kWideRowChunk;
  // pair-major: a thread's range holds a pair's chunks one after another, and widens the pair once for them
  RangeQueue queue(pairs * chunks, omp_get_max_threads());
#pragma omp parallel
  {
    const int id = omp_get_thread_num();
    widened.resize(static_cast<size_t>(2 * k * kPanelRows + 16));
    float* w = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
    int64_t have = -1;  // the pair in w
    for (int64_t item = queue.take(id); item >= 0; item = queue.take(id)) {
      const int64_t pair = item / chunks, chunk = item % chunks;
      if (pair != have) widen_pair<BITS>(t, 2 * pair, w, true), have = pair;
      const int64_t r_begin = chunk * kWideRowChunk, r_end = std::min(rows, r_begin + kWideRowChunk);
      for (int j = 0; j < 2; ++j) wide_rows(t, w + j * k * kPanelRows, r_begin, r_end, 2 * pair + j);
    }
  }
}

}  // namespace

bool widens_prompts(QType t) { return kWidenPrompts && t != QType::bf16 && !expands_words(packed_layout(t)); }

void widened_linear(const Tiles& t, int64_t rows) {
  if constexpr (kWidenPrompts) {
    if (t.layout.bits == 2) return run_widened<2>(t, rows);
    if (t.layout.bits == 4) return run_widened<4>(t, rows);
    return run_widened<8>(t, rows);
  }
}

}  // namespace appliance::APPLIANCE_ISA
