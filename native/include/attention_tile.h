// Attention's inner loops over one key tile, for attention.cpp only (which describes the cache layouts,
// the work items and their key tiles): where a vector of keys lives, the next tile's prefetch, and the
// scores, online softmax and P.V of a few rows at once in register blocks of rows x vectors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
// Unnamed, as when this was part of attention.cpp: with external linkage GCC inlined these loops differently
// (softmax_row into every item loop, some register blocks out of line); so, attention.o is instruction for
// instruction what it was before the split, on every ISA.
namespace {

constexpr int N = VecF::N;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Register blocking of both products: kRows rows x kCols vectors of accumulators. The portable VecF is
// an array the compiler vectorises one operation at a time; 4 x 2 of them spill (2.5x slower there),
// so it takes one row and one vector at a time; so do NEON's 16-lane vectors (plain arrays too).
constexpr bool kPortable = APPLIANCE_ISA_ID == APPLIANCE_ISA_portable;
constexpr bool kAvx512 = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512;
constexpr int kRows = kPortable ? 1 : 4, kCols = kPortable ? 1 : 2;
constexpr int kPairRows = kAvx512 ? 4 : APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2 ? 3 : 1, kPairCols = kAvx512 ? 2 : 1;

template <typename C> constexpr int64_t kVectorKeys = std::is_same_v<C, bf16> ? 16 : N;  // keys in a vector

struct Item {
  int64_t seq, kv_head, heads, tile_start, tile_len;  // KV heads [kv_head, kv_head + heads)
  int64_t key_begin, key_end;  // the keys this item covers (the whole causal range unless split)
  int64_t partial;             // -1: writes the output; else its slot in the split-KV partials
};

// Where a vector of keys lives. float32: feature d of key i at keys[d * stride + i]; bfloat16: the pair
// of features 2p, 2p + 1 of key i at keys[2 (p * stride + i)] and the element after it.
template <typename C>
struct KeyVector {
  const C* keys;
  int64_t stride;
};

// The next key tile's K and V blocks, asked for a cache line or two at a time from inside the inner
// products' loops. A sequence's blocks lie anywhere in the pool, so the hardware prefetchers cannot see
// the next one coming, and a decode step streams the whole cache. All of a tile's lines asked for at
// once (16 KiB) stalled the core on its full miss queues, with little left to overlap; two lines an
// inner iteration spread the next tile's over this one's work. Decode attention out of DRAM, 30 layers
// x 300 keys, alternated on Zen 5 (one burst a tile of this tile's values and the next one's keys ->
// these drips of the next tile's K and V): 32 sequences 10.2 -> 8.1 ms, 8 sequences 2.6 -> 2.0 ms;
// cache-resident unchanged. Asking for the line after a division per line instead of a running pointer
// cost a third of the cache-resident speed.
// The AVX2 kernels ask for one line a step: on a 2-vCPU Zen 3 guest (~16 GB/s to two threads) two lines a step
// came too fast for its miss queues. Alternated there, bfloat16 cache, 30 layers (lines a step 1, 2 = 1.00, 4,
// one every other step, none): decode 32 x 512 keys 0.71-0.78, 1, 1.23, 1.22, 1.74; 8 x 300 0.83-0.85, 1, 1.16,
// 1.15, 1.65; prefill 256 at 256 0.85, 2,048 at 4,096 0.86; the default model's decode steps at 300 keys, batch
// 8 / 32, 0.94 / 0.89; against a float32 cache two lines took 1.24-1.35x one's. The AVX-512 kernels keep two,
// measured on Zen 5 above and not re-measured.
struct Prefetcher {
  static constexpr int kLinesAStep = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2 ? 1 : 2;
  std::vector<const char*> blocks;  // the next tile's K blocks, then its V blocks (an item's KV heads of each)
  size_t taken = 0;                 // blocks whose lines are being or have been asked for
  const char* line = nullptr;       // the next line to ask for, in the block being asked for
  const char* end = nullptr;        // ...and that block's end
  int64_t bytes = 0;                // of a block's run of those heads
  const Item* item = nullptr;       // whose keys the last plan was for

