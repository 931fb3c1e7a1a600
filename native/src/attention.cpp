// Attention over the paged KV cache, for decode and for prefill/extend alike.
//
// Cache layouts within one (block, KV head), chosen so that the inner products need no transposition:
//   - float32: keys [D, B] (transposed), values [B, D]. A row's scores for VecF::N keys are D FMAs of a
//     broadcast q element with one vector loaded straight from the cache (SIMD across keys); P.V adds
//     broadcast p[j] times value row j.
//   - bfloat16: the same, with neighbours paired in 32-bit lanes: keys [D/2, B, 2] (features d, d + 1 of
//     a key side by side), values [B/2, D, 2] (keys j, j + 1 of a feature side by side). A 64-byte load
//     is 16 lanes of pairs: vdpbf16ps's operand (q or p pair broadcast, two products a lane) where the
//     CPU has AVX512-BF16 and issues it at least half as fast as an FMA (kernels.h, bf16_dot), else
//     widened to float32 by a shift and a mask, no conversion instructions. With vdpbf16ps q and p are
//     rounded to bfloat16 first (the cache already is); elsewhere the arithmetic is float32 throughout.
//
// One work item is (sequence, KV heads, tile of up to kQueryTile new queries, range of keys): every KV
// head of the sequence, or one where that leaves too few items (decode of a sequence or two). For each
// of its KV heads, its rows are the query heads that share it (GQA), for each query of the tile: row
// r' of a head is query r' / group, head kv_head * group + r' % group. The item walks its keys in key
// tiles of whole cache blocks (about kKeyTile keys), each tile's KV heads in turn, so that it reads a
// block's heads (side by side in the cache) as one run: decode attention over 30 layers of bfloat16
// cache, alternated on Zen 5: 8 sequences x 640 keys 3.9-4.3 -> 3.4-3.6 ms, x 1344 8.2-8.5 -> 6.8-6.9;
// 32 x 320 8.3 -> 7.3-7.8; 8 x 128 and prefill unchanged (one head an item, the strided 2 KiB runs
// reached ~29 GB/s from DRAM, whole blocks ~40). Per tile and head:
//   - a vector of keys (VecF::N of them, 16 for bfloat16) is read from the cache where it lies inside
//     one block and the context; one that straddles blocks or ends past the context is copied to a
//     zero-padded scratch first, so no slot past the context is ever read (nor the other half of a
//     value pair whose first key is the context's last);
//   - softmax is online in float32: per row and key tile one max, one exp per key (vector), one
//     sum; keys past a row's causal limit get -inf, so probability exactly 0;
//   - both inner products run on a few rows at once (kRows x kCols vectors of accumulators).
// With few items (decode of one or two sequences), each item's keys are split in ranges that run
// in parallel; their partial (max, sum, accumulator) are merged at the end (split-KV).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

constexpr int N = VecF::N;
constexpr int64_t kQueryTile = 16;  // queries per item: more amortise the key loads, fewer balance threads
constexpr int64_t kKeyTile = 64;    // keys per tile (at least one block): amortises the per-tile reductions
constexpr int64_t kSplitKeys = 128; // fewest keys a split-KV range gets
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Register blocking of both products: kRows rows x kCols vectors of accumulators. The portable VecF is
// an array the compiler vectorises one operation at a time; 4 x 2 of them spill (2.5x slower there),
// so it takes one row and one vector at a time; so do NEON's 16-lane vectors (plain arrays too).
constexpr bool kPortable = APPLIANCE_ISA_ID == APPLIANCE_ISA_portable;
constexpr bool kAvx512 = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16 || APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512;
constexpr int kRows = kPortable ? 1 : 4, kCols = kPortable ? 1 : 2;
constexpr int kPairRows = kAvx512 ? 4 : APPLIANCE_ISA_ID == APPLIANCE_ISA_avx2 ? 3 : 1, kPairCols = kAvx512 ? 2 : 1;
// Against a bfloat16 cache, q and p are multiplied as bfloat16 pairs (vdpbf16ps: kRound) where the CPU has
// AVX512-BF16 and issues it fast enough (kernels.h, bf16_dot), else as float32.
constexpr bool kHasBf16Dot = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16;

template <typename C> constexpr int64_t kVectorKeys = std::is_same_v<C, bf16> ? 16 : N;  // keys in a vector
// q and p take a bfloat16 copy (Scratch::q2, p2) only against a bfloat16 cache, when vdpbf16ps is in use
template <typename C, bool kRound> constexpr bool kRoundedQP = std::is_same_v<C, bf16> && kRound;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

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

