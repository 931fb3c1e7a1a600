// DecoderStack::run: one step of every layer, as app/model/layers.py runs it (see decoder.h).
#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace appliance {
namespace {

// A layer's second half (o, norm, gate/up, SiLU, down: row-wise) runs on slabs of at most this many rows,
// so that a large prefill step's MLP intermediate (2 x inter wide: 25 MB at 2048 rows of the default
// model) stays in cache, and each linear splits its panels among work items as at 256 rows. 8 x 256-token
// prompts in one step, three alternated rounds on Zen 5: 795-813 -> 728-753 ms; 4 x 256 1.5% faster,
// 2 x 256 2%; decode steps (at most 256 rows) run as before. 128 and 512 measured the same as 256.
constexpr int64_t kMlpRows = 256;
// A mixture of experts runs on chunks of this many rows: each expert reads its weights once a chunk, and a
// 256-row slab gives each of Qwen3-30B-A3B's 128 experts ~16 rows (8 of them a token), so a 2048-token prefill
// read every expert 8 times; 1024 rows hold the routed rows' scratch at ~200 MB (float32, hidden 2,048).
constexpr int64_t kMoeRows = 1024;
// A mixture's gather of routed rows and weighted sum back run on the threads from this many elements
constexpr int64_t kGatherElements = 1 << 16;

int64_t element_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// y[:n] = x[:n] in dt (bfloat16: rounded to nearest even)
void store(DType dt, void* y, const float* x, int64_t n) {
  if (dt == DType::f32) {
    std::memcpy(y, x, n * 4);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(y);
#pragma omp parallel for schedule(static) if (n >= kGatherElements)
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(x[i]);
}

// x[t, :] += bias for T rows of width n (contiguous)
void add_bias(DType dt, void* x, const void* bias, int64_t tokens, int64_t n) {
  if (dt == DType::f32) {
    float* y = static_cast<float*>(x);
    const float* b = static_cast<const float*>(bias);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < n; ++i) y[t * n + i] += b[i];
    return;
  }
  uint16_t* y = static_cast<uint16_t*>(x);
  const uint16_t* b = static_cast<const uint16_t*>(bias);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < n; ++i) y[t * n + i] = float_to_bf16(bf16_to_float(y[t * n + i]) + bf16_to_float(b[i]));
}

// out[t, :w.rows] = in[t, :] @ w^T (in: rows of w.in_features), each part into its own columns of out's rows; a
// call for each run of rows of one role (prompt tokens or not, see RowRun)
void linear(const PackedMatrix& w, ActQuant act, DType in_dt, DType out_dt, void* out, const void* in,
            const std::vector<RowRun>& runs, int64_t out_stride) {
  for (const RowRun& run : runs) {
    const uint8_t* x = static_cast<const uint8_t*>(in) + run.begin * w.in_features * element_bytes(in_dt);
    uint8_t* y = static_cast<uint8_t*>(out) + run.begin * out_stride * element_bytes(out_dt);
    int64_t column = 0;
    for (const PackedPart& p : w.parts) {
      kernels().packed_linear({p.qtype, act, in_dt, out_dt, y + column * element_bytes(out_dt), x, p.data,
                               run.end - run.begin, w.in_features, p.rows, w.in_features, out_stride, run.prompt});
      column += p.rows;
    }
  }
}

}  // namespace

void* DecoderStack::buffer(size_t index, int64_t bytes) {
  if (scratch_.size() <= index) scratch_.resize(index + 1);
  if (scratch_[index].size() < static_cast<size_t>(bytes)) scratch_[index].resize(bytes);
  return scratch_[index].data();
}

// The step's rows in runs of one role: prompt tokens (a sequence's first prompt_rows) or generated ones. Where the
// kernels run a weight type's prompt rows their own way (kernels().widens_prompts(type), int16), each run takes its
// own linears, so a token's path is its role's however it was scheduled (chunked, after a prefix hit, recomputed);
// else one run.
void DecoderStack::find_runs(const StepBatch& b) {
  runs_.clear();
  const bool split = shape_.act == ActQuant::int16 &&
                     std::any_of(qtypes_.begin(), qtypes_.end(), [](QType t) { return kernels().widens_prompts(t); });
  auto add = [&](int64_t begin, int64_t end, bool prompt) {
    if (begin == end) return;
    if (!runs_.empty() && runs_.back().prompt == prompt) runs_.back().end = end;
    else runs_.push_back({begin, end, prompt});
  };
  for (int64_t s = 0; s < b.seqs; ++s) {
    const int64_t middle = b.q_starts[s] + (split ? b.prompt_rows[s] : 0);
    add(b.q_starts[s], middle, true);
    add(middle, b.q_starts[s + 1], false);
  }
}

