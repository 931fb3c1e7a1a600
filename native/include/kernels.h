// The kernel entry points every ISA implements, and the plain argument structs they take.
//
// Tensors arrive as raw pointers with explicit sizes and strides (in elements); module.cpp checks
// them before any kernel runs, so kernels assume valid arguments. Last dimensions are contiguous.
#pragma once

#include <cstdint>

namespace appliance {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };  // f16: KV caches only (module.cpp)

struct NormArgs {  // out[t, :] = x[t, :] / rms(x[t, :]) * weight;  x, out: [T, H] rows at a stride
  DType dtype;
  void* out;
  const void* x;
  const void* weight;  // [H]
  int64_t tokens, hidden, x_stride, out_stride;
  float eps;
};

struct AddNormArgs {  // residual += x; x = rms_norm(residual) * weight  (both in place)
  DType dtype;
  void* x;
  void* residual;
  const void* weight;
  int64_t tokens, hidden, x_stride, residual_stride;
  float eps;
};

struct RopeArgs {  // rotate q [T, Hq, D] and k [T, Hk, D] in place, NeoX layout (halves, not pairs)
  DType dtype;
  void* q;
  void* k;
  const int64_t* positions;  // [T]
  const float* cos_sin;      // [max_position, rot_dim]: cos for rot_dim/2, then sin for rot_dim/2
  int64_t tokens, q_heads, k_heads, head_dim, rot_dim, q_stride, k_stride, max_position;
};

struct SiluMulArgs {  // out[t, :] = silu(x[t, :I]) * x[t, I:]
  DType dtype;
  void* out;
  const void* x;
  int64_t tokens, inter, x_stride, out_stride;
};

struct CacheWriteArgs {  // cache[slot // B, h, slot % B, :] = k[t, h, :] (and v); slot < 0 skips the token
  DType dtype;        // of key and value
  const void* key;  // [T, Hk, D] at row strides
  const void* value;
  void* key_cache;  // [blocks, Hk, B, D]
  void* value_cache;
  const int64_t* slot_mapping;  // [T]
  int64_t tokens, kv_heads, head_dim, block_size, num_blocks, key_stride, value_stride;
  DType cache_dtype;  // may differ from dtype: a bfloat16 or float16 cache for float32 activations (rounded when written)
};

struct AttentionArgs {
  // Each sequence s has q_lens[s] new query tokens (its last ones) out of context_lens[s] tokens
  // whose K/V are all in the paged cache already. Query i of s sits at position
  // context_lens[s] - q_lens[s] + i and attends causally to cache positions 0..that position.
  // Decode is the case q_lens[s] == 1.
  DType dtype;
  void* out;            // [Tq, Hq, D] rows at out_stride
  const void* q;        // [Tq, Hq, D] rows at q_stride
  const void* key_cache;    // [blocks, Hk, B, D]
  const void* value_cache;
  const int32_t* block_tables;  // [S, max_blocks_per_seq]
  const int32_t* context_lens;  // [S]
  const int64_t* q_starts;      // [S + 1] prefix sums of q_lens
  int64_t seqs, q_heads, kv_heads, head_dim, block_size, max_blocks_per_seq, num_blocks, q_stride, out_stride;
  float scale;
  DType cache_dtype;  // of key_cache and value_cache; dtype is q's and out's
};

struct LinearArgs {  // out[s, v] = sum_k x[s, k] * weight[v, k], accumulated and stored in float32
  DType dtype;             // of x and weight
  float* out;              // [S, V] contiguous
  const void* x;           // [S, K] rows at x_stride
  const void* weight;      // [V, K] contiguous
  int64_t rows, in_features, out_features, x_stride;
};

