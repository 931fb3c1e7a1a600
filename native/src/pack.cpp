// pack_quant: GGUF rows repacked once, at load, into the layout the linears of quant.cpp run on (kernels.h):
// rows in panels of 16, each block's quants as nibbles, crumbs (and planes of high bits) or bytes in the int32
// lanes vpdpbusd multiplies, then the scales; the superblock types with a head of their 16 rows' scalars and
// scale codes a superblock.
#include <cstring>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
namespace {
// K-quant rows in their superblocks: per panel and superblock, the head (the 16 rows' superblock scalars,
// then each block's codes, 2 x 16 bytes, IQ4_XS's 16, Q2_K's 4 x 16), then the 8 blocks' quants. `row(src, j, head, codes, blocks)`
// writes row j's share of one superblock from the file's `src`.
template <typename Row>
void pack_superblocks(const PackArgs& a, Row row) {
  const PackedLayout L = packed_layout(a.qtype);
  const int64_t supers = a.in_features / (kSuperBlocks * kQuantBlock), row_bytes = quant_row_bytes(a.qtype, a.in_features);
  const int64_t super_bytes = L.super_head + kSuperBlocks * L.block_bytes, panels = packed_panels(a.rows);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t s = 0; s < supers; ++s) {
      uint8_t* head = a.out + (p * supers + s) * super_bytes;
      std::memset(head, 0, super_bytes);  // rows past the end: zero scales
      for (int64_t j = 0; j < kPanelRows && p * kPanelRows + j < a.rows; ++j)
        row(a.gguf + (p * kPanelRows + j) * row_bytes + s * quant_block_bytes(a.qtype), j, head, head + 4 * kPanelRows,
            head + L.super_head);
    }
}

// Row j's nibbles of block i (16 bytes in Q4_1's order), 4 bytes in each of the block's 4 vectors; the
// blocks are kNibbleBytes apart, or with `planes` planes of high bits after each block's nibbles, more.
void put_quants(uint8_t* blocks, int i, int64_t j, const uint8_t* nibbles, int planes = 0) {
  for (int g = 0; g < 4; ++g) std::memcpy(blocks + (kNibbleBytes + 64 * planes) * i + 64 * g + 4 * j, nibbles + 4 * g, 4);
}
// Row j's weight w of a block: its bit low + p set in plane p (kernels.h; the plane starts zeroed).
void put_high_bit(uint8_t* block, int p, int64_t j, int w, int low = 4) {
  const int64_t n = 4 * j + w % 4;  // weight w's byte in vector w % 16 / 4 of half w / 16
  block[high_bits_offset(p, w % 16 / 4, w / 16, low) + n / 8] |= static_cast<uint8_t>(1 << (n % 8));
}
// The same from 32 values u in weight order, below 1 << (low + planes): their `low` low bits as nibbles (Q5_K's
// and Q6_K's) or crumbs (low 2: Q2_K's, Q3_K's), bit low + p into plane p. The blocks start zeroed.
void put_bit_quants(uint8_t* blocks, int i, int64_t j, const uint8_t* u, int low, int planes) {
  uint8_t* block = blocks + ((low == 2 ? kCrumbBytes : kNibbleBytes) + 64 * planes) * i;
  if (low == 4) {
    uint8_t bits[kQuantBlock], nibbles[16];
    for (int w = 0; w < kQuantBlock; ++w) bits[w] = u[w] & 15;
    put_nibbles(nibbles, bits);
    put_quants(blocks, i, j, nibbles, planes);
  } else {
    for (int w = 0; w < kQuantBlock; ++w) block[64 * (w / 16) + 4 * j + w % 4] |= static_cast<uint8_t>((u[w] & 3) << (2 * (w % 16 / 4)));
  }
  for (int p = 0; p < planes; ++p)
    for (int w = 0; w < kQuantBlock; ++w)
      if (u[w] >> (low + p) & 1) put_high_bit(block, p, j, w, low);
}

// Row j's fp16 d and -dmin (the sign bit flipped) in a superblock's head (Q2_K, Q4_K, Q5_K).
template <typename Parts>
void put_d_and_dmin(const Parts& parts, int64_t j, uint8_t* head) {
  const uint16_t scalars[2] = {parts.d, static_cast<uint16_t>(parts.dmin ^ 0x8000u)};
  for (int c = 0; c < 2; ++c) std::memcpy(head + 2 * (c * kPanelRows + j), &scalars[c], 2);
}

// Q4_K's and Q5_K's head: d and -dmin, a byte each for block i's scale and min code.
template <typename Parts>
void put_head_with_mins(const Parts& parts, int64_t j, uint8_t* head, uint8_t* codes) {
  put_d_and_dmin(parts, j, head);
  for (int i = 0; i < kSuperBlocks; ++i) codes[32 * i + j] = parts.sc[i], codes[32 * i + kPanelRows + j] = parts.m[i];
}

void pack_q4_k_row(const uint8_t* src, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks) {
  Q4KParts parts;
  q4_k_parts(src, parts);
  put_head_with_mins(parts, j, head, codes);
  for (int i = 0; i < kSuperBlocks; ++i) put_quants(blocks, i, j, parts.nibbles[i]);
}

void pack_q5_k_row(const uint8_t* src, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks) {
  Q5KParts parts;
  q5_k_parts(src, parts);
  put_head_with_mins(parts, j, head, codes);
  for (int i = 0; i < kSuperBlocks; ++i) put_bit_quants(blocks, i, j, parts.u + 32 * i, 4, 1);
}

