// The tiles that take x as floats: the exact tile (ActQuant none: float32 FMAs on the exactly widened quants) and
// the BF16 weights' tile. quant.cpp's tile dispatches to them; they are instantiated here for the shapes it takes.
#include "packed.h"

namespace appliance::APPLIANCE_ISA {

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

// quant.cpp's shapes: MR rows by 2 panels (row_tiles, MR up to tile_rows(0) = 4) and 1 row by 4 (a single row)
template void float_tile<1, 2, 2>(const Tiles&, int64_t, int64_t);
template void float_tile<1, 2, 4>(const Tiles&, int64_t, int64_t);
template void float_tile<1, 2, 8>(const Tiles&, int64_t, int64_t);
template void float_tile<2, 2, 2>(const Tiles&, int64_t, int64_t);
template void float_tile<2, 2, 4>(const Tiles&, int64_t, int64_t);
template void float_tile<2, 2, 8>(const Tiles&, int64_t, int64_t);
template void float_tile<3, 2, 2>(const Tiles&, int64_t, int64_t);
template void float_tile<3, 2, 4>(const Tiles&, int64_t, int64_t);
template void float_tile<3, 2, 8>(const Tiles&, int64_t, int64_t);
template void float_tile<4, 2, 2>(const Tiles&, int64_t, int64_t);
template void float_tile<4, 2, 4>(const Tiles&, int64_t, int64_t);
template void float_tile<4, 2, 8>(const Tiles&, int64_t, int64_t);
template void float_tile<1, 4, 2>(const Tiles&, int64_t, int64_t);
template void float_tile<1, 4, 4>(const Tiles&, int64_t, int64_t);
template void float_tile<1, 4, 8>(const Tiles&, int64_t, int64_t);
template void bf16_tile<1, 2, float>(const Tiles&, int64_t, int64_t);
template void bf16_tile<1, 2, bf16>(const Tiles&, int64_t, int64_t);
template void bf16_tile<2, 2, float>(const Tiles&, int64_t, int64_t);
template void bf16_tile<2, 2, bf16>(const Tiles&, int64_t, int64_t);
template void bf16_tile<3, 2, float>(const Tiles&, int64_t, int64_t);
template void bf16_tile<3, 2, bf16>(const Tiles&, int64_t, int64_t);
template void bf16_tile<4, 2, float>(const Tiles&, int64_t, int64_t);
template void bf16_tile<4, 2, bf16>(const Tiles&, int64_t, int64_t);
template void bf16_tile<1, 4, float>(const Tiles&, int64_t, int64_t);
template void bf16_tile<1, 4, bf16>(const Tiles&, int64_t, int64_t);

}  // namespace appliance::APPLIANCE_ISA
