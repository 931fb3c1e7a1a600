// Attention over the paged KV cache, for decode and for prefill/extend alike.
//
// One work item is (sequence, KV head, tile of up to kQueryTile new queries): all query heads that
// share the KV head (GQA) go through the cache blocks together, so each block is read once per item.
// Softmax is online (running max and sum per query row, rescaled per block), in float32.
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
namespace {

constexpr int64_t kQueryTile = 8;

struct Item {
  int64_t seq, kv_head, tile_start, tile_len;
};

template <typename T>
float dot(const float* q, const T* k, int64_t n) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= n; i += VecF::N) acc = VecF::fmadd(VecF::load(q + i), VecF::load(k + i), acc);
  float s = acc.reduce_add();
  for (; i < n; ++i) s += q[i] * to_float(k[i]);
  return s;
}

// acc = acc * keep + p * v
template <typename T>
void accumulate(float* acc, float keep, float p, const T* v, int64_t n) {
  VecF kv = VecF::set1(keep), pv = VecF::set1(p);
  int64_t i = 0;
  for (; i + VecF::N <= n; i += VecF::N) VecF::fmadd(pv, VecF::load(v + i), VecF::load(acc + i) * kv).store(acc + i);
  for (; i < n; ++i) acc[i] = acc[i] * keep + p * to_float(v[i]);
}

// scores[j] = exp(scores[j] - max), returns their sum
float exp_shifted(float* scores, int64_t n, float max) {
  VecF m = VecF::set1(max), total = VecF::zero();
  int64_t j = 0;
  for (; j + VecF::N <= n; j += VecF::N) {
    VecF e = exp(VecF::load(scores + j) - m);
    e.store(scores + j);
    total = total + e;
  }
  float sum = total.reduce_add();
  for (; j < n; ++j) sum += (scores[j] = std::exp(scores[j] - max));
  return sum;
}

struct RowState {
  std::vector<float> q, acc, m, l, scores;
  std::vector<int64_t> pos;
};

template <typename T>
void run_item(const AttentionArgs& a, const Item& it, RowState& st) {
  const int64_t D = a.head_dim, B = a.block_size, group = a.q_heads / a.kv_heads;
  const int64_t rows = it.tile_len * group;
  const int64_t ctx = a.context_lens[it.seq];
  const int64_t q0 = a.q_starts[it.seq], first_pos = ctx - (a.q_starts[it.seq + 1] - q0);
  st.q.resize(rows * D); st.acc.assign(rows * D, 0.f); st.scores.resize(B);
  st.m.assign(rows, -std::numeric_limits<float>::infinity()); st.l.assign(rows, 0.f); st.pos.resize(rows);
  const T* q = static_cast<const T*>(a.q);
  for (int64_t r = 0; r < rows; ++r) {  // row r: query tile_start + r / group, head kv_head*group + r % group
    const int64_t token = q0 + it.tile_start + r / group, head = it.kv_head * group + r % group;
    const T* src = q + token * a.q_stride + head * D;
    for (int64_t d = 0; d < D; ++d) st.q[r * D + d] = to_float(src[d]) * a.scale;
    st.pos[r] = first_pos + it.tile_start + r / group;
  }
  const int64_t last = st.pos[rows - 1];
  const T* kc = static_cast<const T*>(a.key_cache);
  const T* vc = static_cast<const T*>(a.value_cache);
  for (int64_t b = 0; b * B <= last; ++b) {
    const int64_t block = a.block_tables[it.seq * a.max_blocks_per_seq + b];
    const T* kb = kc + (block * a.kv_heads + it.kv_head) * B * D;
    const T* vb = vc + (block * a.kv_heads + it.kv_head) * B * D;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(B, st.pos[r] - b * B + 1);  // causal: keys up to the query's position
      if (visible <= 0) continue;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        st.scores[j] = dot(&st.q[r * D], kb + j * D, D);
        block_max = std::max(block_max, st.scores[j]);
      }
      const float m_new = std::max(st.m[r], block_max);
      const float keep = std::exp(st.m[r] - m_new);  // 0 on the first block (m = -inf)
      st.l[r] = st.l[r] * keep + exp_shifted(st.scores.data(), visible, m_new);
      float* acc = &st.acc[r * D];
      for (int64_t j = 0; j < visible; ++j) accumulate(acc, j == 0 ? keep : 1.f, st.scores[j], vb + j * D, D);
      st.m[r] = m_new;
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q0 + it.tile_start + r / group, head = it.kv_head * group + r % group;
    T* dst = out + token * a.out_stride + head * D;
    const float inv = 1.f / st.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(st.acc[r * D + d] * inv);
  }
}

template <typename T>
void attention_impl(const AttentionArgs& a) {
  std::vector<Item> items;
  for (int64_t s = 0; s < a.seqs; ++s) {
    const int64_t q_len = a.q_starts[s + 1] - a.q_starts[s];
    for (int64_t h = 0; h < a.kv_heads; ++h)
      for (int64_t start = 0; start < q_len; start += kQueryTile)
        items.push_back({s, h, start, std::min(kQueryTile, q_len - start)});
  }
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    RowState state;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item<T>(a, items[i], state);
  }
}

}  // namespace

void paged_attention(const AttentionArgs& a) {
  if (a.dtype == DType::f32) attention_impl<float>(a);
  else attention_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