// GGUF block types kept quantized (the values are GGML's type ids). Each of these blocks holds 32 weights
// along a row: Q8_0 = fp16 d + 32 int8 (w = d q); Q4_0 = fp16 d + 16 bytes of nibbles (w = d (q - 8));
// Q4_1 = fp16 d, fp16 m + 16 bytes of nibbles (w = d q + m). Low nibbles are weights 0..15, high 16..31.
// Q5_0 = fp16 d + 4 bytes of fifth bits (weight i's is bit i) + nibbles as Q4_0's (w = d (q - 16)); Q5_1 =
// fp16 d, fp16 m + the same (w = d q + m): packed as Q4_0 and Q4_1 with a plane of fifth bits (below).
// BF16 (GGML's 30) is the dense case: rows of bfloat16 weights, 64 bytes per 32, no scales; packed the
// same way so that the same tiles, threads and layer stack run them (the model packs bfloat16 weights).
//
// The superblock types convert (convert_quant) where a tensor-parallel cut is off their 256 weights (and
// for dequantize, with the Q5 types) into blocks of 32 of our own, exactly: every weight keeps its value,
// because a K-quant's sub-block scale d * sc and min dmin * m (fp16 times a 6-bit integer) are exact in
// float32. Ids past GGML's:
//   Q4_M32 (from Q4_K)       = f32 d, f32 m + 16 bytes of nibbles as Q4_1 (w = d q + m);
//   Q8_M32 (from Q5_K; Q5_1 for dequantize) = f32 d, f32 m + 32 bytes u (w = d u + m);
//   Q8_H32 (from Q6_K, Q3_K, likewise) = f32 d0, f32 d1 + 32 bytes u (w = d0 (u - 32) for weights 0..15, d1
//                              for 16..31: they scale every 16 weights);
//   IQ4_F32 (from IQ4_XS, likewise) = f32 d + 16 bytes of nibbles as IQ4_NL (below);
//   Q4_HM32 (from Q2_K, likewise) = f32 d0, d1, m0, m1 + 16 bytes of nibbles (w = d0 q + m0 for weights
//                              0..15, d1 q + m1 for 16..31: Q2_K scales and offsets every 16 weights).
// For dequantize Q5_0 becomes Q8_0 (w = d (q - 16), q - 16 fits a signed byte). A fused projection whose parts differ in
// type (Q4_K_M files store some layers' V as Q6_K, their Q and K as Q4_K) runs as its parts (decoder.h).
//
// Q2_K to Q6_K (GGML's 10 to 14) are kept as the file stores them, superblocks of 256 weights (Q2_K: 84 bytes,
// 2-bit quants, a 4-bit scale and min code per 16, fp16 d and dmin; Q3_K: 110 bytes, 3-bit quants as 2 low bits and a high-bit mask, a 6-bit scale code per 16, fp16 d;
// Q4_K: 144 bytes, fp16 d and dmin, 6-bit scale and min codes per 32, nibbles; Q5_K: 176, the same with
// a fifth bit per weight; Q6_K: 210 bytes, 6-bit quants, an int8 scale code per 16, fp16 d), and packed
// with their superblock scales (below): 3.1, 3.6, 4.6, 5.6 and 6.6 bits a weight where Q4_HM32, Q8_H32,
// Q4_M32, Q8_M32 and Q8_H32 take 8, 10, 6, 10 and 10. Their rows convert to those (convert_quant) where a cut does not fall
// on 256 (a tensor-parallel shard).
//
// IQ4_NL (GGML's 20: fp16 d + 16 bytes of nibbles, Q4_0's order) and IQ4_XS (23: superblocks of 256, 136 bytes:
// fp16 d, a 6-bit scale code per 32 weights, nibbles) hold 4-bit indices into a codebook of 16 int8 values
// (kIq4Values): w = d kIq4Values[q] (IQ4_XS: d (code - 32) per block). They are kept as stored, packed as
// the 4-bit types with the codebook applied in the tile; IQ4_XS cut off 256 converts to IQ4_F32 (ours:
// f32 d + 16 bytes of nibbles a 32).
enum class QType : int {
  q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, iq4_nl = 20, iq4_xs = 23,
  bf16 = 30, q4_m32 = 100, q8_m32 = 101, q8_h32 = 102, iq4_f32 = 103, q4_hm32 = 104
};
// IQ4_NL's and IQ4_XS's codebook (GGML's), and the same values plus 128: the unsigned bytes the tiles multiply.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr uint8_t kIq4Unsigned[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
constexpr int64_t kQuantBlock = 32;
constexpr int64_t kSuperBlocks = 8;  // blocks of 32 in a K-quant superblock of 256
inline bool superblocks(QType t) {
  return t == QType::q2_k || t == QType::q3_k || t == QType::q4_k || t == QType::q5_k || t == QType::q6_k ||
         t == QType::iq4_xs;
}
inline int64_t quant_block_weights(QType t) { return superblocks(t) ? kSuperBlocks * kQuantBlock : kQuantBlock; }
inline int64_t quant_block_bytes(QType t) {  // a block of quant_block_weights(t) weights
  switch (t) {
    case QType::q2_k: return 84;
    case QType::q3_k: return 110;
    case QType::iq4_xs: return 136;
    case QType::q4_hm32: return 32;
    case QType::iq4_nl: return 18;
    case QType::iq4_f32: return 20;
    case QType::q4_k: return 144;
    case QType::q5_k: return 176;
    case QType::q6_k: return 210;
    case QType::bf16: return 64;
    case QType::q8_0: return 34;
    case QType::q4_1: return 20;
    case QType::q4_0: return 18;
    case QType::q5_0: return 22;
    case QType::q5_1: return 24;
    case QType::q4_m32: return 24;
    default: return 40;  // q8_m32, q8_h32
  }
}
inline int64_t quant_row_bytes(QType t, int64_t k) { return k / quant_block_weights(t) * quant_block_bytes(t); }

