// GGUF superblock types converted into blocks of 32 the kernels run (kernels.h) where a tensor-parallel cut
// is off 256, and the Q5 types for dequantize: every weight keeps its exact value; and the K-quant
// superblocks decoded for their packing (quant.cpp). Plain C++ (load time, not per ISA); the block
// formats are GGML's (ggml-common.h), decoded here the way its reference dequantizers read them.
#include <cstring>

#include "kernels.h"
#define APPLIANCE_ISA portable  // for fp16_to_float; nothing here is vectorised by hand
#include "vec.h"

namespace appliance {
namespace {

inline float half(const uint8_t* p) { return fp16_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8))); }
inline void put_f32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }

// Q4_K and Q5_K: the 6-bit scale and min of sub-block j (of 8) from the 12 packed bytes.
void scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes a 256): fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes of nibbles; 32-weight sub-block
// 2c + h is the low (h = 0) or high nibbles of bytes 32c..32c+31; w = d sc q - dmin m.
void q4_k(const uint8_t* b, uint8_t* out) {
  Q4KParts parts;
  q4_k_parts(b, parts);
  const float d = fp16_to_float(parts.d), dmin = fp16_to_float(parts.dmin);
  for (int s = 0; s < 8; ++s, out += 24) {
    put_f32(out, d * static_cast<float>(parts.sc[s]));
    put_f32(out + 4, -(dmin * static_cast<float>(parts.m[s])));
    std::memcpy(out + 8, parts.nibbles[s], 16);
  }
}

// Q5_K (176 bytes a 256): as Q4_K, then 32 bytes of fifth bits (bit s of byte i: weight i of sub-block s)
// before the nibbles.
void q5_k(const uint8_t* b, uint8_t* out) {
  Q5KParts parts;
  q5_k_parts(b, parts);
  const float d = fp16_to_float(parts.d), dmin = fp16_to_float(parts.dmin);
  for (int s = 0; s < 8; ++s, out += 40) {
    put_f32(out, d * static_cast<float>(parts.sc[s]));
    put_f32(out + 4, -(dmin * static_cast<float>(parts.m[s])));
    std::memcpy(out + 8, parts.u + 32 * s, 32);
  }
}

// Q6_K's or Q3_K's parts -> Q8_H32: per block, f32 d sc for each half, then the bytes u moved from the type's
// zero point (`zero`) onto Q8_H32's, 32.
void half_scaled_to_q8_h32(const Q6KParts& parts, int zero, uint8_t* out) {
  const float d = fp16_to_float(parts.d);
  for (int s = 0; s < 8; ++s, out += 40) {
    put_f32(out, d * static_cast<float>(parts.sc[2 * s]));
    put_f32(out + 4, d * static_cast<float>(parts.sc[2 * s + 1]));
    for (int i = 0; i < 32; ++i) out[8 + i] = static_cast<uint8_t>(parts.u[32 * s + i] + 32 - zero);
  }
}

// Q6_K (210 bytes a 256): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16
// weights), fp16 d; w = d sc (q - 32). Within each half of 128: weight l + 32 t (t < 4) is nibble t / 2 of
// ql[l + 32 (t % 2)] with bits 2t..2t+1 of qh[l] above it.
void q6_k(const uint8_t* b, uint8_t* out) {
  Q6KParts parts;
  q6_k_parts(b, parts);
  half_scaled_to_q8_h32(parts, 32, out);
}

// Q3_K (110 bytes a 256) -> Q8_H32 as Q6_K: u = q + 4 becomes q + 32.
void q3_k(const uint8_t* b, uint8_t* out) {
  Q6KParts parts;
  q3_k_parts(b, parts);
  half_scaled_to_q8_h32(parts, 4, out);
}

// Q2_K (84 bytes a 256) -> Q4_HM32: per block, f32 d sc and -dmin m for each half, then Q4_1's nibbles.
void q2_k(const uint8_t* b, uint8_t* out) {
  Q2KParts parts;
  q2_k_parts(b, parts);
  const float d = fp16_to_float(parts.d), dmin = fp16_to_float(parts.dmin);
  for (int s = 0; s < 8; ++s, out += 32) {
    for (int h = 0; h < 2; ++h) {
      put_f32(out + 4 * h, d * static_cast<float>(parts.sc[2 * s + h]));
      put_f32(out + 8 + 4 * h, -(dmin * static_cast<float>(parts.m[2 * s + h])));
    }
    put_nibbles(out + 16, parts.u + 32 * s);
  }
}

