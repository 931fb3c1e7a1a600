// int16 rows of the types with one scale a block and 4 or 8 bits a weight (amx_type: Q4_0, Q4_1, Q8_0, Q4_K, and
// as bytes Q5_0, Q5_1, Q5_K; ours Q4_M32, Q8_M32) on AMX-INT8's tile multiplies: 16 rows x 16 weight rows x 32
// products an instruction (K = 32: one block), where AVX512-VNNI's vpdpbusd makes 16 x 4. Used by quant.cpp's avx2,
// avx512 and avx512bf16 kernels (the emulated multiplies below, which tests force) and by amx.cpp (avx512bf16 with
// -mamx-tile -mamx-int8: the CPU's).
//
// The packed layout (kernels.h) is already the B operand's: a tile row of B is 64 bytes, 4 consecutive weights of
// each of 16 weight rows, which is how a packed block's vectors hold them (Q8_0: vector g, weights 4g..4g+3; 4-bit
// types: vector t's low nibbles are weights 4t..4t+3, its high ones 16+4t..19+4t, so a block expands into 8 such
// rows once a row chunk). A, 16 rows of x, is a block's h or l plane (Activations.q) at a stride of a row's blocks.
// Per block and panel: C_h = A_h B, C_l = A_l B (TDPBSUD: signed x bytes, unsigned u), then int_tile's own steps
// per row, total = 256 C_h + C_l - zero sum(x), acc += float(total) d scale (+ m sum(x)): the same integers and
// the same float32 operations in the same order, so a row gets int_tile's bits whichever ran it.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "packed.h"