// GGUF types convert_quant turns into the blocks above (GGML's ids).
enum class FileType : int { q5_0 = 6, q5_1 = 7, q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, iq4_xs = 23 };
QType converted_type(FileType t);
int64_t file_block_weights(FileType t);  // 32 or 256 (K-quants)
int64_t file_block_bytes(FileType t);

struct ConvertArgs {  // out = rows [R, K / 32 * quant_block_bytes(converted_type(from))] of file rows
  FileType from;
  const uint8_t* gguf;  // [R, K / file_block_weights * file_block_bytes] contiguous
  uint8_t* out;
  int64_t rows, in_features;
};
void convert_quant(const ConvertArgs&);  // plain C++, once at load: not per ISA

// Q4_1's order: byte i of `out` holds u[i] (low nibble) and u[i + 16] (high), from 32 values below 16.
inline void put_nibbles(uint8_t* out, const uint8_t* u) {
  for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(u[i] | (u[i + 16] << 4));
}

struct Q4KParts {  // one Q4_K superblock: w = d sc[s] q - dmin m[s] for the 32 weights of sub-block s
  uint16_t d, dmin;        // fp16 bits
  uint8_t sc[8], m[8];     // 6-bit codes
  uint8_t nibbles[8][16];  // per sub-block, Q4_1's order: byte i holds weight i (low) and i + 16 (high)
};
void q4_k_parts(const uint8_t* block, Q4KParts& out);
struct Q5KParts {  // one Q5_K superblock: as Q4_K, with 5-bit quants
  uint16_t d, dmin;
  uint8_t sc[8], m[8];
  uint8_t u[256];    // in weight order
};
void q5_k_parts(const uint8_t* block, Q5KParts& out);
struct Q6KParts {  // one Q6_K superblock: w = d sc[h] (u - 32) for the 16 weights of half h
  uint16_t d;        // fp16 bits
  int8_t sc[16];
  uint8_t u[256];    // 6-bit quants in weight order
};
void q6_k_parts(const uint8_t* block, Q6KParts& out);
// One Q3_K superblock in the same parts: w = d sc[h] (u - 4), sc the 6-bit code less 32, u = q + 4 in 0..7.
void q3_k_parts(const uint8_t* block, Q6KParts& out);
struct Q2KParts {  // one Q2_K superblock: w = d sc[h] u - dmin m[h] for the 16 weights of half h, u in 0..3
  uint16_t d, dmin;  // fp16 bits
  uint8_t sc[16], m[16];
  uint8_t u[256];    // in weight order
};
void q2_k_parts(const uint8_t* block, Q2KParts& out);
struct IQ4XSParts {  // one IQ4_XS superblock: w = d sc[s] kIq4Values[q] for the 32 weights of block s
  uint16_t d;              // fp16 bits
  int8_t sc[8];            // the 6-bit codes less 32
  uint8_t nibbles[8][16];  // per block, Q4_1's order (as the file's)
};
void iq4_xs_parts(const uint8_t* block, IQ4XSParts& out);