// The runs within rows [t0, t0 + n), from t0 on
const std::vector<RowRun>& DecoderStack::slab_runs(int64_t t0, int64_t n) {
  slab_.clear();
  for (const RowRun& r : runs_) {
    const int64_t begin = std::max(r.begin, t0), end = std::min(r.end, t0 + n);
    if (begin < end) slab_.push_back({begin - t0, end - t0, r.prompt});
  }
  return slab_;
}

// x = in @ w^T for the rows of `runs`, summed over the tensor-parallel group (float32 partials, one rounding to
// bfloat16 after)
void DecoderStack::row_parallel(const PackedMatrix& w, const void* in, void* x, const std::vector<RowRun>& runs) {
  const DType dt = shape_.dtype;
  const int64_t H = shape_.hidden, tokens = runs.empty() ? 0 : runs.back().end;
  if (!group_ || dt == DType::f32) {
    linear(w, shape_.act, dt, dt, x, in, runs, H);
    if (group_) group_->all_reduce(x, tokens * H, 0);
    return;
  }
  float* partial = static_cast<float*>(buffer(5, tokens * H * 4));
  linear(w, shape_.act, dt, DType::f32, partial, in, runs, H);
  group_->all_reduce(partial, tokens * H, 0);
  store(dt, x, partial, tokens * H);
}

