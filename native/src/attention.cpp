// Attention over the paged KV cache, for decode and for prefill/extend alike.
//
// Cache layouts within one (block, KV head), chosen so that the inner products need no transposition:
//   - float32: keys [D, B] (transposed), values [B, D]. A row's scores for VecF::N keys are D FMAs of a
//     broadcast q element with one vector loaded straight from the cache (SIMD across keys); P.V adds
//     broadcast p[j] times value row j. float16: the same layout, each vector widened as it is loaded
//     (vcvtph2ps), the arithmetic float32.
//   - bfloat16: the same, with neighbours paired in 32-bit lanes: keys [D/2, B, 2] (features d, d + 1 of
//     a key side by side), values [B/2, D, 2] (keys j, j + 1 of a feature side by side). A 64-byte load
//     is 16 lanes of pairs: vdpbf16ps's operand (q or p pair broadcast, two products a lane) where the
//     CPU has AVX512-BF16 and issues it at least half as fast as an FMA (kernels.h, bf16_dot), else
//     widened to float32 by a shift and a mask, no conversion instructions. With vdpbf16ps q and p are
//     rounded to bfloat16 first (the cache already is); elsewhere the arithmetic is float32 throughout.
//
// One work item is (sequence, KV heads, tile of up to kQueryTile new queries, range of keys): every KV
// head of the sequence, or one where that and the split below leave too few items (decode of short contexts). For each
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
// An item walks its keys in ranges of kRangeKeys, each with its own online softmax, and folds their
// partial (max, sum, accumulator) in order. With few items (decode of one or two sequences), the ranges
// run as items of their own, in parallel, folded after them the same way (split-KV): the same bits.
// The loops over one key tile (the prefetches, both products, the softmax) are in attention_tile.h.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "attention_tile.h"
#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

constexpr int64_t kQueryTile = 16;  // queries per item: more amortise the key loads, fewer balance threads
constexpr int64_t kKeyTile = 64;    // keys per tile (at least one block): amortises the per-tile reductions
// Keys a range: an item's keys are walked in ranges of this many from the first key, each with its own softmax
// state, folded in order (fold), whether the ranges run in one item or as split-KV items on
// several threads: so a row's result is the same bits however many rows share its step (batch invariance;
// the split had depended on the step's item count: a greedy answer changed with its neighbours).
constexpr int64_t kRangeKeys = 256;
// Against a bfloat16 cache, q and p are multiplied as bfloat16 pairs (vdpbf16ps: kRound) where the CPU has
// AVX512-BF16 and issues it fast enough (kernels.h, bf16_dot), else as float32.
constexpr bool kHasBf16Dot = APPLIANCE_ISA_ID == APPLIANCE_ISA_avx512bf16;

// q and p take a bfloat16 copy (Scratch::q2, p2) only against a bfloat16 cache, when vdpbf16ps is in use
template <typename C, bool kRound> constexpr bool kRoundedQP = std::is_same_v<C, bf16> && kRound;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

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
  int64_t range_keys = 0;                 // keys a range (kRangeKeys rounded up to whole tiles)
  std::vector<C> packed;                  // key vectors copied out of the cache, zero-padded, in the cache's layout
  std::vector<KeyVector<C>> vectors;      // [KP / keys a vector]
  std::vector<const C*> vrow;             // value rows in the cache: [KT] rows (float32), [KT / 2] row pairs (bfloat16)
  std::vector<float> bias, ones;          // [2 KP]: 0.. then -inf..; 1.. then 0..: slid by a row's visible keys
  std::vector<float> q, acc, p, m, l, keep;  // per item: q, acc [rows, D]; p [rows, KP] scores, then probabilities
  std::vector<bf16> q2, p2;                  // q and p rounded to bfloat16, used when kRoundedQP<C, kRound>
  std::vector<int64_t> pos, visible;         // per item [rows]: a row's position; keys of this tile it sees
  std::vector<float> fm, fl, facc;           // per item [rows], [rows, D]: its finished key ranges, folded
  bool folding = false;                      // whether the item has finished a range (fm, fl, facc hold it)
  Prefetcher prefetch;
};

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

