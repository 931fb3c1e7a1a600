// The kept-quantized linears' shared parts, per ISA (kernels.h's layout; included by quant.cpp and the files it
// delegates to): x quantized per block (Activations, act_quant.cpp), what every tile of one call shares (Tiles), and
// how a tile finds a panel's block, its scales and its weights, and what it stores.
//   quant.cpp        packed_linear: the integer tiles, and the threads' split of the tiles
//   act_quant.cpp    x quantized per block of 32 (int8, int16), or kept float
//   words.cpp        int16 rows as 16-bit words: Q2_K, Q3_K, Q6_K prompts (expand_words, word_tile), and where
//                    expands_words, the types with one scale a block (expand_unsigned_words, unsigned_word_tile)
//   float_tiles.cpp  the exact (ActQuant none) and BF16 tiles
//   widened.cpp      int16 prompt rows on AVX2: panel pairs widened to float32, FMA tiles
//   dequant.cpp      packed_rows (embedding rows) and dequantize (GGUF rows to float)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {

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
  bool words = false;         // the word tiles run (above word_rows_above; byte_words): xw too
  std::vector<int16_t> xw;    // [rows][blocks][32]: the combined integers 256 h + l
};

// Row `row`'s block b of x as the integer tiles read it: its combined integers as words (xw), or its planes (q)
template <bool kWords, int PLANES>
inline const int8_t* x_block(const Activations& x, int64_t row, int64_t blocks, int64_t b) {
  if constexpr (kWords) return reinterpret_cast<const int8_t*>(x.xw.data() + (row * blocks + b) * kQuantBlock);
  else return x.q.data() + (row * blocks + b) * PLANES * kQuantBlock;
}