// IQ4_XS (136 bytes a 256) -> IQ4_F32: per block, f32 d (code - 32) and the block's 16 bytes of nibbles.
void iq4_xs(const uint8_t* b, uint8_t* out) {
  IQ4XSParts parts;
  iq4_xs_parts(b, parts);
  const float d = fp16_to_float(parts.d);
  for (int s = 0; s < 8; ++s, out += 20) {
    put_f32(out, d * static_cast<float>(parts.sc[s]));
    std::memcpy(out + 4, parts.nibbles[s], 16);
  }
}

// Q5_0 (22 bytes a 32): fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles; w = d (q - 16) -> Q8_0.
// Q5_1 (24 bytes): fp16 d, fp16 m, then as Q5_0; w = d q + m -> Q8_M32.
template <bool kMin>
void q5(const uint8_t* b, uint8_t* out) {
  uint32_t qh;
  std::memcpy(&qh, b + (kMin ? 4 : 2), 4);
  const uint8_t* qs = b + (kMin ? 8 : 6);
  uint8_t u[32];
  for (int i = 0; i < 16; ++i) {
    u[i] = static_cast<uint8_t>((qs[i] & 15) | (((qh >> i) & 1) << 4));
    u[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
  }
  if constexpr (kMin) {
    put_f32(out, half(b));
    put_f32(out + 4, half(b + 2));
    std::memcpy(out + 8, u, 32);
  } else {
    std::memcpy(out, b, 2);  // d stays fp16
    for (int i = 0; i < 32; ++i) out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(u[i] - 16));
  }
}

}  // namespace

void q4_k_parts(const uint8_t* b, Q4KParts& out) {
  out.d = static_cast<uint16_t>(b[0] | (b[1] << 8)), out.dmin = static_cast<uint16_t>(b[2] | (b[3] << 8));
  const uint8_t* qs = b + 16;
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    scale_min(s, b + 4, sc, m);
    out.sc[s] = static_cast<uint8_t>(sc), out.m[s] = static_cast<uint8_t>(m);
    uint8_t u[32];
    for (int i = 0; i < 32; ++i) u[i] = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 15;
    put_nibbles(out.nibbles[s], u);
  }
}

void q5_k_parts(const uint8_t* b, Q5KParts& out) {
  out.d = static_cast<uint16_t>(b[0] | (b[1] << 8)), out.dmin = static_cast<uint16_t>(b[2] | (b[3] << 8));
  const uint8_t *qh = b + 16, *qs = b + 48;
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    scale_min(s, b + 4, sc, m);
    out.sc[s] = static_cast<uint8_t>(sc), out.m[s] = static_cast<uint8_t>(m);
    for (int i = 0; i < 32; ++i)
      out.u[32 * s + i] = static_cast<uint8_t>(((qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 15) | (((qh[i] >> s) & 1) << 4));
  }
}

void q6_k_parts(const uint8_t* b, Q6KParts& out) {
  out.d = static_cast<uint16_t>(b[208] | (b[209] << 8));
  std::memcpy(out.sc, b + 192, 16);
  for (int n = 0; n < 2; ++n) {
    const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
    for (int l = 0; l < 32; ++l)
      for (int t = 0; t < 4; ++t)
        out.u[128 * n + l + 32 * t] = static_cast<uint8_t>(((ql[l + 32 * (t % 2)] >> (4 * (t / 2))) & 15) |
                                                           (((qh[l] >> (2 * t)) & 3) << 4));
  }
}