// Kept-quantized weights as the linears run them, repacked once at load (pack_quant) from GGUF rows: rows
// in panels of 16 (one int32 lane a row, see I32x16 in vec.h), the panel count padded to a multiple of
// 4 with zero rows. Per panel, per block of 32 weights along the rows, in this order:
//   quants  4-bit types: 4 vectors of 64 bytes; in vector t, bytes 4j..4j+3 (row j) hold weights
//           4t..4t+3 in their low nibbles and 16+4t..19+4t in their high ones (a GGUF Q4 block's own byte
//           order, the 16 rows interleaved 4 bytes at a time, as vpdpbusd wants them).
//           8-bit types: 8 vectors of 64 bytes; in vector g, bytes 4j..4j+3 hold weights 4g..4g+3, as
//           unsigned u (Q8_0: u = q + 128).
//           4-bit types with high bits (Q5_0, Q5_1, Q5_K: one plane, Q6_K: two): after the 4 vectors, per plane p
//           (bit 4 + p of every u), per vector g, 8 bytes for its low nibbles, then 8 for its high ones:
//           bit n of those 8 bytes belongs to byte n of the vector (the mask AVX-512 adds 16 << p under).
//   scales  16 d, then (types with a min) 16 m or (Q8_H32) 16 d1:
//           fp16 for GGML's types, f32 for ours (in a row's block, the same scalars in the same order).
// Every weight is w = d (u - zero) + m: zero = 8 for Q4_0, 16 for Q5_0, 128 for Q8_0 and the IQ4 types (u their codebook
// value plus 128), 32 for Q8_H32 and Q6_K, 4 for Q3_K, else 0 (m is stored, or 0).
//   BF16: 16 vectors of 64 bytes and no scales; in vector g, bytes 4j..4j+3 hold row j's weights 2g and
//           2g+1 (the pair AVX512-BF16's vdpbf16ps multiplies with a broadcast pair of x).
//   Q4_K: superblocks of 8 blocks: first a head of 16 fp16 d, 16 fp16 -dmin, then per block 16 scale
//           codes sc and 16 min codes m (a byte each): 320 bytes; then the 8 blocks' 4-bit quants as above
//           (every vector on a cache line of its own: split loads cost the tile a third). Block s of a
//           superblock scales by d sc[s] and offsets by -dmin m[s]: products the tile forms in float32,
//           exactly (fp16 times a 6-bit integer), so every weight is the file's.
//   Q5_K: as Q4_K, with its fifth bits in a plane after each block's nibbles (320 bytes a block).
//   Q6_K: the same with a head of 16 f32 d and per block 16 int8 codes for each half (sc0, sc1), then
//           the 8 blocks' nibbles and two planes (384 bytes): w = d sc_h (u - 32), exact in float32
//           likewise. A block's low nibbles are its first half (weights 0..15), the high ones its second.
//   2-bit types (Q2_K; Q3_K with one plane): 2 vectors of 64 bytes, one a half of the block; in vector h,
//           bits 2t..2t+1 of bytes 4j..4j+3 (row j) hold weights 16h+4t..16h+4t+3 (vector t of half h,
//           as a 4-bit block's low or high nibbles are). Then any plane of high bits as above (bit 2 + p).
//   Q3_K: Q6_K's head, and the 8 blocks' 3-bit quants u = q + 4 as a 2-bit type with one plane, halves as
//           Q6_K's.
//   Q2_K: Q4_K's head of fp16 d and -dmin, then per block the codes of each half's scale and min (sc0, sc1,
//           m0, m1: 4 x 16 bytes), then the blocks' 2-bit quants: w = d sc_h u - dmin m_h.
//   IQ4_XS: a head of 16 f32 d and per block 16 int8 codes (sc: one a row), then the blocks' nibbles; the
//           tile maps each nibble through kIq4Unsigned (lut), so that u - 128 is the codebook's value.
//   IQ4_NL, IQ4_F32: Q4_0's layout (fp16 d; IQ4_F32: f32 d) with the codebook likewise.
constexpr int64_t kPanelRows = 16;
constexpr int64_t kPanelGroup = 4;