// Q6_K and Q3_K: f32 d, a signed byte for each half's scale code; nibbles and 2 planes of high bits (Q6_K)
// or crumbs and one (Q3_K).
void put_half_scaled(const Q6KParts& parts, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks, int low, int planes) {
  const float d = fp16_to_float(parts.d);
  std::memcpy(head + 4 * j, &d, 4);
  for (int i = 0; i < kSuperBlocks; ++i) {
    put_bit_quants(blocks, i, j, parts.u + 32 * i, low, planes);
    codes[32 * i + j] = static_cast<uint8_t>(parts.sc[2 * i]), codes[32 * i + kPanelRows + j] = static_cast<uint8_t>(parts.sc[2 * i + 1]);
  }
}

void pack_q6_k_row(const uint8_t* src, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks) {
  Q6KParts parts;
  q6_k_parts(src, parts);
  put_half_scaled(parts, j, head, codes, blocks, 4, 2);
}

void pack_q3_k_row(const uint8_t* src, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks) {
  Q6KParts parts;
  q3_k_parts(src, parts);
  put_half_scaled(parts, j, head, codes, blocks, 2, 1);
}

// Q2_K: Q4_K's head (fp16 d and -dmin), a byte code a row for each half's scale and min, u as crumbs.
void pack_q2_k_row(const uint8_t* src, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks) {
  Q2KParts parts;
  q2_k_parts(src, parts);
  put_d_and_dmin(parts, j, head);
  for (int i = 0; i < kSuperBlocks; ++i) {
    put_bit_quants(blocks, i, j, parts.u + 32 * i, 2, 0);
    for (int h = 0; h < 2; ++h)
      codes[64 * i + kPanelRows * h + j] = parts.sc[2 * i + h], codes[64 * i + kPanelRows * (2 + h) + j] = parts.m[2 * i + h];
  }
}

// IQ4_XS: f32 d, a signed byte a block for its code (16 a block: one a row), the file's nibbles.
void pack_iq4_xs_row(const uint8_t* src, int64_t j, uint8_t* head, uint8_t* codes, uint8_t* blocks) {
  IQ4XSParts parts;
  iq4_xs_parts(src, parts);
  const float d = fp16_to_float(parts.d);
  std::memcpy(head + 4 * j, &d, 4);
  for (int i = 0; i < kSuperBlocks; ++i) {
    put_quants(blocks, i, j, parts.nibbles[i]);
    codes[kPanelRows * i + j] = static_cast<uint8_t>(parts.sc[i]);
  }
}


}  // namespace

void pack_quant(const PackArgs& a) {
  if (a.qtype == QType::q4_k) return pack_superblocks(a, pack_q4_k_row);
  if (a.qtype == QType::q5_k) return pack_superblocks(a, pack_q5_k_row);
  if (a.qtype == QType::q6_k) return pack_superblocks(a, pack_q6_k_row);
  if (a.qtype == QType::q3_k) return pack_superblocks(a, pack_q3_k_row);
  if (a.qtype == QType::iq4_xs) return pack_superblocks(a, pack_iq4_xs_row);
  if (a.qtype == QType::q2_k) return pack_superblocks(a, pack_q2_k_row);
  const PackedLayout L = packed_layout(a.qtype);
  const int64_t blocks = a.in_features / kQuantBlock, gguf_block = quant_block_bytes(a.qtype), row_bytes = blocks * gguf_block;
  const int64_t panels = packed_panels(a.rows), panel_bytes = blocks * L.block_bytes;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* dst = a.out + p * panel_bytes + b * L.block_bytes;
      std::memset(dst, 0, L.block_bytes);  // rows past the end: d = m = 0
      for (int64_t j = 0; j < kPanelRows && p * kPanelRows + j < a.rows; ++j) {
        const uint8_t* src = a.gguf + (p * kPanelRows + j) * row_bytes + b * gguf_block;
        if (L.bits == 16) {  // pairs of weights (4 bytes) to vector g, lane j
          for (int g = 0; g < kQuantBlock / 2; ++g) std::memcpy(dst + 64 * g + 4 * j, src + 4 * g, 4);
          continue;
        }
        const int sb = L.scale_bytes, scalars = scalar_count(L);
        for (int c = 0; c < scalars; ++c) std::memcpy(dst + L.quant_bytes + sb * (c * kPanelRows + j), src + c * sb, sb);
        const uint8_t* qs = src + scalars * sb;
        if (L.bits == 4) {
          if (L.high_bits) {  // Q5_0, Q5_1: 4 bytes of fifth bits before the nibbles, weight w's at bit w
            for (int w = 0; w < kQuantBlock; ++w)
              if (qs[w / 8] >> (w % 8) & 1) put_high_bit(dst, 0, j, w);
            qs += 4;
          }
          for (int g = 0; g < 4; ++g) std::memcpy(dst + 64 * g + 4 * j, qs + 4 * g, 4);
        } else if (a.qtype == QType::q8_0) {
          for (int g = 0; g < 8; ++g)
            for (int i = 0; i < 4; ++i) dst[64 * g + 4 * j + i] = qs[4 * g + i] ^ 0x80;  // q + 128
        } else {
          for (int g = 0; g < 8; ++g) std::memcpy(dst + 64 * g + 4 * j, qs + 4 * g, 4);  // u as stored
        }
      }
    }
  }
}

}  // namespace appliance::APPLIANCE_ISA