// Q3_K: 32 bytes of high bits, 64 of low bit pairs, 12 of 6-bit scale codes, fp16 d. Weight 128 n + 32 t + l
// (n < 2, t < 4, l < 32) has bits 2t..2t+1 of qs[32 n + l] as its low bits and bit 4 n + t of hmask[l] as its
// third, q = that - 4; scale code c (one per 16 weights) has its low 4 bits in byte c % 8 (the low nibble
// for c < 8, the high one after) and its top 2 in bits 2 (c / 4)..+1 of byte 8 + c % 4, and scales by c - 32.
void q3_k_parts(const uint8_t* b, Q6KParts& out) {
  const uint8_t *hmask = b, *qs = b + 32, *codes = b + 96;
  out.d = static_cast<uint16_t>(b[108] | (b[109] << 8));
  for (int c = 0; c < 16; ++c) {
    const int code = ((codes[c % 8] >> (4 * (c / 8))) & 15) | (((codes[8 + c % 4] >> (2 * (c / 4))) & 3) << 4);
    out.sc[c] = static_cast<int8_t>(code - 32);
  }
  for (int n = 0; n < 2; ++n)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l)
        out.u[128 * n + 32 * t + l] = static_cast<uint8_t>(((qs[32 * n + l] >> (2 * t)) & 3) | (((hmask[l] >> (4 * n + t)) & 1) << 2));
}

// Q2_K: 16 bytes of codes (scale in the low nibble, min in the high, one per 16 weights), 64 of 2-bit quants,
// fp16 d, fp16 dmin. Weight 128 n + 32 t + l (n < 2, t < 4, l < 32) is bits 2t..2t+1 of qs[32 n + l].
void q2_k_parts(const uint8_t* b, Q2KParts& out) {
  out.d = static_cast<uint16_t>(b[80] | (b[81] << 8)), out.dmin = static_cast<uint16_t>(b[82] | (b[83] << 8));
  for (int c = 0; c < 16; ++c) out.sc[c] = b[c] & 15, out.m[c] = b[c] >> 4;
  const uint8_t* qs = b + 16;
  for (int n = 0; n < 2; ++n)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) out.u[128 * n + 32 * t + l] = static_cast<uint8_t>((qs[32 * n + l] >> (2 * t)) & 3);
}

// IQ4_XS: fp16 d, 2 bytes of high scale bits (bits 2s..2s+1: block s's top two), 4 bytes of low ones (block
// s's low four in byte s / 2, the low nibble for even s), then 16 bytes of nibbles a block (Q4_1's order).
void iq4_xs_parts(const uint8_t* b, IQ4XSParts& out) {
  out.d = static_cast<uint16_t>(b[0] | (b[1] << 8));
  const int high = b[2] | (b[3] << 8);
  for (int s = 0; s < 8; ++s) {
    const int code = ((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4);
    out.sc[s] = static_cast<int8_t>(code - 32);
    std::memcpy(out.nibbles[s], b + 8 + 16 * s, 16);
  }
}

QType converted_type(FileType t) {
  switch (t) {
    case FileType::q5_0: return QType::q8_0;
    case FileType::q4_k: return QType::q4_m32;
    case FileType::q3_k:
    case FileType::q6_k: return QType::q8_h32;
    case FileType::iq4_xs: return QType::iq4_f32;
    case FileType::q2_k: return QType::q4_hm32;
    default: return QType::q8_m32;  // q5_1, q5_k
  }
}

int64_t file_block_weights(FileType t) { return t == FileType::q5_0 || t == FileType::q5_1 ? 32 : 256; }

int64_t file_block_bytes(FileType t) {
  switch (t) {
    case FileType::q5_0: return 22;
    case FileType::q5_1: return 24;
    case FileType::q2_k: return 84;
    case FileType::q3_k: return 110;
    case FileType::iq4_xs: return 136;
    case FileType::q4_k: return 144;
    case FileType::q5_k: return 176;
    default: return 210;  // q6_k
  }
}

void convert_quant(const ConvertArgs& a) {
  const int64_t per = file_block_weights(a.from), in_bytes = file_block_bytes(a.from);
  const int64_t out_bytes = per / kQuantBlock * quant_block_bytes(converted_type(a.from));
  const int64_t blocks = a.in_features / per;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* in = a.gguf + (r * blocks + b) * in_bytes;
      uint8_t* out = a.out + (r * blocks + b) * out_bytes;
      switch (a.from) {
        case FileType::q4_k: q4_k(in, out); break;
        case FileType::q5_k: q5_k(in, out); break;
        case FileType::q6_k: q6_k(in, out); break;
        case FileType::q3_k: q3_k(in, out); break;
        case FileType::iq4_xs: iq4_xs(in, out); break;
        case FileType::q2_k: q2_k(in, out); break;
        case FileType::q5_0: q5<false>(in, out); break;
        case FileType::q5_1: q5<true>(in, out); break;
      }
    }
  }
}

}  // namespace appliance
