// A Llama-family decoder stack run in one native call a step: every layer's norms, kept-quantized
// linears, RoPE, cache write and attention, then the final norm, with no Python between them.
//
// It strings together the same kernels app/model/layers.py calls one by one (through kernels(), so the
// ISA is the one dispatch picked), on scratch buffers it owns; a row-parallel layer's float32 partial
// sums go through the tensor-parallel group's all-reduce when there is one; a mixture of experts routes each
// token to its experts in it too. What it does not cover (dense float weights, float activations) stays on the
// Python path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "collective.h"
#include "kernels.h"

namespace appliance {

struct PackedPart {  // rows of a packed weight (see PackedLayout)
  const uint8_t* data;
  QType qtype;
  int64_t rows;
};

struct PackedMatrix {  // a [rows, in_features] weight: one part, or a fused projection's parts that differ in type
  std::vector<PackedPart> parts;  // stacked by rows: each fills its own columns of the output
  int64_t rows, in_features;
};

struct Experts {  // a mixture of experts in place of the MLP (app/model/layers.py MoE), or none (router null)
  const void* router = nullptr;         // [experts, hidden], activation dtype
  std::vector<PackedMatrix> gate_up, down;  // each expert's, its share of the features (unreduced down)
  int64_t top_k = 0;
  bool renormalize = false;             // the chosen weights rescaled to sum to 1
};

struct DecoderLayerWeights {
  PackedMatrix qkv, o, gate_up, down;  // qkv rows: this rank's Q heads, then K, then V; gate_up: [gate | up]
                                       // (gate_up, down: empty in a layer of experts)
  const void* input_norm;              // [hidden], activation dtype
  const void* post_norm;
  const void* qkv_bias;                // [qkv rows] or null
  const void* q_norm;                  // [head_dim] or null: an RMSNorm over each head of Q before RoPE (Qwen3)
  const void* k_norm;                  // [head_dim], with q_norm: the same over each head of K
  void* key_cache;                     // [blocks, Hk, D, B]
  void* value_cache;                   // [blocks, Hk, B, D]
  Experts experts;
};

struct DecoderShape {
  DType dtype, cache_dtype;
  ActQuant act;
  int64_t hidden, q_heads, kv_heads, head_dim, inter, rot_dim, max_position, block_size, num_blocks;
  float eps, scale;
  const float* cos_sin;    // [max_position, rot_dim]
  const void* final_norm;  // [hidden]
};

struct StepBatch {  // as ForwardBatch (app/model/batch.py)
  const int64_t* positions;     // [T]
  const int64_t* slot_mapping;  // [T]
  const int32_t* block_tables;  // [S, max_blocks_per_seq]
  const int32_t* context_lens;  // [S]
  const int64_t* q_starts;      // [S + 1]
  const int64_t* prompt_rows;   // [S]: how many of each sequence's rows (its first) are prompt tokens
  // [S], or null for all: how many of each sequence's rows (its last) need their final hidden state (the rows it
  // samples, or a prompt's every row for its logprobs); the others' keys and values are all the last layer computes
  const int64_t* hidden_rows;
  int64_t tokens, seqs, max_blocks_per_seq;
};

struct RowRun {  // rows [begin, end) of a step, all prompt tokens or none (PackedLinearArgs::prompt)
  int64_t begin, end;
  bool prompt;
};

class DecoderStack {
 public:
  DecoderStack(const DecoderShape& shape, ShmGroup* group) : shape_(shape), group_(group) {}
  void add_layer(const DecoderLayerWeights& layer) {
    layers_.push_back(layer);
    std::vector<const PackedMatrix*> matrices{&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (size_t e = 0; e < layer.experts.gate_up.size(); ++e)
      matrices.insert(matrices.end(), {&layer.experts.gate_up[e], &layer.experts.down[e]});
    for (const PackedMatrix* m : matrices)
      for (const PackedPart& p : m->parts)
        if (std::find(qtypes_.begin(), qtypes_.end(), p.qtype) == qtypes_.end()) qtypes_.push_back(p.qtype);
  }
  void set_cache_shape(DType dtype, int64_t block_size, int64_t num_blocks) {
    shape_.cache_dtype = dtype, shape_.block_size = block_size, shape_.num_blocks = num_blocks;
  }
  size_t num_layers() const { return layers_.size(); }
  const DecoderShape& shape() const { return shape_; }

  // x: [T, hidden] contiguous, the embeddings in; the final hidden states (after the last norm) out, in the rows
  // batch.hidden_rows asks for (the others' are left as they are).
  void run(void* x, const StepBatch& batch);

 private:
  void find_runs(const StepBatch& batch);
  int64_t find_kept(const StepBatch& batch);
  void second_half(const DecoderLayerWeights& l, void* x, uint8_t* residual, const void* attn, int64_t rows);
  const std::vector<RowRun>& slab_runs(int64_t t0, int64_t n);
  void row_parallel(const PackedMatrix& w, const void* in, void* x, const std::vector<RowRun>& runs);
  void mixture(const Experts& e, void* x, int64_t n, const std::vector<RowRun>& runs);
  bool one_row_experts(const Experts& e, const uint8_t* routed, float* outputs, const std::vector<char>& prompt);
  void* buffer(size_t index, int64_t bytes);

  DecoderShape shape_;
  ShmGroup* group_;  // null: a single rank
  std::vector<DecoderLayerWeights> layers_;
  std::vector<std::vector<uint8_t>> scratch_;
  std::vector<RowRun> runs_, slab_;  // this step's (find_runs), a slab's (slab_runs)
  // the rows whose final hidden state the step gives (find_kept), each sequence's first among them, and how many
  // of each sequence's are prompt rows: the last layer's StepBatch
  std::vector<int64_t> kept_, kept_starts_, kept_prompt_;
  std::vector<QType> qtypes_;        // the weights' types (find_runs: whether any runs prompt rows its own way)
  // mixture(): a slab's (token, choice) pairs grouped by expert
  std::vector<int64_t> choice_expert_, choice_order_, expert_count_, ranked_, row_of_, next_row_;
  std::vector<float> choice_weight_;
  std::vector<char> prompt_rows_;  // each row's role (RowRun::prompt)
  std::vector<RowRun> expert_runs_;
  std::vector<int64_t> singles_;             // the experts of one routed row (one_row_experts)
  std::vector<PackedLinearArgs> calls_;      // their linears
};

}  // namespace appliance