namespace appliance::APPLIANCE_ISA {

constexpr int64_t kAmxRows = 16;  // rows a tile multiply takes (fewer: a partial tile, configured so)

// Which types the AMX rows run (quant.cpp asks before handing them a row chunk): one scale a block, fp16 (Q4_0,
// Q4_1, Q8_0), f32 with a min (Q4_M32, Q8_M32), or Q4_K's codes. The Q5 types reach them as bytes, once row_tiles
// has added their fifth bits (expand_quants); Q2_K, Q3_K, Q6_K (a scale per 16) and the IQ4 codebooks do not.
inline bool amx_type(const PackedLayout& L) {
  if ((L.bits != 4 && L.bits != 8) || L.lut || L.high_bits || L.halves) return false;
  return L.scale_bytes == 2 ? L.super_head == 0 : L.has_min && (L.scale_bytes == 4 || L.super_head != 0);
}

// The tile multiplies in software, with AMX's semantics (Intel SDM, TDPBSUD): for tests on any CPU, and the
// reference the CPU's are checked against before they are used (amx.cpp).
struct EmulatedTmul {
  struct Tile {
    int rows = 0, bytes = 0;  // as configured: rows and bytes a row
    alignas(64) uint8_t data[16][64] = {};
  };
  static Tile* tiles() {
    thread_local Tile t[8];
    return t;
  }
  // Tiles 0-1: A (rows x 32 bytes), 2-3: B (8 x 64), 4-7: C (rows x 16 int32)
  static void configure(int rows) {
    Tile* t = tiles();
    for (int i = 0; i < 8; ++i) t[i].rows = i == 2 || i == 3 ? 8 : rows, t[i].bytes = i < 2 ? 32 : 64;
  }
  template <int T>
  static void load(const void* from, int64_t stride) {
    Tile& t = tiles()[T];
    std::memset(t.data, 0, sizeof t.data);
    for (int r = 0; r < t.rows; ++r) std::memcpy(t.data[r], static_cast<const uint8_t*>(from) + r * stride, t.bytes);
  }
  template <int T>
  static void store(void* to, int64_t stride) {
    const Tile& t = tiles()[T];
    for (int r = 0; r < t.rows; ++r) std::memcpy(static_cast<uint8_t*>(to) + r * stride, t.data[r], t.bytes);
  }
  template <int T>
  static void zero() { std::memset(tiles()[T].data, 0, sizeof tiles()[T].data); }
  // C[m][n] += sum over k of int8 A[m][k] * uint8 B[k / 4][4n + k % 4]
  template <int C, int A, int B>
  static void dot() {
    Tile *c = &tiles()[C], *a = &tiles()[A], *b = &tiles()[B];
    for (int m = 0; m < c->rows; ++m)
      for (int n = 0; n < c->bytes / 4; ++n) {
        uint32_t sum;  // (the instruction's dword wraps: unsigned arithmetic does, int32's may not)
        std::memcpy(&sum, c->data[m] + 4 * n, 4);
        for (int k = 0; k < a->bytes; ++k) {
          const int32_t signed_x = static_cast<int8_t>(a->data[m][k]), unsigned_w = b->data[k / 4][4 * n + k % 4];
          sum += static_cast<uint32_t>(signed_x * unsigned_w);
        }
        std::memcpy(c->data[m] + 4 * n, &sum, 4);
      }
  }
  static void release() {}
};

// Block b of a panel as B's 8 rows of 64 bytes: 8-bit types as packed; 4-bit ones expanded into `to`.
template <int BITS>
inline const uint8_t* amx_weights(const uint8_t* blk, uint8_t* to) {
  if constexpr (BITS == 8) return blk;
  for (int t = 0; t < 4; ++t) {
    const I32x16 v = I32x16::load(blk + 64 * t);
    v.low_nibbles().store(to + 64 * t);
    v.high_nibbles().store(to + 64 * (4 + t));
  }
  return to;
}

// Rows [r_begin, r_end) of panels [p0, p0 + 2) of x's int16 planes (a row chunk, as row_tiles takes it).
template <typename Tmul, int BITS, int SCALES, bool kMin>
void amx_rows(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0) {
  constexpr int NP = 2, kBlockBytes = 8 * 64;
  constexpr bool kSuper = SCALES == kCodes;  // (Q4_K, and Q5_K as bytes: superblock heads between blocks)
  thread_local std::vector<uint8_t> expanded;  // 4-bit types: [NP][blocks] blocks of B rows
  const Activations& x = *t.x;
  const int64_t blocks = t.blocks, x_stride = blocks * 2 * kQuantBlock;
  const int32_t zero = kMin ? 0 : t.layout.zero;
  const uint8_t* weights[NP];
  if constexpr (BITS == 4) {
    expanded.resize(static_cast<size_t>(NP * blocks * kBlockBytes + 64));
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(expanded.data()) + 63) & ~uintptr_t{63});
    const int64_t ahead = blocks_ahead(t, r_begin);  // (the panels' first reading, from DRAM: packed.h)
    for (int j = 0; j < NP; ++j) weights[j] = base + j * blocks * kBlockBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk[NP];
      panel_blocks<NP, kSuper>(t, p0, b, blk);
      prefetch_blocks(t, blk, b, ahead);
      for (int j = 0; j < NP; ++j) amx_weights<4>(blk[j], base + (j * blocks + b) * kBlockBytes);
    }
  }
  alignas(64) int32_t sums[4][kAmxRows][kPanelRows];  // C_h and C_l of panel 0, then of panel 1
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kAmxRows) {
    const int rows = static_cast<int>(std::min(kAmxRows, r_end - r0));
    Tmul::configure(rows);
    F32x16 acc[kAmxRows][NP];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = F32x16::zero();
    const int64_t ahead = BITS == 8 ? blocks_ahead(t, r0) : 0;  // (8-bit panels are read here first)
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* xb = x.q.data() + (r0 * blocks + b) * 2 * kQuantBlock;  // h, then l 32 bytes on
      const uint8_t* blk[NP];
      panel_blocks<NP, kSuper>(t, p0, b, blk);
      prefetch_blocks(t, blk, b, ahead);
      Tmul::template load<0>(xb, x_stride);
      Tmul::template load<1>(xb + kQuantBlock, x_stride);
      Tmul::template load<2>(BITS == 8 ? blk[0] : weights[0] + b * kBlockBytes, 64);
      Tmul::template load<3>(BITS == 8 ? blk[1] : weights[1] + b * kBlockBytes, 64);
      Tmul::template zero<4>(), Tmul::template zero<5>(), Tmul::template zero<6>(), Tmul::template zero<7>();
      Tmul::template dot<4, 0, 2>(), Tmul::template dot<5, 1, 2>();
      Tmul::template dot<6, 0, 3>(), Tmul::template dot<7, 1, 3>();
      Tmul::template store<4>(sums[0], 64), Tmul::template store<5>(sums[1], 64);
      Tmul::template store<6>(sums[2], 64), Tmul::template store<7>(sums[3], 64);
      F32x16 d[NP], m[NP];
      for (int j = 0; j < NP; ++j) block_scales<SCALES>(t.layout, blk[j], b, d[j], m[j]);
      for (int r = 0; r < rows; ++r) {
        const int64_t cell = (r0 + r) * blocks + b;
        const F32x16 scale = F32x16::set1(x.scale[cell]);
        for (int j = 0; j < NP; ++j) {
          I32x16 total = I32x16::load(reinterpret_cast<const uint8_t*>(sums[2 * j][r])).shl8() +
                         I32x16::load(reinterpret_cast<const uint8_t*>(sums[2 * j + 1][r]));
          if constexpr (!kMin) total = total - I32x16::set1(zero * x.isum[cell]);
          acc[r][j] = F32x16::fmadd(total.to_float(), d[j] * scale, acc[r][j]);
          if constexpr (kMin) acc[r][j] = F32x16::fmadd(m[j], F32x16::set1(x.fsum[cell]), acc[r][j]);
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      const F32x16 row[1][NP] = {{acc[r][0], acc[r][1]}};
      store_tile<1, NP>(t, r0 + r, p0, row);
    }
  }
  Tmul::release();
}