struct PackedLayout {
  int bits;              // 2, 4, 8 or 16 (bfloat16): the low bits a weight, as crumbs, nibbles or bytes
  int zero;              // subtracted from every u
  bool has_min;          // 16 m follow the 16 d (with halves: 16 m0, 16 m1 follow d0 and d1)
  bool halves;           // 16 d1 follow the 16 d: d scales weights 0..15 of a block, d1 16..31
  int scale_bytes;       // 2 (fp16), 4 (f32), or 1 (a code per block, times its superblock's scalars)
  int64_t quant_bytes;   // per panel and block
  int64_t block_bytes;   // quants and scales, per panel and block
  int64_t super_head = 0;  // bytes of superblock scalars before every kSuperBlocks blocks (K-quants, IQ4_XS), or none
  bool lut = false;        // 4-bit indices into the IQ4 codebook (kIq4Unsigned), not values
  int high_bits = 0;       // planes of a further bit each after the crumbs or nibbles (Q3_K, Q5_*: 1; Q6_K: 2)
  int64_t mean_block_bytes() const { return block_bytes + super_head / kSuperBlocks; }
};

inline PackedLayout packed_layout(QType t) {
  switch (t) {
    case QType::bf16: return {16, 0, false, false, 0, 1024, 1024};
    case QType::q8_0: return {8, 128, false, false, 2, 512, 512 + 32};
    case QType::q4_0: return {4, 8, false, false, 2, 256, 256 + 32};
    case QType::q4_1: return {4, 0, true, false, 2, 256, 256 + 64};
    case QType::q5_0: return {4, 16, false, false, 2, 320, 320 + 32, 0, false, 1};
    case QType::q5_1: return {4, 0, true, false, 2, 320, 320 + 64, 0, false, 1};
    case QType::q4_m32: return {4, 0, true, false, 4, 256, 256 + 128};
    case QType::q4_k: return {4, 0, true, false, 1, 256, 256, 64 + 32 * kSuperBlocks};
    case QType::q5_k: return {4, 0, true, false, 1, 320, 320, 64 + 32 * kSuperBlocks, false, 1};
    case QType::q6_k: return {4, 32, false, true, 1, 384, 384, 64 + 32 * kSuperBlocks, false, 2};
    case QType::q3_k: return {2, 4, false, true, 1, 192, 192, 64 + 32 * kSuperBlocks, false, 1};
    case QType::q2_k: return {2, 0, true, true, 1, 128, 128, 64 + 64 * kSuperBlocks};
    case QType::q4_hm32: return {4, 0, true, true, 4, 256, 256 + 256};
    case QType::iq4_xs: return {4, 128, false, false, 1, 256, 256, 64 + 16 * kSuperBlocks, true};
    case QType::iq4_nl: return {4, 128, false, false, 2, 256, 256 + 32, 0, true};
    case QType::iq4_f32: return {4, 128, false, false, 4, 256, 256 + 64, 0, true};
    case QType::q8_m32: return {8, 0, true, false, 4, 512, 512 + 128};
    default: return {8, 32, false, true, 4, 512, 512 + 128};  // q8_h32
  }
}
// A block's scalars: d; d and m (or d1 with halves); d0, d1, m0, m1 (halves with a min: Q2_K's, Q4_HM32)
inline int scalar_count(const PackedLayout& L) { return L.halves && L.has_min ? 4 : 1 + (L.has_min || L.halves); }
// Where a block's bit planes start (after its nibbles, or with LOW 2 its crumbs), and the 8 bytes of plane p that
// vector g of half h takes its bits from (bit n of the 8 bytes: byte n of the vector).
constexpr int64_t kNibbleBytes = 4 * 64, kCrumbBytes = 2 * 64;
constexpr int64_t high_bits_offset(int p, int g, int h, int low = 4) {
  return (low == 2 ? kCrumbBytes : kNibbleBytes) + 64 * p + 16 * g + 8 * h;
}
inline int64_t packed_panels(int64_t rows) {
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
  return (panels + kPanelGroup - 1) / kPanelGroup * kPanelGroup;
}
inline int64_t packed_panel_bytes(const PackedLayout& L, int64_t blocks) {
  return blocks * L.block_bytes + blocks / kSuperBlocks * L.super_head;
}
inline int64_t packed_bytes(QType t, int64_t rows, int64_t k) {
  return packed_panels(rows) * packed_panel_bytes(packed_layout(t), k / kQuantBlock);
}