// Split-KV partial results: a slot a split range, in it per row [max, sum, acc[D]]; merge reads only the rows
// its item has, each written by that range's run_item in the same call.
struct Partials {
  int64_t row_floats = 0, rows = 0;
  float* data = nullptr;
  float* at(int64_t slot, int64_t row) { return data + (slot * rows + row) * row_floats; }
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

// One key range's partial result of a row (max m, sum l, accumulator acc[D]) folded into the row's running
// (M, L, ACC): ranges are folded in order, the same arithmetic whether they ran in one item (end_range) or as
// split-KV items (merge). A range no key of which the row sees (l == 0) is skipped; the first is taken as it is,
// so one range gives its own sum and accumulator exactly. Not inlined: one compiled body for both callers, so that
// no compiler contracts or vectorises their arithmetic differently.
[[gnu::noinline]] void fold(float& M, float& L, float* ACC, float m, float l, const float* acc, int64_t D) {
  if (l == 0.f) return;
  if (L == 0.f) {
    M = m, L = l;
    std::copy(acc, acc + D, ACC);
    return;
  }
  const float top = std::max(M, m), a = std::exp(M - top), b = std::exp(m - top);
  L = L * a + l * b;
  for (int64_t d = 0; d < D; ++d) ACC[d] = ACC[d] * a + acc[d] * b;
  M = top;
}

// The item's softmax state so far (a finished key range) folded into its running one (st.fm, fl, facc), and a
// fresh state for the next range.
template <typename C>
void end_range(int64_t rows, int64_t D, Scratch<C>& st) {
  if (!st.folding) {
    st.fm.assign(rows, kNegInf), st.fl.assign(rows, 0.f), st.facc.assign(rows * D, 0.f);
    st.folding = true;
  }
  for (int64_t r = 0; r < rows; ++r)
    fold(st.fm[r], st.fl[r], &st.facc[r * D], st.m[r], st.l[r], &st.acc[r * D], D);
  std::fill(st.m.begin(), st.m.begin() + rows, kNegInf), std::fill(st.l.begin(), st.l.begin() + rows, 0.f);
  std::fill(st.acc.begin(), st.acc.begin() + rows * D, 0.f);
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
  st.folding = false;
  for (int64_t k0 = it.key_begin; k0 <= last; k0 += key_tile) {
    if (k0 > it.key_begin && k0 % st.range_keys == 0) end_range(rows, D, st);
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
  if (st.folding) {  // several ranges: folded as split-KV items' are (a split item is one range)
    end_range(rows, D, st);
    return write_rows<T>(a, it, rows, st.facc.data(), st.fl.data());
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
    for (int64_t s = 0; s < splits; ++s) {
      const float* part = partials.at(first.partial + s, r);
      fold(m, l[r], &acc[r * D], part[0], part[1], part + 2, D);
    }
  }
  write_rows<T>(a, first, rows, acc.data(), l.data());
}

template <typename T, typename C, bool kRound = false>
void attention_impl(const AttentionArgs& a) {
  const int64_t key_tile = std::max<int64_t>(1, kKeyTile / a.block_size) * a.block_size;
  const int64_t range_keys = round_up(kRangeKeys, key_tile);
  // An item covers every KV head of its sequence: a cache block holds them side by side, so its key tiles
  // read one contiguous run a block instead of a head's 1/kv_heads of it. With few such items (decode
  // of a sequence or two) they are split by keys below, and per KV head first only where the key ranges
  // alone would still leave threads idle (short contexts). Keeping the heads together in the split: decode
  // over the default model's bfloat16 cache, 30 layers, alternated on Zen 4: one sequence x 8,000 keys
  // 8.5-8.8 -> 7.4-7.5 ms, two x 4,000 8.4-8.8 -> 7.5-7.8.
  const int64_t threads = omp_get_max_threads();
  std::vector<Item> whole;
  auto ranges = [&] {  // the items with keys to see that the split below would make of `whole` (a prompt's early
    int64_t n = 0;     // query tiles see none of the later ranges: those items do no work)
    for (const Item& it : whole) n += std::max<int64_t>(1, (last_key(a, it) + range_keys) / range_keys);
    return n;
  };
  for (const int64_t heads : {a.kv_heads, int64_t{1}}) {
    whole.clear();
    for (int64_t s = 0; s < a.seqs; ++s) {
      const int64_t q_len = a.q_starts[s + 1] - a.q_starts[s];
      if (q_len == 0) continue;
      for (int64_t h = 0; h < a.kv_heads; h += heads)  // latest queries first: the longest items start early
        for (int64_t start = (q_len - 1) / kQueryTile * kQueryTile; start >= 0; start -= kQueryTile)
          whole.push_back({s, h, heads, start, std::min(kQueryTile, q_len - start), 0, a.context_lens[s], -1});
    }
    if (static_cast<int64_t>(whole.size()) >= 2 * threads || ranges() >= 2 * threads) break;
  }
  // Few items (decode of a sequence or two): split each one's keys so that every thread has work.
  const int64_t count = static_cast<int64_t>(whole.size());
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first item, splits)
  Partials partials;
  // The calling thread's slots, kept between calls and only ever grown: sized range by range here, they
  // were reallocated, copied and zero-filled every call (decode of one sequence, the default model:
  // ~40 KiB a range, ~10 ranges a layer), 2.3% of a batch-1 decode step's samples, the team waiting.
  thread_local std::vector<float> slots;
  int64_t used = 0;
  if (count > 0 && count < 2 * threads) {
    const int64_t group = a.q_heads / a.kv_heads;
    partials.rows = whole.front().heads * kQueryTile * group, partials.row_floats = a.head_dim + 2;
    for (const Item& it : whole) {
      const int64_t keys = it.key_end, step = range_keys;  // one range a split item: see kRangeKeys
      const int64_t splits = (keys + step - 1) / step;
      if (splits <= 1) {
        items.push_back(it);
        continue;
      }
      merges.emplace_back(static_cast<int64_t>(items.size()), splits);
      for (int64_t s = 0; s < splits; ++s) {
        Item part = it;
        part.key_begin = s * step, part.key_end = std::min(keys, (s + 1) * step);
        part.partial = used++;
        items.push_back(part);
      }
    }
    const size_t floats = static_cast<size_t>(used * partials.rows * partials.row_floats);
    if (slots.size() < floats) slots.resize(floats);
    partials.data = slots.data();
  } else {
    items = std::move(whole);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  WorkQueue queue(n);
#pragma omp parallel
  {
    Scratch<C> st(key_tile, a.head_dim);
    st.range_keys = range_keys;
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
  if (a.cache_dtype == DType::f16) return f32 ? attention_impl<float, f16>(a) : attention_impl<bf16, f16>(a);
  if (f32 && cache_f32) return attention_impl<float, float>(a);
  if (cache_f32) return attention_impl<bf16, float>(a);
  if constexpr (kHasBf16Dot) {
    if (bf16_dot()) return f32 ? attention_impl<float, bf16, true>(a) : attention_impl<bf16, bf16, true>(a);
  }
  f32 ? attention_impl<float, bf16>(a) : attention_impl<bf16, bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