  // Keys k0 .. k0 + nk of `it` (none when nk <= 0: k0 starts a block).
  template <typename C>
  void plan(const AttentionArgs& a, const Item& it, int64_t k0, int64_t nk) {
    const int64_t B = a.block_size;
    const int32_t* table = a.block_tables + it.seq * a.max_blocks_per_seq;
    rest();  // what is left of the previous plan
    const int64_t head_bytes = B * a.head_dim * static_cast<int64_t>(sizeof(C));
    blocks.clear(), taken = 0, line = end = nullptr, bytes = it.heads * head_bytes;  // its heads side by side
    item = &it;
    for (const void* cache : {a.key_cache, a.value_cache})
      for (int64_t p = k0 - k0 % B; p < k0 + nk; p += B)
        blocks.push_back(static_cast<const char*>(cache) + (table[p / B] * a.kv_heads + it.kv_head) * head_bytes);
  }
  // The empty volatile asm is a safeguard: to GCC a prefetch has no side effect, and a function made
  // only of prefetches was found pure and its calls deleted as dead code (test_codegen.py counts them).
  void some(int n = kLinesAStep) {
    for (int i = 0; i < n; ++i, line += 64) {
      if (line >= end) {
        if (taken == blocks.size()) break;
        line = blocks[taken++], end = line + bytes;
      }
      __builtin_prefetch(line, 0, 2);
    }
    asm volatile("");
  }
  void rest() { some(1 << 30); }
};

// f(R, r) over the rows in blocks of kR, then the one block of fewer left (R a compile-time constant)
template <int kR, typename F>
void for_row_blocks(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + kR <= rows; r += kR) f(std::integral_constant<int, kR>{}, r);
  switch (rows - r) {
    case 3: if constexpr (kR > 3) f(std::integral_constant<int, 3>{}, r); break;
    case 2: if constexpr (kR > 2) f(std::integral_constant<int, 2>{}, r); break;
    case 1: if constexpr (kR > 1) f(std::integral_constant<int, 1>{}, r); break;
  }
}

// Whether step i of a float32-layout loop asks for the drip's lines: the drip's lines a step match what a step of a
// float32 cache reads (kCols vectors of N floats); a float16 step reads half of that, so it asks every other step.
// Asked every step, the lines came twice as fast as they were read (as two lines a step against one had cost a
// float32 cache on Zen 3): decode attention, paired against a bfloat16 cache there, 8 / 32 x 512 keys and 8 x 2,048
// 1.41 / 1.58 / 1.62x its time, every other step 1.14 / 1.17 / 1.15x.
template <typename C>
inline bool drips_at(int64_t i) {
  return sizeof(C) >= 4 || i % 2 == 1;
}