// How activations meet kept-quantized weights: exact float32 FMAs on the dequantized weights (none), or
// quantized per block of 32 to one int8 plane (int8, as llama.cpp does) or to two (int16: x = s (h + l/256),
// about 16 bits) and multiplied with int8 dot products, then scaled in float32.
enum class ActQuant : int { none = 0, int8 = 1, int16 = 2 };

struct PackArgs {  // out = the packed layout above of rows [R, K / block weights GGUF blocks]
  QType qtype;
  const uint8_t* gguf;  // [R, quant_row_bytes(qtype, K)] contiguous
  uint8_t* out;         // packed_bytes(qtype, R, K)
  int64_t rows, in_features;
};

struct PackedLinearArgs {  // out[s, v] = sum_k x[s, k] * w[v, k], accumulated in float32
  QType qtype;
  ActQuant act;
  DType x_dtype, out_dtype;
  void* out;              // [S, V] rows at out_stride
  const void* x;          // [S, K] rows at x_stride
  const uint8_t* weight;  // packed [V, K]
  int64_t rows, in_features, out_features, x_stride, out_stride;
  bool prompt = false;    // the rows are prompt tokens: int16 takes widened float32 weights for them where that
                          // is faster for the type (widens_prompts(qtype): AVX2), else the tiles of any row
};

struct PackedRowsArgs {  // out[i, :] = w[ids[i], :] dequantized (an embedding lookup, or the whole weight)
  QType qtype;
  DType out_dtype;
  void* out;              // [count, K] rows at out_stride
  const uint8_t* weight;  // packed [V, K]
  const int64_t* ids;     // [count], each in [0, V)
  int64_t count, in_features, out_stride;
};

struct DequantArgs {  // out[r, :] = dequant(weight[r, :])
  QType qtype;
  DType out_dtype;
  void* out;              // [R, K] rows at out_stride
  const uint8_t* weight;  // [R, K / 32 blocks] contiguous
  int64_t rows, in_features, out_stride;
};

#define APPLIANCE_DECLARE_KERNELS(isa)           \
  namespace isa {                                \
  void rms_norm(const NormArgs&);                \
  void add_rms_norm(const AddNormArgs&);         \
  void rotary_embedding(const RopeArgs&);        \
  void silu_and_mul(const SiluMulArgs&);         \
  void write_kv_cache(const CacheWriteArgs&);    \
  void paged_attention(const AttentionArgs&);    \
  void linear_f32_out(const LinearArgs&);        \
  void pack_quant(const PackArgs&);              \
  void packed_linear(const PackedLinearArgs&);   \
  void packed_linears(const PackedLinearArgs*, int64_t); \
  void packed_rows(const PackedRowsArgs&);       \
  void dequantize(const DequantArgs&);           \
  bool widens_prompts(QType);                    \
  double bf16_dot_issue_ratio();                 \
  double int_mul_issue_ratio();                  \
  }

APPLIANCE_DECLARE_KERNELS(avx512bf16)
APPLIANCE_DECLARE_KERNELS(avx512)
APPLIANCE_DECLARE_KERNELS(avx2)
APPLIANCE_DECLARE_KERNELS(neon)
APPLIANCE_DECLARE_KERNELS(portable)
namespace avx512bf16 {
const char* amx_check();  // amx.cpp (x86-64): null where this process may use AMX-INT8 tile multiplies, else why not
const char* amx_emulated_self_check();  // quant.cpp: amx_check's comparisons, emulated on both sides (tests)
}
namespace avx512 {
const char* amx_emulated_self_check();
}
namespace avx2 {
const char* amx_emulated_self_check();
}

// The implementation in use; dispatch.cpp picks it from the CPU at load time.
struct KernelTable {
  const char* isa;
  void (*rms_norm)(const NormArgs&);
  void (*add_rms_norm)(const AddNormArgs&);
  void (*rotary_embedding)(const RopeArgs&);
  void (*silu_and_mul)(const SiluMulArgs&);
  void (*write_kv_cache)(const CacheWriteArgs&);
  void (*paged_attention)(const AttentionArgs&);
  void (*linear_f32_out)(const LinearArgs&);
  void (*pack_quant)(const PackArgs&);
  void (*packed_linear)(const PackedLinearArgs&);
  void (*packed_linears)(const PackedLinearArgs*, int64_t);  // n independent calls, one region where they are one row each
  void (*packed_rows)(const PackedRowsArgs&);
  void (*dequantize)(const DequantArgs&);
  bool (*widens_prompts)(QType);  // whether int16 prompt rows of a type run as float32 FMAs on widened weights
                                  // (widened.cpp; not the types that expand to words, packed.h expands_words)
  bool amx_tiles;  // whether this tier's int16 row chunks may take the CPU's AMX tiles (avx512bf16: amx.cpp's flags)
};