// Rows a row tile takes: int16 keeps two int32 accumulators per (row, panel) (see row_tiles).
constexpr int tile_rows(int planes) { return planes == 2 ? 3 : 4; }
// AVX2 has 16 registers, and each I32x16 takes two: 3 rows of int16 accumulators by 2 panels are 24 registers,
// 4 of int8 16, before a weight or an x, and the compiler keeps them in memory. Its 4-bit integer tiles (the pair
// sums: Q4_0, Q4_1, Q4_K) take 1 row (int16) or 2 (int8) a tile. AMD EPYC Zen 1, 3,072 x 768 and 768 x 1,536
// at 8 to 256 rows: Q4_1 and Q4_K int8 1.15-1.44x faster, int16 1.0-1.06x. The other types stay at tile_rows:
// in narrow tiles Q5_0, Q6_K and Q8_0 at 8 rows were 5-20% slower (not profiled).
// Under int16 that holds where the multiplier limits the tiles (Zen 1 multiplies a ymm register in two halves
// through one pipe); where multiplies are cheap (kernels.h, wide_int_tiles: AMD EPYC Zen 3), what limits them is
// the instructions around the multiplies (the nibbles split, the sums kept in memory), which a row tile of
// several rows shares: int16 4-bit tiles take tile_rows there. Zen 3, int16, paired in one process (the library's
// two ways alternated, medians of 14 ratios): the default model's Q4_1 linears of a layer at 3 / 8 / 32 / 256
// rows 0.89 / 0.84 / 0.81 / 0.81 of the narrow tiles' time (2 rows: 0.84 / 0.83 at 8 / 32); its decode steps at
// batch 2 / 8 / 32 0.92 / 0.87 / 0.84. (int8's narrow tiles stay: 3 or 4 rows were 1.07-1.38x slower there.)
constexpr bool kNarrowTiles = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2;
constexpr int narrow_tile_rows(int planes) { return planes == 2 ? 1 : 2; }
// Byte tiles as words (below) where wide_int_tiles: 2 rows. Zen 3, the default model's Q8_0 head (49,152 x 576) at
// 8 / 32 rows: 0.82 / 0.82 of the 1-row tiles' time (3 rows 0.83 / 0.82), paired as above.
constexpr int kWideWordRows = 2;
// Weights of any byte (Q8_0, the IQ4 codebooks' values) and of 5 bits (the Q5 types, also where row_tiles expands
// them to bytes) under int16 x on AVX2: int_tile takes each vector of 4-byte lanes as two of unsigned words against
// x's combined integers 256 h + l (vpmaddwd: one multiply a pair of products), where the two planes take two
// multiplies a pair of bytes each (dot4, centered_dot4). The integer sums are the same, so a row's bits do not
// depend on which ran it. (The 4-bit pair sums, Q4_0, Q4_1 and Q4_K, take one multiply a pair of bytes a plane and
// stay as they are.) Byte tiles as words (Q8_0, the Q5 types expanded to bytes) in narrow tiles (1 row x 2 panels)
// too. AMD EPYC Zen 1, int16, Q8_0 49,152 x 576 (the default model's head) at 1 / 8 / 32 rows: 2.84 / 17.4 /
// 69.1 ms as bytes, 2.22 / 11.5 / 46.4 as words in 3-row tiles, 2.22 / 10.2 / 39.9 in 1-row tiles (2 rows: 2.29 /
// 11.3 / 42.6); 3,072 x 768: 0.246 / 1.54 / 5.90 -> 0.187 / 0.956 / 3.41. 3,072 x 768 at 1 / 8 / 32 rows, ms:
// Q5_K 0.309 / 1.52 / 5.27 -> 0.263 / 1.11 / 3.59, Q5_0 0.270 / 1.46 / 3.59 -> 0.226 / 1.12 / 3.54, IQ4_NL
// 0.253 / 1.49 / 5.78 -> 0.189 / 0.916 / 3.54, IQ4_XS 0.258 / 1.52 / 5.97 -> 0.188 / 0.953 / 3.56.
// Q2_K, Q3_K and Q6_K likewise in halves_tile, below word_rows_above: there forming their weights costs more
// than the multiplies (Q6_K 49,152 x 768 at 1 / 8 rows: 5.80 / 30.1 -> 5.43 / 25.4 ms; see word_rows_above).
constexpr bool kByteWords = kCenteredDots;
inline bool byte_words(const PackedLayout& L) {
  const bool q8_0 = L.bits == 8 && !L.halves && L.scale_bytes == 2;
  const bool coded_halves = L.halves && L.scale_bytes == 1;  // Q2_K, Q3_K, Q6_K: halves_tile
  return kByteWords && (q8_0 || L.lut || L.high_bits == 1 || coded_halves);  // (lut: the IQ4 types; 1: the Q5 types)
}
// Q2_K, Q3_K and Q6_K run as words (expand_words) where a row chunk of int16 activations holds more rows than
// this (with int8's one plane, words would take twice the halves tile's multiplies): four row tiles, or for Q2_K,
// whose crumbs make 8 times their bytes of words, twelve (2,048 x 8,192 on the Xeon: Q2_K at 13-24 rows 20-30%
// slower as words; at 128, 15% faster). With AVX2's emulated dot products, all three from one row tile on (Zen 1:
// Q6_K 49,152 x 768 at 2 / 3 / 4 / 8 rows, in halves_tile as words 7.42 / 10.1 / 11.1 (expanded) / 25.4 ms,
// expanded 8.73 / 10.0 / 11.1 / 18.6; Q2_K 3,072 x 768 at 8 / 32 rows 2.00 / 7.75 ms in halves_tile as bytes,
// 1.17 / 3.60 expanded).
// On AVX2 where multiplies are cheap (kernels.h, wide_int_tiles: AMD EPYC Zen 3), every type with one scale a
// block (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, the IQ4 types, Q8_0, and ours of them) runs row chunks of more than
// kExpandedWordRows int16 rows as words (words.cpp, expand_unsigned_words): each panel expanded once a row chunk
// into 16-bit words u, then one vpmaddwd and one vpaddd per 16 products against x's combined integers 256 h + l, the
// sums in registers.
// The integer tiles spend instructions beside each multiply (the nibbles split, int16 pair sums widened, AVX2's
// 16 registers too few for their accumulators: the compiler kept them in memory). Their integer sums and float32
// steps are the same, so a row gets the same bits either way. Prompt rows of these types take them too, not the
// widened float32 weights (widens_prompts). Zen 3, paired in one process (14 or 8 alternated rounds, medians of
// B/A): the default model's Q4_1 layer linears at 8 / 32 rows 0.90 / 0.68 of the integer tiles' time and its
// 256-row prompts 0.85 of the widened path's; its Q8_0 head at 8 / 32 rows 0.76 / 0.52; 3,072 x 768 at 8 / 32 /
// 256 (prompt) rows: Q4_0 0.84 / 0.64 / 0.84, Q4_K 0.83 / 0.64 / 0.86, Q5_0 0.65 / 0.51 / 0.90, Q5_K 0.61 / 0.51 /
// 0.85, IQ4_NL 0.70 / 0.56 / 0.83, IQ4_XS 0.66 / 0.56 / 0.85, Q8_0 0.72 / 0.54 / 0.89. At 3 and 4 rows the
// expansion costs what it saves (Q4_1 1.06 / 1.00, the head 1.00 / 1.02).
constexpr int64_t kExpandedWordRows = 4;
inline bool expands_words(const PackedLayout& L) {
  return kNarrowTiles && !L.halves && L.high_bits <= 1 && (L.bits == 4 || L.bits == 8) && wide_int_tiles();
}
inline int64_t word_rows_above(const PackedLayout& L) {
  if (expands_words(L)) return kExpandedWordRows;
  const bool word_type = L.halves && L.scale_bytes == 1;
  return !word_type ? INT64_MAX : (kByteWords ? 1 : L.has_min ? 12 : 4) * tile_rows(2);
}