// s[r, c N .. (c + 1) N) = q[r, :] . keys of vector c, for R rows and C vectors (float32 cache; float16: each
// vector widened as it is loaded)
template <int R, int C, typename K, std::enable_if_t<!std::is_same_v<K, bf16>, int> = 0>
void score_block(const float* q, int64_t D, const KeyVector<K>* v, float* s, int64_t np, Prefetcher& pf) {
  VecF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = VecF::zero();
  for (int64_t d = 0; d < D; ++d) {
    if (drips_at<K>(d)) pf.some();
    VecF k[C];
    for (int c = 0; c < C; ++c) k[c] = VecF::load(v[c].keys + d * v[c].stride);
    for (int r = 0; r < R; ++r) {
      const VecF qd = VecF::set1(q[r * D + d]);
      for (int c = 0; c < C; ++c) acc[r][c] = VecF::fmadd(qd, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c].store(s + r * np + c * N);
}

// the same for a bfloat16 cache: 16 keys a vector, features two at a time; q: [R, D] as bfloat16 (for
// vdpbf16ps) or float32
template <int R, int C, typename X>
void score_block(const X* q, int64_t D, const KeyVector<bf16>* v, float* s, int64_t np, Prefetcher& pf) {
  F32x16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = F32x16::zero();
  for (int64_t p = 0; p < D / 2; ++p) {
    pf.some();
    I32x16 k[C];
    for (int c = 0; c < C; ++c) k[c] = I32x16::load(reinterpret_cast<const uint8_t*>(v[c].keys + 2 * p * v[c].stride));
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = pair_dot(acc[r][c], k[c], q + r * D + 2 * p);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c].store(s + r * np + c * 16);
}

// s: [rows, np] scores of rows q: [rows, D] against the tile's key vectors
template <typename X, typename K>
void scores(const X* q, int64_t rows, int64_t D, const KeyVector<K>* v, int64_t np, float* s, Prefetcher& pf) {
  constexpr bool pairs = std::is_same_v<K, bf16>;
  constexpr int RB = pairs ? kPairRows : kRows, CB = pairs ? kPairCols : kCols;
  const int64_t vectors = np / kVectorKeys<K>;
  for_row_blocks<RB>(rows, [&](auto rb, int64_t r) {
    constexpr int R = decltype(rb)::value;
    int64_t c = 0;
    for (; c + CB <= vectors; c += CB) score_block<R, CB>(q + r * D, D, v + c, s + r * np + c * kVectorKeys<K>, np, pf);
    for (; c < vectors; ++c) score_block<R, 1>(q + r * D, D, v + c, s + r * np + c * kVectorKeys<K>, np, pf);
  });
}

// One row's scores s: [np] -> probabilities exp(s - m_new), exactly 0 from key `visible` on; updates
// the row's running max m and sum l and returns the factor its accumulator must be scaled by.
// bias and ones are the mask buffers already slid so that key j reads entry j.
float softmax_row(float* s, int64_t np, bool masked, const float* bias, const float* ones, float& m, float& l) {
  VecF top = VecF::set1(kNegInf);
  for (int64_t j = 0; j < np; j += N) {
    VecF x = VecF::load(s + j);
    if (masked) {
      x = x + VecF::load(bias + j);
      x.store(s + j);
    }
    top = VecF::max(top, x);
  }
  const float m_new = std::max(m, top.reduce_max());
  const float keep = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
  const VecF shift = VecF::set1(m_new);
  VecF sum = VecF::zero();
  for (int64_t j = 0; j < np; j += N) {
    VecF e = exp(VecF::load(s + j) - shift);
    if (masked) e = e * VecF::load(ones + j);  // exp clamps -inf to ~1e-38: make it 0
    e.store(s + j);
    sum = sum + e;
  }
  l = l * keep + sum.reduce_add();
  m = m_new;
  return keep;
}

// P.V accumulators, VecF or F32x16 of W lanes: o[r][c] = acc[r, d0 + c W ..] * keep[r], and back
template <int W, typename Vec, int R, int C>
void load_scaled(Vec (&o)[R][C], const float* acc, const float* keep, int64_t D, int64_t d0) {
  for (int r = 0; r < R; ++r) {
    const Vec k = Vec::set1(keep[r]);
    for (int c = 0; c < C; ++c) o[r][c] = Vec::load(acc + r * D + d0 + c * W) * k;
  }
}
template <int W, typename Vec, int R, int C>
void store_rows(const Vec (&o)[R][C], float* acc, int64_t D, int64_t d0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c].store(acc + r * D + d0 + c * W);
}

// acc[r, d0 + :C N] = acc[r, ...] * keep[r] + sum_{j < n} p[r, j] * V[j, ...] for R rows (float32 or float16 cache)
template <int R, int C, typename V, std::enable_if_t<!std::is_same_v<V, bf16>, int> = 0>
void pv_block(float* acc, const float* p, const float* keep, const V* const* vrow, int64_t n, int64_t D,
              int64_t np, int64_t d0, Prefetcher& pf) {
  VecF o[R][C];
  load_scaled<N>(o, acc, keep, D, d0);
  for (int64_t j = 0; j < n; ++j) {
    if (drips_at<V>(j)) pf.some();
    VecF v[C];
    for (int c = 0; c < C; ++c) v[c] = VecF::load(vrow[j] + d0 + c * N);
    for (int r = 0; r < R; ++r) {
      const VecF pr = VecF::set1(p[r * np + j]);
      for (int c = 0; c < C; ++c) o[r][c] = VecF::fmadd(pr, v[c], o[r][c]);
    }
  }
  store_rows<N>(o, acc, D, d0);
}

// the same for a bfloat16 cache, 16 features a vector and keys two at a time (vrow: [n / 2] pair rows,
// p: [R, np] as bfloat16 or float32). An odd last key is taken alone: the other half of its pair may lie past
// the context.
template <int R, int C, typename X>
void pv_block(float* acc, const X* p, const float* keep, const bf16* const* vrow, int64_t n, int64_t D,
              int64_t np, int64_t d0, Prefetcher& pf) {
  F32x16 o[R][C];
  load_scaled<16>(o, acc, keep, D, d0);
  auto values = [&](I32x16* v, int64_t pair) {
    for (int c = 0; c < C; ++c) v[c] = I32x16::load(reinterpret_cast<const uint8_t*>(vrow[pair] + 2 * (d0 + c * 16)));
  };
  for (int64_t j = 0; j + 1 < n; j += 2) {
    pf.some();
    I32x16 v[C];
    values(v, j / 2);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) o[r][c] = pair_dot(o[r][c], v[c], p + r * np + j);
  }
  if (n % 2) {
    I32x16 v[C];
    values(v, n / 2);
    for (int r = 0; r < R; ++r) {
      const F32x16 pr = F32x16::set1(to_float(p[r * np + n - 1]));
      for (int c = 0; c < C; ++c) o[r][c] = F32x16::fmadd(v[c].bf16_low(), pr, o[r][c]);
    }
  }
  store_rows<16>(o, acc, D, d0);
}