const KernelTable& kernels();
const char* best_isa();                 // the best ISA this CPU and this build support
const char* const* compiled_isas();     // null-terminated list of the ISAs compiled in
bool select_isa(const char* name);      // false if unknown, not compiled in, or unsupported here

// Whether the avx512bf16 kernels multiply bfloat16 pairs with vdpbf16ps (attention against a bfloat16 cache,
// BF16 weights times bfloat16 x) or widen them to float32 for FMAs, as the avx512 kernels do. vdpbf16ps
// makes 32 products an instruction, an FMA 16; but some CPUs issue it at a quarter of the FMA's rate (an
// Intel Xeon, family 6 model 207: 1.35 G/s a core against 5.46), and there the FMAs are faster (prefill
// attention 1.4x) and keep q and p unrounded. `auto` (the default) measures both instructions' issue
// rates once per process (bf16_dot_issue_ratio, ~0.5 ms) and uses vdpbf16ps from half the FMA's rate up.
enum class Bf16Dot : int { automatic = 0, on = 1, off = 2 };
void set_bf16_dot(Bf16Dot mode);
Bf16Dot bf16_dot_mode();
bool bf16_dot();             // the choice in force (measured on first use under `automatic`)
double bf16_dot_ratio();     // vdpbf16ps' issue rate over vfmadd231ps' (measured; 0 without AVX512-BF16)

// How many rows the AVX2 kernels' integer row tiles take under int16 x (quant.cpp, row_tiles): one row (narrow)
// where the CPU's integer multiplier is what limits them, as on AMD Zen 1, whose vector unit is 128 bits wide
// and multiplies a ymm register in two halves through its one multiply pipe; several (wide) where the
// multiplies are cheap and the instructions around them are what counts, as on AMD Zen 3. `auto` (the default)
// measures vpmaddubsw's issue rate over vfmadd231ps' once per process (int_mul_issue_ratio, ~0.5 ms; Zen 1
// ~0.5, Zen 3 ~1.1) and takes wide tiles from 0.75 up. Either way a row gets the same bits (exact integer sums,
// the same float32 steps per row). Only the avx2 kernels have narrow tiles.
enum class IntTiles : int { automatic = 0, narrow = 1, wide = 2 };
void set_int_tiles(IntTiles mode);
IntTiles int_tiles_mode();
bool wide_int_tiles();       // the choice in force (measured on first use under `automatic`)
double int_mul_ratio();      // vpmaddubsw's ymm issue rate over vfmadd231ps' (measured; 0 without AVX2 kernels)

// Whether int16 row chunks of 16 rows and more of the types with one scale a block (amx_tile.h, amx_type) run on
// AMX-INT8's tile multiplies (amx_tile.h: 16 rows x 16 weight rows x 32 products an instruction, the same integer sums and float32
// steps as the vector tiles, so the same bits). `auto` (the default) uses them in the avx512bf16 kernels where
// amx_check passes (checked once per process, on first use); `emulated` runs the same tiles through multiplies in
// software, in the avx2, avx512 and avx512bf16 kernels, so that tests check the tile algorithm without AMX.
enum class AmxTiles : int { automatic = 0, off = 1, emulated = 2 };
void set_amx_tiles(AmxTiles mode);
AmxTiles amx_tiles_mode();
enum class AmxRows : int { none = 0, hardware = 1, emulated = 2 };
AmxRows amx_in_force();      // what int16 row chunks take now
const char* amx_status();    // the same, and under `auto` why not, for logs
void count_amx_row_chunk();  // (quant.cpp, each row chunk of a panel pair the emulated AMX rows take)
int64_t amx_row_chunks();    // how many so far in this process (tests: that the AMX rows ran)

}  // namespace appliance