// Room for x's blocks, sized before any thread writes them; then row `row` of x quantized into them.
void size_for(const PackedLinearArgs& p, Activations& a);
void prepare(const PackedLinearArgs& p, Activations& a, int64_t row);

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
inline const uint8_t* panel_block(const Tiles& t, int64_t panel, int64_t b) {
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
inline void block_scales(const PackedLayout& L, const uint8_t* blk, int64_t b, F32x16& d, F32x16& m) {
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
// (the float tile's; out of line: inlined there with every kind, it made the tile spill, Q2_K at 8 to 32 rows 8% slower)
[[gnu::noinline]] inline void half_scales(const PackedLayout& L, const uint8_t* blk, int64_t b, F32x16& d0, F32x16& d1, F32x16& m0, F32x16& m1) {
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
  // Keeps GCC from dropping prefetches as side-effect free (see attention_tile.h). It also makes the compiler
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

// Prompt rows of int16 activations as float32 FMAs on weights widened to float32 (widened.cpp): on AVX2, whose
// integer multiplies run at half the FMA's rate and take two a product with int16's two planes. x: float32.
constexpr bool kWidenPrompts = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2;
void widened_linear(const Tiles& t, int64_t rows);

// Tiles in files of their own (float_tiles.cpp), for MR 1 to 4 rows by NP 2 panels and 1 row by 4.
template <int MR, int NP, int BITS>
void float_tile(const Tiles& t, int64_t r0, int64_t p0);
template <int MR, int NP, typename X>
void bf16_tile(const Tiles& t, int64_t r0, int64_t p0);
// Rows [r_begin, r_end) of panels [p0, p0 + 2) as words (words.cpp), int16 x only: Q2_K, Q3_K and Q6_K, and where
// expands_words, the types with one scale a block.
void word_rows(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0, int64_t pre);
#if APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16
// Rows [r_begin, r_end) of panels [p0, p0 + 2) on the CPU's AMX tiles (amx.cpp; amx_tile.h's types only).
void amx_hardware_rows(const Tiles& t, int64_t r_begin, int64_t r_end, int64_t p0);
#endif

}  // namespace appliance::APPLIANCE_ISA