// value j's feature d: a row (float32, float16 cache) or the half of a pair row (bfloat16)
inline float value_at(const float* const* vrow, int64_t j, int64_t d) { return vrow[j][d]; }
inline float value_at(const f16* const* vrow, int64_t j, int64_t d) { return to_float(vrow[j][d]); }
inline float value_at(const bf16* const* vrow, int64_t j, int64_t d) { return bf16_to_float(vrow[j / 2][2 * d + j % 2]); }

// acc: [rows, D] += p: [rows, np] . V, after scaling each row by keep (R rows whose last sees n keys;
// the others see fewer, their p is 0 beyond)
template <typename X, typename V>
void weighted_values(float* acc, int64_t rows, const X* p, const float* keep, const int64_t* visible,
                     const V* const* vrow, int64_t D, int64_t np, Prefetcher& pf) {
  constexpr bool pairs = std::is_same_v<V, bf16>;
  constexpr int RB = pairs ? kPairRows : kRows, CB = pairs ? kPairCols : kCols, W = pairs ? 16 : N;
  for_row_blocks<RB>(rows, [&](auto rb, int64_t r0) {
    constexpr int R = decltype(rb)::value;
    float* a = acc + r0 * D;
    const X* pr = p + r0 * np;
    const int64_t n = visible[r0 + R - 1];
    int64_t d0 = 0;
    for (; d0 + CB * W <= D; d0 += CB * W) pv_block<R, CB>(a, pr, keep + r0, vrow, n, D, np, d0, pf);
    for (; d0 + W <= D; d0 += W) pv_block<R, 1>(a, pr, keep + r0, vrow, n, D, np, d0, pf);
    for (; d0 < D; ++d0)  // head_dim not a multiple of the vector
      for (int r = 0; r < R; ++r) {
        float o = a[r * D + d0] * keep[r0 + r];
        for (int64_t j = 0; j < n; ++j) o += to_float(pr[r * np + j]) * value_at(vrow, j, d0);
        a[r * D + d0] = o;
      }
  });
}

}  // namespace
}  // namespace appliance::APPLIANCE_ISA