// The next key tile's K and V blocks, asked for two cache lines at a time from inside the inner
// products' loops. A sequence's blocks lie anywhere in the pool, so the hardware prefetchers cannot see
// the next one coming, and a decode step streams the whole cache. All of a tile's lines asked for at
// once (16 KiB) stalled the core on its full miss queues, with little left to overlap; two lines an
// inner iteration spread the next tile's over this one's work. Decode attention out of DRAM, 30 layers
// x 300 keys, alternated on Zen 5 (one burst a tile of this tile's values and the next one's keys ->
// these drips of the next tile's K and V): 32 sequences 10.2 -> 8.1 ms, 8 sequences 2.6 -> 2.0 ms;
// cache-resident unchanged. Asking for the line after a division per line instead of a running pointer
// cost a third of the cache-resident speed.
struct Prefetcher {
  static constexpr int kLinesAStep = 2;
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

// One thread's buffers, reused by all its items.
template <typename C>
struct Scratch {
  explicit Scratch(int64_t key_tile, int64_t D)
      : key_tile(key_tile), padded(round_up(key_tile, 16)), packed(padded * D), vectors(padded / kVectorKeys<C>),
        vrow(key_tile), bias(2 * padded, 0.f), ones(2 * padded, 1.f) {
    std::fill(bias.begin() + padded, bias.end(), kNegInf);
    std::fill(ones.begin() + padded, ones.end(), 0.f);
  }
  int64_t key_tile, padded;               // KT: keys a tile (whole blocks); KP: that rounded up to 16
  std::vector<C> packed;                  // key vectors copied out of the cache, zero-padded, in the cache's layout
  std::vector<KeyVector<C>> vectors;      // [KP / keys a vector]
  std::vector<const C*> vrow;             // value rows in the cache: [KT] rows (float32), [KT / 2] row pairs (bfloat16)
  std::vector<float> bias, ones;          // [2 KP]: 0.. then -inf..; 1.. then 0..: slid by a row's visible keys
  std::vector<float> q, acc, p, m, l, keep;  // per item: q, acc [rows, D]; p [rows, KP] scores, then probabilities
  std::vector<bf16> q2, p2;                  // q and p rounded to bfloat16, used when kRoundedQP<C, kRound>
  std::vector<int64_t> pos, visible;         // per item [rows]: a row's position; keys of this tile it sees
  Prefetcher prefetch;
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

// s[r, c N .. (c + 1) N) = q[r, :] . keys of vector c, for R rows and C vectors (float32 cache)
template <int R, int C>
void score_block(const float* q, int64_t D, const KeyVector<float>* v, float* s, int64_t np, Prefetcher& pf) {
  VecF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = VecF::zero();
  for (int64_t d = 0; d < D; ++d) {
    pf.some();
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

// acc[r, d0 + :C N] = acc[r, ...] * keep[r] + sum_{j < n} p[r, j] * V[j, ...] for R rows (float32 cache)
template <int R, int C>
void pv_block(float* acc, const float* p, const float* keep, const float* const* vrow, int64_t n, int64_t D,
              int64_t np, int64_t d0, Prefetcher& pf) {
  VecF o[R][C];
  load_scaled<N>(o, acc, keep, D, d0);
  for (int64_t j = 0; j < n; ++j) {
    pf.some();
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

// value j's feature d: a row (float32 cache) or the half of a pair row (bfloat16)
inline float value_at(const float* const* vrow, int64_t j, int64_t d) { return vrow[j][d]; }
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

// The tile's key vectors and value rows: keys k0 .. k0 + nk of the sequence, wherever their blocks are.
// k0 starts a block and B is even (checked), so bfloat16 value pairs never straddle blocks.
template <typename C>
void gather(const AttentionArgs& a, const Item& it, int64_t kv_head, int64_t k0, int64_t nk, Scratch<C>& st) {
  constexpr bool pairs = std::is_same_v<C, bf16>;
  constexpr int64_t VK = kVectorKeys<C>, lane = pairs ? 2 : 1;  // keys a vector; elements a lane (a pair)
  const int64_t D = a.head_dim, B = a.block_size;
  const int32_t* table = a.block_tables + it.seq * a.max_blocks_per_seq;
  const C* kc = static_cast<const C*>(a.key_cache);
  const C* vc = static_cast<const C*>(a.value_cache);
  auto block_base = [&](int64_t p) { return (table[p / B] * a.kv_heads + kv_head) * B * D; };
  for (int64_t j = 0, p = k0; j < nk;) {  // block by block: one division a block, not one a key
    const C* rows = vc + block_base(p);
    for (int64_t o = p % B; o < B && j < nk; o += lane, j += lane, p += lane) st.vrow[j / lane] = rows + o * D;
  }
  for (int64_t v = 0; v * VK < nk; ++v) {
    const int64_t first = k0 + v * VK, offset = first % B;
    if (v * VK + VK <= nk && offset + VK <= B) {  // inside one block and the context: read in place
      st.vectors[v] = {kc + block_base(first) + lane * offset, B};
      continue;
    }
    C* dst = &st.packed[v * D * VK];  // the cache's layout with VK keys to a block
    for (int64_t i = 0; i < VK; ++i) {
      const int64_t p = first + i;
      const C* src = kc + block_base(p) + lane * (p % B);
      for (int64_t f = 0; f < D / lane; ++f)
        for (int64_t h = 0; h < lane; ++h)
          dst[(f * VK + i) * lane + h] = v * VK + i < nk ? src[f * B * lane + h] : from_float<C>(0.f);
    }
    st.vectors[v] = {dst, VK};
  }
}

// Row r of an item: KV head kv_head + r / R (R = tile_len x group rows a head), then query (r % R) / group
// of the tile, query head r % group of that KV head's group.
int64_t tile_query(const AttentionArgs& a, const Item& it, int64_t r) {
  const int64_t group = a.q_heads / a.kv_heads;
  return r % (it.tile_len * group) / group;
}
int64_t query_token(const AttentionArgs& a, const Item& it, int64_t r) {
  return a.q_starts[it.seq] + it.tile_start + tile_query(a, it, r);
}
int64_t query_head(const AttentionArgs& a, const Item& it, int64_t r) {
  const int64_t group = a.q_heads / a.kv_heads;
  return (it.kv_head + r / (it.tile_len * group)) * group + r % group;
}

// q rows as float, scaled; each row's position (tile_pos: the tile's first query's)
template <typename T, typename C, bool kRound>
void start_item(const AttentionArgs& a, const Item& it, int64_t rows, int64_t tile_pos, Scratch<C>& st) {
  const int64_t D = a.head_dim;
  st.q.resize(rows * D), st.acc.assign(rows * D, 0.f), st.p.resize(rows * st.padded);
  st.m.assign(rows, kNegInf), st.l.assign(rows, 0.f), st.keep.resize(rows);
  st.pos.resize(rows), st.visible.resize(rows);
  const T* q = static_cast<const T*>(a.q);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + query_token(a, it, r) * a.q_stride + query_head(a, it, r) * D;
    for (int64_t d = 0; d < D; ++d) st.q[r * D + d] = to_float(src[d]) * a.scale;
    st.pos[r] = tile_pos + tile_query(a, it, r);
  }
  if constexpr (kRoundedQP<C, kRound>) {
    st.q2.resize(rows * D), st.p2.resize(rows * st.padded);
    for (int64_t i = 0; i < rows * D; ++i) st.q2[i] = float_to_bf16(st.q[i]);
  }
}

// q and p as the products against the cache take them: float32, or bfloat16 for vdpbf16ps
template <typename C, bool kRound>
const auto* query_rows(Scratch<C>& st) {
  if constexpr (kRoundedQP<C, kRound>) return st.q2.data();
  else return st.q.data();
}
template <typename C, bool kRound>
const auto* probabilities(Scratch<C>& st, int64_t row0, int64_t rows, int64_t np) {
  if constexpr (kRoundedQP<C, kRound>) {
    for (int64_t i = row0 * np; i < rows * np; i += N) VecF::load(&st.p[i]).store(&st.p2[i]);
    return st.p2.data();
  } else {
    return st.p.data();
  }
}

template <typename T>
void write_rows(const AttentionArgs& a, const Item& it, int64_t rows, const float* acc, const float* l) {
  const int64_t D = a.head_dim;
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + query_token(a, it, r) * a.out_stride + query_head(a, it, r) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(acc[r * D + d] * inv);
  }
}

// Split-KV partial results: per item slot, per row, [max, sum, acc[D]]
struct Partials {
  int64_t row_floats = 0, rows = 0;
  std::vector<float> data;
  float* at(int64_t slot, int64_t row) { return data.data() + (slot * rows + row) * row_floats; }
};

// The position of an item's first query, and the last key any of its rows sees (before key_begin for a
// split-KV range that starts past what its rows see).
int64_t tile_position(const AttentionArgs& a, const Item& it) {
  return a.context_lens[it.seq] - (a.q_starts[it.seq + 1] - a.q_starts[it.seq]) + it.tile_start;
}
int64_t last_key(const AttentionArgs& a, const Item& it) {
  return std::min(tile_position(a, it) + it.tile_len, it.key_end) - 1;
}
int64_t first_tile_keys(const AttentionArgs& a, const Item& it, int64_t key_tile) {
  return std::min(key_tile, last_key(a, it) - it.key_begin + 1);
}

template <typename T, typename C, bool kRound>  // T: q and out, C: the cache; kRound: see kRoundedQP
void run_item(const AttentionArgs& a, const Item& it, const Item* next, Scratch<C>& st, Partials& partials) {
  const int64_t D = a.head_dim, group = a.q_heads / a.kv_heads, R = it.tile_len * group, rows = it.heads * R;
  const int64_t key_tile = st.key_tile;
  const int64_t tile_pos = tile_position(a, it), last = last_key(a, it);  // no row sees past `last`
  start_item<T, C, kRound>(a, it, rows, tile_pos, st);
  if (st.prefetch.item != &it) {  // nothing asked for this item's first tile yet
    st.prefetch.template plan<C>(a, it, it.key_begin, first_tile_keys(a, it, key_tile));
    st.prefetch.rest();
  }
  for (int64_t k0 = it.key_begin; k0 <= last; k0 += key_tile) {
    const int64_t nk = std::min(key_tile, last - k0 + 1), np = round_up(nk, kVectorKeys<C>);
    const int64_t row0 = std::max<int64_t>(0, k0 - tile_pos) * group;  // rows before see no key here
    if (k0 + key_tile <= last)  // the next tile, or the thread's next item's first
      st.prefetch.template plan<C>(a, it, k0 + key_tile, std::min(key_tile, last - k0 - key_tile + 1));
    else if (next)
      st.prefetch.template plan<C>(a, *next, next->key_begin, first_tile_keys(a, *next, key_tile));
    for (int64_t h = 0, base = 0; h < it.heads; ++h, base += R) {  // the tile's keys of each KV head in turn
      gather(a, it, it.kv_head + h, k0, nk, st);
      scores(query_rows<C, kRound>(st) + (base + row0) * D, R - row0, D, st.vectors.data(), np, &st.p[row0 * np], st.prefetch);
      for (int64_t r = row0; r < R; ++r) {
        const int64_t visible = std::min(nk, st.pos[base + r] - k0 + 1), slide = st.padded - visible;
        st.visible[base + r] = visible;
        st.keep[base + r] = softmax_row(&st.p[r * np], np, visible < np, &st.bias[slide], &st.ones[slide],
                                        st.m[base + r], st.l[base + r]);
      }
      weighted_values(&st.acc[(base + row0) * D], R - row0, probabilities<C, kRound>(st, row0, R, np) + row0 * np,
                      &st.keep[base + row0], &st.visible[base + row0], st.vrow.data(), D, np, st.prefetch);
    }
  }
  if (it.partial < 0) return write_rows<T>(a, it, rows, st.acc.data(), st.l.data());
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = partials.at(it.partial, r);
    dst[0] = st.m[r], dst[1] = st.l[r];
    std::copy(&st.acc[r * D], &st.acc[r * D] + D, dst + 2);
  }
}

// The split ranges of one (sequence, KV head, tile) back into its output rows.
template <typename T>
void merge(const AttentionArgs& a, const Item& first, int64_t splits, Partials& partials) {
  const int64_t D = a.head_dim, rows = first.heads * first.tile_len * (a.q_heads / a.kv_heads);
  std::vector<float> acc(rows * D, 0.f), l(rows, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegInf;
    for (int64_t s = 0; s < splits; ++s) m = std::max(m, partials.at(first.partial + s, r)[0]);
    for (int64_t s = 0; s < splits; ++s) {
      const float* part = partials.at(first.partial + s, r);
      if (part[1] == 0.f) continue;  // a range with no key this row sees
      const float w = std::exp(part[0] - m);
      l[r] += part[1] * w;
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] += part[2 + d] * w;
    }
  }
  write_rows<T>(a, first, rows, acc.data(), l.data());
}

template <typename T, typename C, bool kRound = false>
void attention_impl(const AttentionArgs& a) {
  const int64_t key_tile = std::max<int64_t>(1, kKeyTile / a.block_size) * a.block_size;
  // An item covers every KV head of its sequence: a cache block holds them side by side, so its key tiles
  // read one contiguous run a block instead of a head's 1/kv_heads of it. With few such items (decode
  // of a sequence or two) they are split per KV head first, then by keys below.
  const int64_t threads = omp_get_max_threads();
  std::vector<Item> whole;
  for (const int64_t heads : {a.kv_heads, int64_t{1}}) {
    whole.clear();
    for (int64_t s = 0; s < a.seqs; ++s) {
      const int64_t q_len = a.q_starts[s + 1] - a.q_starts[s];
      if (q_len == 0) continue;
      for (int64_t h = 0; h < a.kv_heads; h += heads)  // latest queries first: the longest items start early
        for (int64_t start = (q_len - 1) / kQueryTile * kQueryTile; start >= 0; start -= kQueryTile)
          whole.push_back({s, h, heads, start, std::min(kQueryTile, q_len - start), 0, a.context_lens[s], -1});
    }
    if (static_cast<int64_t>(whole.size()) >= 2 * threads) break;
  }
  // Few items (decode of a sequence or two): split each one's keys so that every thread has work.
  const int64_t count = static_cast<int64_t>(whole.size());
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first item, splits)
  Partials partials;
  if (count > 0 && count < 2 * threads) {
    const int64_t want = (4 * threads + count - 1) / count, group = a.q_heads / a.kv_heads;
    partials.rows = whole.front().heads * kQueryTile * group, partials.row_floats = a.head_dim + 2;
    for (const Item& it : whole) {
      const int64_t keys = it.key_end, step = round_up(std::max(kSplitKeys, (keys + want - 1) / want), key_tile);
      const int64_t splits = (keys + step - 1) / step;
      if (splits <= 1) {
        items.push_back(it);
        continue;
      }
      merges.emplace_back(static_cast<int64_t>(items.size()), splits);
      for (int64_t s = 0; s < splits; ++s) {
        Item part = it;
        part.key_begin = s * step, part.key_end = std::min(keys, (s + 1) * step);
        part.partial = static_cast<int64_t>(partials.data.size() / (partials.rows * partials.row_floats));
        partials.data.resize(partials.data.size() + partials.rows * partials.row_floats);
        items.push_back(part);
      }
    }
  } else {
    items = std::move(whole);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  WorkQueue queue(n);
#pragma omp parallel
  {
    Scratch<C> st(key_tile, a.head_dim);
    // With items to spare, each thread claims its next item before it runs the current one: each item
    // prefetches the tile after its own, and its last tile the next item's first. With few (fewer than
    // two a thread), claiming ahead would leave threads without any.
    const bool ahead = n >= 2 * omp_get_num_threads();
    auto claim = [&] { return ahead ? queue.take() : -1; };
    int64_t i = queue.take(), next = i < 0 ? -1 : claim();
    while (i >= 0) {
      run_item<T, C, kRound>(a, items[i], next < 0 ? nullptr : &items[next], st, partials);
      i = next >= 0 ? next : queue.take(), next = i < 0 ? -1 : claim();
    }
  }
  for (const auto& [first, splits] : merges) merge<T>(a, items[first], splits, partials);
}

}  // namespace

// out, q: [Tq, Hq, D] (rows at out_stride / q_stride); key_cache: [blocks, Hk, D, B]; value_cache:
// [blocks, Hk, B, D]; block_tables: [S, max_blocks]; context_lens: [S]; q_starts: [S + 1]. Checked in
// module.cpp.
void paged_attention(const AttentionArgs& a) {
  const bool f32 = a.dtype == DType::f32, cache_f32 = a.cache_dtype == DType::f32;
  if (f32 && cache_f32) return attention_impl<float, float>(a);
  if (cache_f32) return attention_impl<bf16, float>(a);
  if constexpr (kHasBf16Dot) {
    if (bf16_dot()) return f32 ? attention_impl<float, bf16, true>(a) : attention_impl<bf16, bf16, true>(a);
  }
  f32 ? attention_impl<float, bf16>(a) : attention_impl<bf16, bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
