// Attention over the paged KV cache, for decode and for prefill/extend alike.
//
// One work item is (sequence, KV head, tile of up to kQueryTile new queries). Its rows are the query
// heads that share the KV head (GQA), for each query of the tile: row r is query r / group, head
// kv_head * group + r % group. The item walks the sequence's keys in key tiles of whole cache blocks
// (about kKeyTile keys, so a tile can span blocks of 8 and one block of 256 is one tile):
//   - the tile's K is packed transposed once, kt [D][keys rounded up to VecF::N], with N x N
//     register transposes, so a row's scores for VecF::N keys are D FMAs of a broadcast q element
//     with one kt row: SIMD across keys, no horizontal sum per key;
//   - softmax is online in float32: per row and key tile one max, one exp per key (vector), one
//     sum; keys past a row's causal limit and the padding get -inf, so probability exactly 0;
//   - P.V: each row's accumulator gets broadcast p[j] times V row j (vector over features).
// Both inner products run on a few rows at once (registers hold kRows x kCols vectors), so each kt
// or V load feeds several FMAs and enough independent FMAs are in flight.
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
namespace {

constexpr int N = VecF::N;
constexpr int64_t kQueryTile = 16;  // queries per item: more amortise the K packing, fewer balance threads
constexpr int64_t kKeyTile = 64;    // keys per tile (at least one block): amortises the per-tile reductions
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Register blocking of both products: kRows rows x kCols vectors of accumulators. The portable VecF is
// an array the compiler vectorises one operation at a time; 4 x 2 of them spill (2.5x slower there),
// so it takes one row and one vector at a time.
constexpr bool kPortable = APPLIANCE_ISA_ID == APPLIANCE_ISA_portable;
constexpr int kRows = kPortable ? 1 : 4, kCols = kPortable ? 1 : 2;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct Item {
  int64_t seq, kv_head, tile_start, tile_len;
};

// One thread's buffers, reused by all its items. KT: keys per tile, KP: that rounded up to N.
template <typename T>
struct Scratch {
  Scratch(int64_t key_tile, int64_t D)
      : key_tile(key_tile), padded(round_up(key_tile, N)), kt(D * padded), vf(key_tile * D), krow(key_tile),
        vsrc(key_tile), vrow(key_tile), bias(2 * padded, 0.f), ones(2 * padded, 1.f) {
    std::fill(bias.begin() + padded, bias.end(), kNegInf);
    std::fill(ones.begin() + padded, ones.end(), 0.f);
  }
  int64_t key_tile, padded;               // KT, KP
  std::vector<float> kt, vf;              // [D, KP] packed keys; [KT, D] the tile's V as float (bf16 caches)
  std::vector<const T*> krow, vsrc;       // [KT] the tile's key and value rows in the cache
  std::vector<const float*> vrow;         // [KT] value rows as float (the cache itself, or vf)
  std::vector<float> bias, ones;          // [2 KP]: 0.. then -inf..; 1.. then 0..: slid by a row's visible keys
  std::vector<float> q, acc, p, m, l, keep;  // per item: q, acc [rows, D]; p [rows, KP] scores, then probabilities
  std::vector<int64_t> pos, visible;         // per item [rows]: a row's position; keys of this tile it sees
};

// kt[d, j] = K[j, d] for the tile's nk keys, zero in the padding up to np
template <typename T>
void pack_keys(const T* const* krow, int64_t nk, int64_t np, int64_t D, float* kt) {
  VecF tile[N];
  int64_t d0 = 0;
  for (; d0 + N <= D; d0 += N)
    for (int64_t j0 = 0; j0 < np; j0 += N) {
      for (int i = 0; i < N; ++i) tile[i] = j0 + i < nk ? VecF::load(krow[j0 + i] + d0) : VecF::zero();
      VecF::transpose(tile);
      for (int i = 0; i < N; ++i) tile[i].store(kt + (d0 + i) * np + j0);
    }
  for (; d0 < D; ++d0)  // head_dim not a multiple of N
    for (int64_t j = 0; j < np; ++j) kt[d0 * np + j] = j < nk ? to_float(krow[j][d0]) : 0.f;
}

// s[r, j0 + j] = q[r, :] . K[j0 + j, :] for R rows and C vectors of keys
template <int R, int C>
void score_block(const float* q, int64_t D, const float* kt, int64_t np, int64_t j0, float* s) {
  VecF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = VecF::zero();
  for (int64_t d = 0; d < D; ++d) {
    VecF k[C];
    for (int c = 0; c < C; ++c) k[c] = VecF::load(kt + d * np + j0 + c * N);
    for (int r = 0; r < R; ++r) {
      const VecF qd = VecF::set1(q[r * D + d]);
      for (int c = 0; c < C; ++c) acc[r][c] = VecF::fmadd(qd, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c].store(s + r * np + j0 + c * N);
}

template <int R>
void score_rows(const float* q, int64_t D, const float* kt, int64_t np, float* s) {
  int64_t j0 = 0;
  for (; j0 + kCols * N <= np; j0 += kCols * N) score_block<R, kCols>(q, D, kt, np, j0, s);
  for (; j0 < np; j0 += N) score_block<R, 1>(q, D, kt, np, j0, s);
}

// s: [rows, np] scores of rows q: [rows, D] against the packed tile
void scores(const float* q, int64_t rows, int64_t D, const float* kt, int64_t np, float* s) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) score_rows<kRows>(q + r * D, D, kt, np, s + r * np);
  switch (rows - r) {  // fewer than kRows left
    case 3: score_rows<3>(q + r * D, D, kt, np, s + r * np); break;
    case 2: score_rows<2>(q + r * D, D, kt, np, s + r * np); break;
    case 1: score_rows<1>(q + r * D, D, kt, np, s + r * np); break;
  }
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

// acc[r, d0 + :C N] = acc[r, ...] * keep[r] + sum_{j < n} p[r, j] * V[j, ...] for R rows
template <int R, int C>
void pv_block(float* acc, const float* p, const float* keep, const float* const* vrow, int64_t n, int64_t D,
              int64_t np, int64_t d0) {
  VecF o[R][C];
  for (int r = 0; r < R; ++r) {
    const VecF k = VecF::set1(keep[r]);
    for (int c = 0; c < C; ++c) o[r][c] = VecF::load(acc + r * D + d0 + c * N) * k;
  }
  for (int64_t j = 0; j < n; ++j) {
    VecF v[C];
    for (int c = 0; c < C; ++c) v[c] = VecF::load(vrow[j] + d0 + c * N);
    for (int r = 0; r < R; ++r) {
      const VecF pr = VecF::set1(p[r * np + j]);
      for (int c = 0; c < C; ++c) o[r][c] = VecF::fmadd(pr, v[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c].store(acc + r * D + d0 + c * N);
}

// R rows whose last sees n keys (the others see fewer; their p is 0 beyond)
template <int R>
void pv_rows(float* acc, const float* p, const float* keep, const float* const* vrow, int64_t n, int64_t D,
             int64_t np) {
  int64_t d0 = 0;
  for (; d0 + kCols * N <= D; d0 += kCols * N) pv_block<R, kCols>(acc, p, keep, vrow, n, D, np, d0);
  for (; d0 + N <= D; d0 += N) pv_block<R, 1>(acc, p, keep, vrow, n, D, np, d0);
  for (; d0 < D; ++d0)  // head_dim not a multiple of N
    for (int r = 0; r < R; ++r) {
      float o = acc[r * D + d0] * keep[r];
      for (int64_t j = 0; j < n; ++j) o += p[r * np + j] * vrow[j][d0];
      acc[r * D + d0] = o;
    }
}

// acc: [rows, D] += p: [rows, np] . V, after scaling each row by keep
void weighted_values(float* acc, int64_t rows, const float* p, const float* keep, const int64_t* visible,
                     const float* const* vrow, int64_t D, int64_t np) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    pv_rows<kRows>(acc + r * D, p + r * np, keep + r, vrow, visible[r + kRows - 1], D, np);
  switch (rows - r) {  // fewer than kRows left
    case 3: pv_rows<3>(acc + r * D, p + r * np, keep + r, vrow, visible[r + 2], D, np); break;
    case 2: pv_rows<2>(acc + r * D, p + r * np, keep + r, vrow, visible[r + 1], D, np); break;
    case 1: pv_rows<1>(acc + r * D, p + r * np, keep + r, vrow, visible[r], D, np); break;
  }
}

// The tile's key and value rows: keys k0 .. k0 + nk of the sequence, wherever their blocks are.
template <typename C>
void gather_rows(const AttentionArgs& a, const Item& it, int64_t k0, int64_t nk, Scratch<C>& st) {
  const int64_t D = a.head_dim, B = a.block_size;
  const int32_t* table = a.block_tables + it.seq * a.max_blocks_per_seq;
  const C* kc = static_cast<const C*>(a.key_cache);
  const C* vc = static_cast<const C*>(a.value_cache);
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t p = k0 + j, offset = ((table[p / B] * a.kv_heads + it.kv_head) * B + p % B) * D;
    st.krow[j] = kc + offset;
    st.vsrc[j] = vc + offset;
  }
  if constexpr (std::is_same_v<C, float>) {
    for (int64_t j = 0; j < nk; ++j) st.vrow[j] = st.vsrc[j];
  } else {  // widen V once per tile, not once per group of rows
    for (int64_t j = 0; j < nk; ++j) {
      float* dst = &st.vf[j * D];
      int64_t d = 0;
      for (; d + N <= D; d += N) VecF::load(st.vsrc[j] + d).store(dst + d);
      for (; d < D; ++d) dst[d] = to_float(st.vsrc[j][d]);
      st.vrow[j] = dst;
    }
  }
}

// q rows as float, scaled; each row's position (tile_pos: the tile's first query's)
template <typename T, typename C>
void start_item(const AttentionArgs& a, const Item& it, int64_t rows, int64_t tile_pos, Scratch<C>& st) {
  const int64_t D = a.head_dim, group = a.q_heads / a.kv_heads;
  st.q.resize(rows * D), st.acc.assign(rows * D, 0.f), st.p.resize(rows * st.padded);
  st.m.assign(rows, kNegInf), st.l.assign(rows, 0.f), st.keep.resize(rows);
  st.pos.resize(rows), st.visible.resize(rows);
  const T* q = static_cast<const T*>(a.q);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = a.q_starts[it.seq] + it.tile_start + r / group, head = it.kv_head * group + r % group;
    const T* src = q + token * a.q_stride + head * D;
    for (int64_t d = 0; d < D; ++d) st.q[r * D + d] = to_float(src[d]) * a.scale;
    st.pos[r] = tile_pos + r / group;
  }
}

template <typename T, typename C>
void finish_item(const AttentionArgs& a, const Item& it, int64_t rows, const Scratch<C>& st) {
  const int64_t D = a.head_dim, group = a.q_heads / a.kv_heads;
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = a.q_starts[it.seq] + it.tile_start + r / group, head = it.kv_head * group + r % group;
    T* dst = out + token * a.out_stride + head * D;
    const float inv = 1.f / st.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(st.acc[r * D + d] * inv);
  }
}

template <typename T, typename C>  // T: q and out, C: the cache
void run_item(const AttentionArgs& a, const Item& it, Scratch<C>& st) {
  const int64_t D = a.head_dim, group = a.q_heads / a.kv_heads, rows = it.tile_len * group;
  const int64_t q_len = a.q_starts[it.seq + 1] - a.q_starts[it.seq];
  const int64_t tile_pos = a.context_lens[it.seq] - q_len + it.tile_start, last = tile_pos + it.tile_len - 1;
  start_item<T>(a, it, rows, tile_pos, st);
  for (int64_t k0 = 0; k0 <= last; k0 += st.key_tile) {
    const int64_t nk = std::min(st.key_tile, last - k0 + 1), np = round_up(nk, N);  // no row sees past `last`
    const int64_t row0 = std::max<int64_t>(0, k0 - tile_pos) * group;              // rows before see no key here
    gather_rows(a, it, k0, nk, st);
    pack_keys(st.krow.data(), nk, np, D, st.kt.data());
    scores(&st.q[row0 * D], rows - row0, D, st.kt.data(), np, &st.p[row0 * np]);
    for (int64_t r = row0; r < rows; ++r) {
      const int64_t visible = std::min(nk, st.pos[r] - k0 + 1), slide = st.padded - visible;
      st.visible[r] = visible;
      st.keep[r] = softmax_row(&st.p[r * np], np, visible < np, &st.bias[slide], &st.ones[slide], st.m[r], st.l[r]);
    }
    weighted_values(&st.acc[row0 * D], rows - row0, &st.p[row0 * np], &st.keep[row0], &st.visible[row0],
                    st.vrow.data(), D, np);
  }
  finish_item<T>(a, it, rows, st);
}

template <typename T, typename C>
void attention_impl(const AttentionArgs& a) {
  const int64_t key_tile = std::max<int64_t>(1, kKeyTile / a.block_size) * a.block_size;
  std::vector<Item> items;
  for (int64_t s = 0; s < a.seqs; ++s) {
    const int64_t q_len = a.q_starts[s + 1] - a.q_starts[s];
    if (q_len == 0) continue;
    for (int64_t h = 0; h < a.kv_heads; ++h)  // latest queries first: the longest items start early
      for (int64_t start = (q_len - 1) / kQueryTile * kQueryTile; start >= 0; start -= kQueryTile)
        items.push_back({s, h, start, std::min(kQueryTile, q_len - start)});
  }
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    Scratch<C> st(key_tile, a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item<T, C>(a, items[i], st);
  }
}

}  // namespace

// out, q: [Tq, Hq, D] (rows at out_stride / q_stride); key_cache, value_cache: [blocks, Hk, B, D];
// block_tables: [S, max_blocks]; context_lens: [S]; q_starts: [S + 1]. Checked in module.cpp.
void paged_attention(const AttentionArgs& a) {
  const bool f32 = a.dtype == DType::f32, cache_f32 = a.cache_dtype == DType::f32;
  if (f32 && cache_f32) attention_impl<float, float>(a);
  else if (f32) attention_impl<float, bf16>(a);
  else if (cache_f32) attention_impl<bf16, float>(a);
  else attention_impl<bf16, bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