// The AMX rows of a layout amx_type takes.
template <typename Tmul, int BITS>
void amx_rows(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0) {
  const PackedLayout& L = t.layout;
  if (L.scale_bytes == 4) return amx_rows<Tmul, BITS, kF32, true>(t, r_begin, r_end, p0);  // Q4_M32, Q8_M32
  if (L.scale_bytes == 1) return amx_rows<Tmul, BITS, kCodes, true>(t, r_begin, r_end, p0);  // Q4_K, Q5_K as bytes
  if (L.has_min) return amx_rows<Tmul, BITS, kFp16, true>(t, r_begin, r_end, p0);          // Q4_1, Q5_1 as bytes
  amx_rows<Tmul, BITS, kFp16, false>(t, r_begin, r_end, p0);                               // Q4_0, Q8_0
}

// The self-check of a Tmul against the emulated one (amx.cpp runs it with the CPU's multiplies before using them;
// tests run it emulated against emulated, so that the check itself is known to run). First one multiply: random A
// and B, C tiles started from random sums, rows 16 and 5.
template <typename Tmul>
void amx_multiply(int rows, const int8_t* a, const uint8_t* b, const int32_t* c, int32_t* out) {
  Tmul::configure(rows);
  Tmul::template load<0>(a, 32);
  Tmul::template load<3>(b, 64);
  Tmul::template load<5>(c, 64);
  Tmul::template dot<5, 0, 3>();
  Tmul::template store<5>(out, 64);
  Tmul::release();
}

// null where the sums agree, else what differed
template <typename Cpu>
const char* amx_same_sums() {
  std::mt19937 rng(7);
  alignas(64) int8_t a[16 * 32];
  alignas(64) uint8_t b[8 * 64];
  alignas(64) int32_t c[16 * 16], cpu[16 * 16], emulated[16 * 16];
  for (int round = 0; round < 4; ++round) {
    for (auto& v : a) v = static_cast<int8_t>(rng());
    for (auto& v : b) v = static_cast<uint8_t>(rng());
    for (auto& v : c) v = static_cast<int32_t>(rng() % 2000001) - 1000000;
    const int rows = round % 2 == 0 ? 16 : 5;
    amx_multiply<Cpu>(rows, a, b, c, cpu);
    amx_multiply<EmulatedTmul>(rows, a, b, c, emulated);
    if (std::memcmp(cpu, emulated, sizeof(int32_t) * 16 * rows) != 0)
      return rows == 16 ? "the CPU's tile multiplies differ from the emulated ones (16 rows)"
                        : "the CPU's tile multiplies differ from the emulated ones (5 rows)";
  }
  return nullptr;
}