// The n rows of x (a slab, after the post-attention norm) through a mixture of experts, in place, as MoE in
// app/model/layers.py: the router's float32 logits, a softmax over the experts, the top k (the lower expert first
// among equal scores), rescaled to sum to 1 where the model says; the (token, choice) pairs grouped by expert in
// token order, each expert's rows gathered and run through its gate/up, SiLU and down (float32, unreduced) into
// its slice of one buffer; each token's outputs weighed and summed in float32, over the TP group once, into x.
void DecoderStack::mixture(const Experts& e, void* x, int64_t n, const std::vector<RowRun>& runs) {
  const DType dt = shape_.dtype;
  const int64_t H = shape_.hidden, E = static_cast<int64_t>(e.gate_up.size()), K = e.top_k, B = element_bytes(dt);
  const int64_t pairs = n * K;
  float* scores = static_cast<float*>(buffer(6, n * E * 4));
  kernels().linear_f32_out({dt, scores, x, e.router, n, H, E, H});
  choice_expert_.resize(pairs), choice_weight_.resize(pairs), choice_order_.resize(pairs);
  expert_count_.assign(E + 1, 0);
  std::vector<int64_t>& ranked = ranked_;
  ranked.resize(E);
  for (int64_t t = 0; t < n; ++t) {
    float* p = scores + t * E;
    const float top = *std::max_element(p, p + E);
    float sum = 0.f;
    for (int64_t i = 0; i < E; ++i) sum += (p[i] = std::exp(p[i] - top));
    for (int64_t i = 0; i < E; ++i) p[i] /= sum;
    for (int64_t i = 0; i < E; ++i) ranked[i] = i;
    if (std::isfinite(sum))  // (a row that is not: NaN weights on the first k, so NaN logits and no token)
      std::partial_sort(ranked.begin(), ranked.begin() + K, ranked.end(),
                        [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float chosen = 0.f;
    for (int64_t j = 0; j < K; ++j) chosen += p[ranked[j]];
    for (int64_t j = 0; j < K; ++j) {
      choice_expert_[t * K + j] = ranked[j];
      choice_weight_[t * K + j] = e.renormalize ? p[ranked[j]] / chosen : p[ranked[j]];
      ++expert_count_[ranked[j] + 1];
    }
  }
  for (int64_t i = 0; i < E; ++i) expert_count_[i + 1] += expert_count_[i];  // each expert's first routed row
  std::vector<int64_t>& row_of = row_of_;  // each pair's routed row
  row_of.resize(pairs);
  next_row_.assign(expert_count_.begin(), expert_count_.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {  // in token order within each expert
    row_of[i] = next_row_[choice_expert_[i]]++;
    choice_order_[row_of[i]] = i;
  }
  std::vector<char>& prompt = prompt_rows_;
  prompt.assign(n, 0);
  for (const RowRun& r : runs) std::fill(prompt.begin() + r.begin, prompt.begin() + r.end, r.prompt);
  uint8_t* routed = static_cast<uint8_t*>(buffer(7, pairs * H * B));
  float* outputs = static_cast<float*>(buffer(8, pairs * H * 4));
#pragma omp parallel for schedule(static) if (pairs * H >= kGatherElements)
  for (int64_t r = 0; r < pairs; ++r)
    std::memcpy(routed + r * H * B, static_cast<const uint8_t*>(x) + (choice_order_[r] / K) * H * B, H * B);
  const bool singles = one_row_experts(e, routed, outputs, prompt);
  for (int64_t i = 0; i < E; ++i) {
    const int64_t begin = expert_count_[i], count = expert_count_[i + 1] - begin;
    if (count == 0 || (singles && count == 1)) continue;
    const int64_t inter = e.gate_up[i].rows / 2;
    void* gate_up = buffer(9, count * 2 * inter * B);
    void* act = buffer(10, count * inter * B);
    expert_runs_.clear();
    for (int64_t r = 0; r < count; ++r) {
      const bool role = prompt[choice_order_[begin + r] / K];
      if (!expert_runs_.empty() && expert_runs_.back().prompt == role) expert_runs_.back().end = r + 1;
      else expert_runs_.push_back({r, r + 1, role});
    }
    linear(e.gate_up[i], shape_.act, dt, dt, gate_up, routed + begin * H * B, expert_runs_, 2 * inter);
    kernels().silu_and_mul({dt, act, gate_up, count, inter, 2 * inter, inter});
    linear(e.down[i], shape_.act, dt, DType::f32, outputs + begin * H, act, expert_runs_, H);
  }
  float* out = static_cast<float*>(buffer(11, n * H * 4));
#pragma omp parallel for schedule(static) if (pairs * H >= kGatherElements)
  for (int64_t t = 0; t < n; ++t) {
    float* o = out + t * H;
    std::fill(o, o + H, 0.f);
    for (int64_t j = 0; j < K; ++j) {
      const float w = choice_weight_[t * K + j];
      const float* y = outputs + row_of[t * K + j] * H;
      for (int64_t c = 0; c < H; ++c) o[c] += w * y[c];
    }
  }
  if (group_) group_->all_reduce(out, n * H, 0);
  store(dt, x, out, n * H);
}

// The experts with one routed row (each of a decode step's at one token, most at a few): their gate/up in one call
// of the kernels, their SiLU, their down in another (kernels().packed_linears: one region each), rather than three
// regions an expert; into the rows of `outputs` that mixture() gives them. The same tiles, so the same bits. False
// where fewer than two such experts or their features differ, which mixture() then runs one at a time. A 4-layer
// Qwen3-30B-A3B-shaped Q4_K file on Zen 4 (2 vCPUs), both ways alternated in one process, paired medians of 12:
// the layers' decode step 0.97-1.0 of before at batch 1 (~28 GB/s of weights: at the memory's rate either way),
// 0.96 at 2, 0.91-0.97 at 4, 0.96 at 8, 0.99 at 16; with many cores a region an expert costs more.
bool DecoderStack::one_row_experts(const Experts& e, const uint8_t* routed, float* outputs,
                                   const std::vector<char>& prompt) {
  const DType dt = shape_.dtype;
  const int64_t H = shape_.hidden, E = static_cast<int64_t>(e.gate_up.size()), B = element_bytes(dt);
  singles_.clear();
  for (int64_t i = 0; i < E; ++i)
    if (expert_count_[i + 1] - expert_count_[i] == 1) singles_.push_back(i);
  if (singles_.size() < 2) return false;
  const int64_t inter = e.gate_up[singles_[0]].rows / 2, S = static_cast<int64_t>(singles_.size());
  for (int64_t i : singles_)
    if (e.gate_up[i].rows != 2 * inter) return false;
  uint8_t* gate_up = static_cast<uint8_t*>(buffer(9, S * 2 * inter * B));
  uint8_t* act = static_cast<uint8_t*>(buffer(10, S * inter * B));
  // each single's rows of w: its input row in_of(s, row), its output row out_of(s, row) (row: its routed row)
  auto run = [&](const std::vector<PackedMatrix>& w, DType out_dt, int64_t out_stride, auto in_of, auto out_of) {
    calls_.clear();
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = singles_[s], row = expert_count_[i];
      const bool role = prompt[choice_order_[row] / e.top_k];
      uint8_t* y = out_of(s, row);
      int64_t column = 0;
      for (const PackedPart& p : w[i].parts) {
        calls_.push_back({p.qtype, shape_.act, dt, out_dt, y + column * element_bytes(out_dt), in_of(s, row), p.data,
                          1, w[i].in_features, p.rows, w[i].in_features, out_stride, role});
        column += p.rows;
      }
    }
    kernels().packed_linears(calls_.data(), static_cast<int64_t>(calls_.size()));
  };
  run(e.gate_up, dt, 2 * inter, [&](int64_t, int64_t row) { return routed + row * H * B; },
      [&](int64_t s, int64_t) { return gate_up + s * 2 * inter * B; });
  kernels().silu_and_mul({dt, act, gate_up, S, inter, 2 * inter, inter});
  run(e.down, DType::f32, H, [&](int64_t s, int64_t) { return act + s * inter * B; },
      [&](int64_t, int64_t row) { return reinterpret_cast<uint8_t*>(outputs + row * H); });
  return true;
}

// The rows whose final hidden state the step gives (b.hidden_rows: each sequence's last ones) into kept_, with
// each sequence's first among them (kept_starts_) and its prompt rows among them (kept_prompt_); returns how many.
int64_t DecoderStack::find_kept(const StepBatch& b) {
  kept_.clear(), kept_starts_.assign(1, 0), kept_prompt_.clear();
  for (int64_t s = 0; s < b.seqs; ++s) {
    const int64_t rows = b.q_starts[s + 1] - b.q_starts[s];
    const int64_t keep = b.hidden_rows ? std::clamp<int64_t>(b.hidden_rows[s], 0, rows) : rows;
    for (int64_t t = b.q_starts[s + 1] - keep; t < b.q_starts[s + 1]; ++t) kept_.push_back(t);
    kept_starts_.push_back(static_cast<int64_t>(kept_.size()));
    kept_prompt_.push_back(std::max<int64_t>(0, b.prompt_rows[s] - (rows - keep)));  // (prompt rows come first)
  }
  return static_cast<int64_t>(kept_.size());
}

// A layer's second half on `rows` rows (runs_ says their roles): o, the residual add and norm, then the MLP or
// the experts; x: the attention's projection in, the layer's output out, in place
void DecoderStack::second_half(const DecoderLayerWeights& l, void* x, uint8_t* residual, const void* attn,
                               int64_t rows) {
  const DecoderShape& s = shape_;
  const DType dt = s.dtype;
  const int64_t H = s.hidden, E = element_bytes(dt), q_width = s.q_heads * s.head_dim;
  const int64_t mlp_rows = std::min(rows, kMlpRows);
  void* gate_up = buffer(3, mlp_rows * 2 * s.inter * E);
  void* act = buffer(4, mlp_rows * s.inter * E);
  for (int64_t t0 = 0; t0 < rows; t0 += kMlpRows) {  // row-wise from here on: a slab of rows at a time
    const int64_t n = std::min(kMlpRows, rows - t0);
    uint8_t* xs = static_cast<uint8_t*>(x) + t0 * H * E;
    const std::vector<RowRun>& runs = slab_runs(t0, n);
    row_parallel(l.o, static_cast<const uint8_t*>(attn) + t0 * q_width * E, xs, runs);
    kernels().add_rms_norm({dt, xs, residual + t0 * H * E, l.post_norm, n, H, H, H, s.eps});
    if (l.experts.router) continue;  // the experts below, on more rows at a time
    linear(l.gate_up, s.act, dt, dt, gate_up, xs, runs, 2 * s.inter);
    kernels().silu_and_mul({dt, act, gate_up, n, s.inter, 2 * s.inter, s.inter});
    row_parallel(l.down, act, xs, runs);
  }
  for (int64_t t0 = 0; l.experts.router && t0 < rows; t0 += kMoeRows) {
    const int64_t n = std::min(kMoeRows, rows - t0);
    mixture(l.experts, static_cast<uint8_t*>(x) + t0 * H * E, n, slab_runs(t0, n));
  }
}

// Every layer on every row, but the last layer's second half, attention included, only on the rows whose final
// hidden state is wanted (llama.cpp's way): a prompt's other rows need only their keys and values there. A
// 128-token prompt of the default model saves 2.8% of its linears this way, a prompt chunk that samples nothing
// its last layer's whole second half. Each kept row's arithmetic is what it would be among all rows (the kernels'
// results do not depend on the rows beside them), so the bits are the same.
void DecoderStack::run(void* x, const StepBatch& b) {
  const DecoderShape& s = shape_;
  const DType dt = s.dtype;
  const int64_t T = b.tokens, H = s.hidden, D = s.head_dim, E = element_bytes(dt);
  const int64_t q_width = s.q_heads * D, kv_width = s.kv_heads * D, qkv_width = q_width + 2 * kv_width;
  uint8_t* residual = static_cast<uint8_t*>(buffer(0, T * H * E));
  uint8_t* qkv = static_cast<uint8_t*>(buffer(1, T * qkv_width * E));
  void* attn = buffer(2, T * q_width * E);
  find_runs(b);
  const int64_t K = find_kept(b);
  std::memset(residual, 0, T * H * E);  // so the first layer's add_rms_norm makes residual = x (zero bits are 0.0)
  for (const DecoderLayerWeights& l : layers_) {
    kernels().add_rms_norm({dt, x, residual, l.input_norm, T, H, H, H, s.eps});
    linear(l.qkv, s.act, dt, dt, qkv, x, runs_, qkv_width);
    if (l.qkv_bias) add_bias(dt, qkv, l.qkv_bias, T, qkv_width);
    if (l.q_norm) {  // each head of Q, then of K (they follow Q's in a row), normalized in place, all tokens a call
      for (int64_t h = 0; h < s.q_heads + s.kv_heads; ++h) {
        void* head = qkv + h * D * E;
        kernels().rms_norm({dt, head, head, h < s.q_heads ? l.q_norm : l.k_norm, T, D, qkv_width, qkv_width, s.eps});
      }
    }
    void* q = qkv;
    void* k = qkv + q_width * E;
    void* v = qkv + (q_width + kv_width) * E;
    kernels().rotary_embedding({dt, q, k, b.positions, s.cos_sin, T, s.q_heads, s.kv_heads, D, s.rot_dim, qkv_width,
                                qkv_width, s.max_position});
    kernels().write_kv_cache({dt, k, v, l.key_cache, l.value_cache, b.slot_mapping, T, s.kv_heads, D, s.block_size,
                              s.num_blocks, qkv_width, qkv_width, s.cache_dtype});
    if (&l != &layers_.back() || K == T) {
      kernels().paged_attention({dt, attn, q, l.key_cache, l.value_cache, b.block_tables, b.context_lens, b.q_starts,
                                 b.seqs, s.q_heads, s.kv_heads, D, s.block_size, b.max_blocks_per_seq, s.num_blocks,
                                 qkv_width, q_width, s.scale, s.cache_dtype});
      second_half(l, x, residual, attn, T);
      continue;
    }
    // the last layer on the kept rows: their queries and residuals gathered, the result scattered back into x
    uint8_t* kept_q = static_cast<uint8_t*>(buffer(12, K * q_width * E));
    uint8_t* kept_residual = static_cast<uint8_t*>(buffer(13, K * H * E));
    uint8_t* kept_x = static_cast<uint8_t*>(buffer(14, K * H * E));
    for (int64_t r = 0; r < K; ++r) {
      std::memcpy(kept_q + r * q_width * E, qkv + kept_[r] * qkv_width * E, q_width * E);
      std::memcpy(kept_residual + r * H * E, residual + kept_[r] * H * E, H * E);
    }
    kernels().paged_attention({dt, attn, kept_q, l.key_cache, l.value_cache, b.block_tables, b.context_lens,
                               kept_starts_.data(), b.seqs, s.q_heads, s.kv_heads, D, s.block_size,
                               b.max_blocks_per_seq, s.num_blocks, q_width, q_width, s.scale, s.cache_dtype});
    find_runs({nullptr, nullptr, b.block_tables, b.context_lens, kept_starts_.data(), kept_prompt_.data(), nullptr, K,
               b.seqs, b.max_blocks_per_seq});
    second_half(l, kept_x, kept_residual, attn, K);
    kernels().add_rms_norm({dt, kept_x, kept_residual, s.final_norm, K, H, H, H, s.eps});
    for (int64_t r = 0; r < K; ++r)
      std::memcpy(static_cast<uint8_t*>(x) + kept_[r] * H * E, kept_x + r * H * E, H * E);
    return;
  }
  kernels().add_rms_norm({dt, x, residual, s.final_norm, T, H, H, H, s.eps});
}

}  // namespace appliance