// Then the AMX rows on the CPU's multiplies against the emulated ones, bit for bit: a Q4_1 weight (nibbles expanded
// into B rows, fp16 d and m) and a Q8_0 one (B as packed, a zero point), 21 rows of random int16 x (a full tile and
// a partial one), 20 weight rows (a panel pair, the second partial), 3 blocks (A at a stride of a row's blocks).
template <typename Cpu>
const char* amx_same_rows() {
  std::mt19937 rng(11);
  constexpr int64_t kRows = 21, kOut = 20, kBlocks = 3;
  Activations x;
  x.planes = 2, x.rows = kRows, x.blocks = kBlocks;
  x.q.resize(kRows * kBlocks * 2 * kQuantBlock), x.scale.resize(kRows * kBlocks), x.isum.resize(kRows * kBlocks);
  x.fsum.resize(kRows * kBlocks);
  for (int64_t cell = 0; cell < kRows * kBlocks; ++cell) {
    int8_t* q = x.q.data() + cell * 2 * kQuantBlock;
    int32_t sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) {
      q[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      q[kQuantBlock + i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      sum += 256 * q[i] + q[kQuantBlock + i];
    }
    x.scale[cell] = 1e-5f * static_cast<float>(1 + rng() % 100), x.isum[cell] = sum;
    x.fsum[cell] = x.scale[cell] * static_cast<float>(sum);
  }
  for (const QType type : {QType::q4_1, QType::q8_0}) {
    const PackedLayout L = packed_layout(type);
    std::vector<uint8_t> weights(static_cast<size_t>(2 * packed_panel_bytes(L, kBlocks)));
    for (int64_t b = 0; b < 2 * kBlocks; ++b) {  // (2 panels x kBlocks blocks, one after another)
      uint8_t* block = weights.data() + b * L.block_bytes;
      for (int64_t i = 0; i < L.quant_bytes; ++i) block[i] = static_cast<uint8_t>(rng());
      uint16_t* scales = reinterpret_cast<uint16_t*>(block + L.quant_bytes);
      for (int i = 0; i < kPanelRows; ++i)
        scales[i] = from_float<f16>(1e-3f * static_cast<float>(1 + rng() % 50)).bits;
      for (int i = 0; L.has_min && i < kPanelRows; ++i)
        scales[kPanelRows + i] = from_float<f16>(-1e-2f * static_cast<float>(rng() % 8)).bits;
    }
    float cpu[kRows * kOut], emulated[kRows * kOut];
    Tiles t{weights.data(), L, kBlocks, packed_panel_bytes(L, kBlocks), kOut, &x, cpu, DType::f32, kOut,
            nullptr, DType::f32, 0};
    if (L.bits == 4) amx_rows<Cpu, 4>(t, 0, kRows, 0);
    else amx_rows<Cpu, 8>(t, 0, kRows, 0);
    t.out = emulated;
    if (L.bits == 4) amx_rows<EmulatedTmul, 4>(t, 0, kRows, 0);
    else amx_rows<EmulatedTmul, 8>(t, 0, kRows, 0);
    if (std::memcmp(cpu, emulated, sizeof cpu) != 0)
      return type == QType::q4_1 ? "the AMX rows on the CPU's multiplies differ from the emulated ones (Q4_1)"
                                 : "the AMX rows on the CPU's multiplies differ from the emulated ones (Q8_0)";
  }
  return nullptr;
}

template <typename Cpu>
const char* amx_self_check() {
  const char* why = amx_same_sums<Cpu>();
  return why != nullptr ? why : amx_same_rows<Cpu>();
}

}  // namespace appliance::APPLIANCE_ISA
