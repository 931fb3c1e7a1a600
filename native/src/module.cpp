// The one binding file: Python calls land here, every argument is checked, then the kernel runs.
//
// Tensors come from app/kernels/ops.py as (data pointer, dtype code, shape, strides) tuples, so the
// extension needs no torch headers; the checks below make a bad call a ValueError, never a crash.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "binding.h"
#include "collective.h"
#include "decoder.h"
#include "kernels.h"

namespace py = pybind11;
using namespace appliance;

namespace {

enum Code : int { F32 = 0, BF16 = 1, I32 = 2, I64 = 3, U8 = 4, F16 = 5 };
using Ref = std::tuple<uintptr_t, int, std::vector<int64_t>, std::vector<int64_t>>;

struct T {
  void* ptr;
  int code;
  std::vector<int64_t> shape, stride;
  std::string name;
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
  int64_t st(int i) const { return stride[i < 0 ? stride.size() + i : i]; }
};

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

void require(bool ok, const std::string& message) {
  if (!ok) fail(message);
}

T tensor(const Ref& ref, const char* name, size_t dims) {
  T t{reinterpret_cast<void*>(std::get<0>(ref)), std::get<1>(ref), std::get<2>(ref), std::get<3>(ref), name};
  require(t.ptr != nullptr, t.name + ": null data pointer");
  require(t.shape.size() == dims && t.stride.size() == dims,
          t.name + ": expected " + std::to_string(dims) + " dimensions, got " + std::to_string(t.shape.size()));
  for (size_t i = 0; i < dims; ++i) require(t.shape[i] >= 0 && t.stride[i] >= 0, t.name + ": negative size or stride");
  require(dims == 0 || t.stride[dims - 1] == 1 || t.shape[dims - 1] <= 1, t.name + ": last dimension must be contiguous");
  return t;
}

void contiguous(const T& t) {
  int64_t expected = 1;
  for (int i = static_cast<int>(t.shape.size()) - 1; i >= 0; --i) {
    require(t.shape[i] <= 1 || t.stride[i] == expected, t.name + ": must be contiguous");
    expected *= t.shape[i];
  }
}

DType float_type(const T& t) {
  require(t.code == F32 || t.code == BF16, t.name + ": dtype must be float32 or bfloat16");
  return t.code == F32 ? DType::f32 : DType::bf16;
}

// A KV cache's: float32, bfloat16 or float16
DType cache_type(const T& t) {
  require(t.code == F32 || t.code == BF16 || t.code == F16, t.name + ": dtype must be float32, bfloat16 or float16");
  return t.code == F32 ? DType::f32 : t.code == BF16 ? DType::bf16 : DType::f16;
}

void same_type(const T& a, const T& b) { require(a.code == b.code, b.name + ": dtype differs from " + a.name); }

void integer(const T& t, int code) {
  require(t.code == code, t.name + (code == I32 ? ": dtype must be int32" : ": dtype must be int64"));
  contiguous(t);
}

void heads_rows(const T& t, int64_t tokens, int64_t heads, int64_t dim) {  // [T, H, D], heads packed in a row
  require(t.dim(0) == tokens && t.dim(1) == heads && t.dim(2) == dim,
          t.name + ": shape must be [" + std::to_string(tokens) + ", " + std::to_string(heads) + ", " +
              std::to_string(dim) + "]");
  require(t.st(1) == dim || heads <= 1, t.name + ": heads of a token must be contiguous");
}

void rms_norm(const Ref& out_r, const Ref& x_r, const Ref& w_r, float eps) {
  T out = tensor(out_r, "out", 2), x = tensor(x_r, "x", 2), w = tensor(w_r, "weight", 1);
  DType dt = float_type(x);
  same_type(x, out), same_type(x, w), contiguous(w);
  require(out.shape == x.shape && w.dim(0) == x.dim(1), "rms_norm: x, out must be [T, H] and weight [H]");
  require(eps > 0.f, "rms_norm: eps must be positive");
  kernels().rms_norm({dt, out.ptr, x.ptr, w.ptr, x.dim(0), x.dim(1), x.st(0), out.st(0), eps});
}

void add_rms_norm(const Ref& x_r, const Ref& res_r, const Ref& w_r, float eps) {
  T x = tensor(x_r, "x", 2), res = tensor(res_r, "residual", 2), w = tensor(w_r, "weight", 1);
  DType dt = float_type(x);
  same_type(x, res), same_type(x, w), contiguous(w);
  require(res.shape == x.shape && w.dim(0) == x.dim(1), "add_rms_norm: x, residual must be [T, H] and weight [H]");
  require(eps > 0.f, "add_rms_norm: eps must be positive");
  kernels().add_rms_norm({dt, x.ptr, res.ptr, w.ptr, x.dim(0), x.dim(1), x.st(0), res.st(0), eps});
}

void rotary_embedding(const Ref& pos_r, const Ref& q_r, const Ref& k_r, const Ref& cs_r) {
  T pos = tensor(pos_r, "positions", 1), q = tensor(q_r, "q", 3), k = tensor(k_r, "k", 3), cs = tensor(cs_r, "cos_sin", 2);
  DType dt = float_type(q);
  same_type(q, k), integer(pos, I64), contiguous(cs);
  require(cs.code == F32, "cos_sin: dtype must be float32");
  const int64_t tokens = pos.dim(0), D = q.dim(2), rot = cs.dim(1);
  heads_rows(q, tokens, q.dim(1), D), heads_rows(k, tokens, k.dim(1), D);
  require(rot % 2 == 0 && rot <= D && rot > 0, "cos_sin: width must be even and at most head_dim");
  const int64_t* p = static_cast<const int64_t*>(pos.ptr);
  for (int64_t t = 0; t < tokens; ++t)
    require(p[t] >= 0 && p[t] < cs.dim(0), "positions: " + std::to_string(p[t]) + " is outside the cos/sin table");
  kernels().rotary_embedding({dt, q.ptr, k.ptr, p, static_cast<const float*>(cs.ptr), tokens, q.dim(1), k.dim(1), D,
                              rot, q.st(0), k.st(0), cs.dim(0)});
}

void silu_and_mul(const Ref& out_r, const Ref& x_r) {
  T out = tensor(out_r, "out", 2), x = tensor(x_r, "x", 2);
  DType dt = float_type(x);
  same_type(x, out);
  require(x.dim(1) % 2 == 0 && out.dim(0) == x.dim(0) && out.dim(1) == x.dim(1) / 2,
          "silu_and_mul: x must be [T, 2I] and out [T, I]");
  kernels().silu_and_mul({dt, out.ptr, x.ptr, x.dim(0), out.dim(1), x.st(0), out.st(0)});
}

// value_cache: [blocks, Hk, B, D]; key_cache: [blocks, Hk, D, B] (transposed within each block; a bfloat16
// cache pairs neighbours within a block, see cache.cpp, so B and D must be even)
void kv_caches(const T& kc, const T& vc) {
  contiguous(kc), contiguous(vc), cache_type(vc), same_type(vc, kc);
  require(cache_type(vc) != DType::bf16 || (vc.dim(2) % 2 == 0 && vc.dim(3) % 2 == 0),
          "value_cache: a bfloat16 cache needs an even block_size and head_dim, got [" + std::to_string(vc.dim(2)) +
              ", " + std::to_string(vc.dim(3)) + "]");
  const std::vector<int64_t> expected{vc.dim(0), vc.dim(1), vc.dim(3), vc.dim(2)};
  require(kc.shape == expected, "key_cache: must be [blocks, kv_heads, head_dim, block_size] = [" +
                                    std::to_string(vc.dim(0)) + ", " + std::to_string(vc.dim(1)) + ", " +
                                    std::to_string(vc.dim(3)) + ", " + std::to_string(vc.dim(2)) +
                                    "] for value_cache [blocks, kv_heads, block_size, head_dim]");
}

void write_kv_cache(const Ref& k_r, const Ref& v_r, const Ref& kc_r, const Ref& vc_r, const Ref& slots_r) {
  T k = tensor(k_r, "key", 3), v = tensor(v_r, "value", 3), kc = tensor(kc_r, "key_cache", 4),
    vc = tensor(vc_r, "value_cache", 4), slots = tensor(slots_r, "slot_mapping", 1);
  DType dt = float_type(k);
  same_type(k, v), kv_caches(kc, vc), integer(slots, I64);
  const int64_t tokens = slots.dim(0), H = vc.dim(1), B = vc.dim(2), D = vc.dim(3);
  heads_rows(k, tokens, H, D), heads_rows(v, tokens, H, D);
  const int64_t* s = static_cast<const int64_t*>(slots.ptr);
  for (int64_t t = 0; t < tokens; ++t)
    require(s[t] < kc.dim(0) * B, "slot_mapping: slot " + std::to_string(s[t]) + " is past the cache's " +
                                      std::to_string(kc.dim(0) * B) + " slots");
  kernels().write_kv_cache({dt, k.ptr, v.ptr, kc.ptr, vc.ptr, s, tokens, H, D, B, kc.dim(0), k.st(0), v.st(0),
                            cache_type(kc)});
}

// Makes blocks [first, last) of every layer's caches resident: one write fault a page, taken now rather than in
// a step's write_kv_cache. Each page's first byte is compare-exchanged with itself (retried where a step's store
// lands in between), so no byte changes and no store of a step is lost (app/engine/resident.py runs this beside the
// engine's steps). A write, not a read: a read maps the shared zero page and the step's first write faults still;
// and not an atomic OR of zero, which LLVM may lower to a fenced load for being idempotent.
void touch_kv_blocks(const std::vector<std::pair<Ref, Ref>>& caches, int64_t first, int64_t last) {
  std::vector<std::pair<char*, int64_t>> ranges;  // (first byte, bytes) of each tensor's blocks
  for (const auto& [k_r, v_r] : caches) {
    T kc = tensor(k_r, "key_cache", 4), vc = tensor(v_r, "value_cache", 4);
    kv_caches(kc, vc);
    require(0 <= first && first <= last && last <= kc.dim(0), "touch_kv_blocks: blocks [" + std::to_string(first) +
                                                                  ", " + std::to_string(last) + ") are outside [0, " +
                                                                  std::to_string(kc.dim(0)) + ")");
    const int64_t element = cache_type(kc) == DType::f32 ? 4 : 2;  // float32; bfloat16, float16
    const int64_t row = kc.dim(1) * kc.dim(2) * kc.dim(3) * element;  // bytes a block, k and v alike (contiguous)
    for (const T* t : {&kc, &vc}) ranges.emplace_back(static_cast<char*>(t->ptr) + first * row, (last - first) * row);
  }
  py::gil_scoped_release release;
  const int64_t page = sysconf(_SC_PAGESIZE);
  for (auto [begin, bytes] : ranges) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(begin), end = start + bytes;
    for (uintptr_t p = start; p < end; p = (p / page + 1) * page) {
      unsigned char* byte = reinterpret_cast<unsigned char*>(p);
      unsigned char seen = 0;  // a fresh page's (a load first would fault twice: the zero page, then its copy)
      while (!__atomic_compare_exchange_n(byte, &seen, seen, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      }
    }
  }
}

void check_sequences(const T& tables, const T& lens, const T& starts, int64_t tq, int64_t blocks, int64_t B) {
  const int64_t S = lens.dim(0), M = tables.dim(1);
  require(tables.dim(0) == S && starts.dim(0) == S + 1, "block_tables, context_lens and q_starts disagree on sequences");
  const int32_t* bt = static_cast<const int32_t*>(tables.ptr);
  const int32_t* cl = static_cast<const int32_t*>(lens.ptr);
  const int64_t* qs = static_cast<const int64_t*>(starts.ptr);
  require(qs[0] == 0 && qs[S] == tq, "q_starts: must start at 0 and end at the number of query tokens");
  // the messages are built only on failure: this walks every block of every sequence on each call
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    if (q_len < 0 || q_len > cl[s]) fail("sequence " + std::to_string(s) + ": more new tokens than context");
    if (cl[s] > M * B) fail("sequence " + std::to_string(s) + ": context is longer than its block table");
    for (int64_t b = 0; b * B < cl[s]; ++b)
      if (bt[s * M + b] < 0 || bt[s * M + b] >= blocks)
        fail("block_tables: sequence " + std::to_string(s) + " uses block " + std::to_string(bt[s * M + b]) +
             " outside the cache's " + std::to_string(blocks));
  }
}

void paged_attention(const Ref& out_r, const Ref& q_r, const Ref& kc_r, const Ref& vc_r, const Ref& bt_r,
                     const Ref& cl_r, const Ref& qs_r, float scale) {
  T out = tensor(out_r, "out", 3), q = tensor(q_r, "q", 3), kc = tensor(kc_r, "key_cache", 4),
    vc = tensor(vc_r, "value_cache", 4), bt = tensor(bt_r, "block_tables", 2), cl = tensor(cl_r, "context_lens", 1),
    qs = tensor(qs_r, "q_starts", 1);
  DType dt = float_type(q);
  same_type(q, out), kv_caches(kc, vc);
  integer(bt, I32), integer(cl, I32), integer(qs, I64);
  const int64_t tq = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hk = vc.dim(1), B = vc.dim(2);
  require(vc.dim(3) == D, "value_cache: head_dim differs from q");
  require(Hk > 0 && Hq % Hk == 0, "q: query heads must be a multiple of the cache's KV heads");
  heads_rows(q, tq, Hq, D), heads_rows(out, tq, Hq, D);
  check_sequences(bt, cl, qs, tq, kc.dim(0), B);
  kernels().paged_attention({dt, out.ptr, q.ptr, kc.ptr, vc.ptr, static_cast<const int32_t*>(bt.ptr),
                             static_cast<const int32_t*>(cl.ptr), static_cast<const int64_t*>(qs.ptr), cl.dim(0), Hq,
                             Hk, D, B, bt.dim(1), kc.dim(0), q.st(0), out.st(0), scale, cache_type(kc)});
}

void linear_f32_out(const Ref& out_r, const Ref& x_r, const Ref& w_r) {
  T out = tensor(out_r, "out", 2), x = tensor(x_r, "x", 2), w = tensor(w_r, "weight", 2);
  DType dt = float_type(x);
  same_type(x, w), contiguous(w), contiguous(out);
  require(out.code == F32, "out: dtype must be float32");
  require(w.dim(1) == x.dim(1) && out.dim(0) == x.dim(0) && out.dim(1) == w.dim(0),
          "linear_f32_out: x must be [S, K], weight [V, K] and out [S, V]");
  kernels().linear_f32_out({dt, static_cast<float*>(out.ptr), x.ptr, w.ptr, x.dim(0), x.dim(1), w.dim(0), x.st(0)});
}

constexpr QType kQTypes[] = {QType::q4_0, QType::q4_1, QType::q5_0, QType::q5_1, QType::q8_0, QType::q2_k,
                             QType::q3_k, QType::q4_k, QType::q5_k, QType::q6_k, QType::iq4_nl, QType::iq4_xs,
                             QType::bf16, QType::q4_m32, QType::q8_m32, QType::q8_h32, QType::iq4_f32, QType::q4_hm32};

QType quant_type(int code) {
  for (QType q : kQTypes)
    if (code == static_cast<int>(q)) return q;
  fail("qtype: " + std::to_string(code) + " is not a packed weight type (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, "
       "Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, Q4_M32 = 100, Q8_M32 = 101, Q8_H32 = 102, "
       "IQ4_F32 = 103, Q4_HM32 = 104)");
}

FileType file_type(int code) {
  for (FileType f : {FileType::q5_0, FileType::q5_1, FileType::q2_k, FileType::q3_k, FileType::q4_k, FileType::q5_k,
                     FileType::q6_k, FileType::iq4_xs})
    if (code == static_cast<int>(f)) return f;
  fail("from: GGML type " + std::to_string(code) +
       " is not converted (Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23)");
}

// out: uint8 [R, K / 32 * the converted block's bytes] from file rows [R, K / block * file block bytes]
void convert_rows(const Ref& out_r, const Ref& w_r, int from, int64_t k) {
  T out = tensor(out_r, "out", 2), w = tensor(w_r, "weight", 2);
  const FileType f = file_type(from);
  const int64_t per = file_block_weights(f);
  require(w.code == U8 && out.code == U8, "convert_quant: weight and out must be uint8");
  contiguous(w), contiguous(out);
  require(k > 0 && k % per == 0, "in_features: must be a positive multiple of " + std::to_string(per) + ", got " + std::to_string(k));
  require(w.dim(1) == k / per * file_block_bytes(f), "weight: rows must be " + std::to_string(k / per * file_block_bytes(f)) +
                                                         " bytes for " + std::to_string(k) + " features, got " + std::to_string(w.dim(1)));
  const QType q = converted_type(f);
  require(out.dim(0) == w.dim(0) && out.dim(1) == quant_row_bytes(q, k),
          "convert_quant: out must be [R, " + std::to_string(quant_row_bytes(q, k)) + "]");
  convert_quant(ConvertArgs{f, static_cast<const uint8_t*>(w.ptr), static_cast<uint8_t*>(out.ptr), w.dim(0), k});
}

// weight: [V, K / block * block bytes] uint8, contiguous; K a multiple of the block (32, or a K-quant's 256)
void quant_weight(const T& w, QType q, int64_t k) {
  require(w.code == U8, "weight: dtype must be uint8 (GGUF blocks)");
  contiguous(w);
  const int64_t per = quant_block_weights(q);
  require(k > 0 && k % per == 0, "in_features: must be a positive multiple of " + std::to_string(per) + ", got " + std::to_string(k));
  require(w.dim(1) == quant_row_bytes(q, k), "weight: rows must be " + std::to_string(quant_row_bytes(q, k)) + " bytes for " +
                                                 std::to_string(k) + " features, got " + std::to_string(w.dim(1)));
}

// packed: uint8 [packed_bytes(q, N, K)] for a weight of N rows
void packed_weight(const T& w, QType q, int64_t n, int64_t k) {
  require(w.code == U8, "weight: dtype must be uint8 (packed blocks)");
  contiguous(w);
  const int64_t per = quant_block_weights(q);
  require(k > 0 && k % per == 0, "in_features: must be a positive multiple of " + std::to_string(per) + ", got " + std::to_string(k));
  require(n > 0, "out_features: must be positive, got " + std::to_string(n));
  require(w.dim(0) == packed_bytes(q, n, k), "weight: " + std::to_string(n) + " x " + std::to_string(k) +
                                                 " packed takes " + std::to_string(packed_bytes(q, n, k)) +
                                                 " bytes, got " + std::to_string(w.dim(0)));
}

void pack_quant(const Ref& out_r, const Ref& w_r, int qtype, int64_t k) {
  T out = tensor(out_r, "out", 1), w = tensor(w_r, "weight", 2);
  const QType q = quant_type(qtype);
  quant_weight(w, q, k);
  packed_weight(out, q, w.dim(0), k);
  kernels().pack_quant({q, static_cast<const uint8_t*>(w.ptr), static_cast<uint8_t*>(out.ptr), w.dim(0), k});
}

void packed_linear(const Ref& out_r, const Ref& x_r, const Ref& w_r, int qtype, int64_t k, int64_t n, int act, bool prompt) {
  T out = tensor(out_r, "out", 2), x = tensor(x_r, "x", 2), w = tensor(w_r, "weight", 1);
  const QType q = quant_type(qtype);
  packed_weight(w, q, n, k);
  require(act >= 0 && act <= 2, "act: must be 0 (none), 1 (int8) or 2 (int16), got " + std::to_string(act));
  require(x.dim(1) == k && out.dim(0) == x.dim(0) && out.dim(1) == n,
          "packed_linear: x must be [S, K] and out [S, N] for a weight [N, K]");
  kernels().packed_linear({q, static_cast<ActQuant>(act), float_type(x), float_type(out), out.ptr, x.ptr,
                           static_cast<const uint8_t*>(w.ptr), x.dim(0), k, n, x.st(0), out.st(0), prompt});
}

void packed_rows(const Ref& out_r, const Ref& w_r, const Ref& ids_r, int qtype, int64_t k, int64_t n) {
  T out = tensor(out_r, "out", 2), w = tensor(w_r, "weight", 1), ids = tensor(ids_r, "ids", 1);
  const QType q = quant_type(qtype);
  packed_weight(w, q, n, k);
  integer(ids, I64);
  require(out.dim(0) == ids.dim(0) && out.dim(1) == k, "packed_rows: out must be [len(ids), K]");
  const int64_t* id = static_cast<const int64_t*>(ids.ptr);
  for (int64_t i = 0; i < ids.dim(0); ++i)
    require(id[i] >= 0 && id[i] < n, "ids: " + std::to_string(id[i]) + " is not a row of " + std::to_string(n));
  kernels().packed_rows({q, float_type(out), out.ptr, static_cast<const uint8_t*>(w.ptr), id, ids.dim(0), k, out.st(0)});
}

void dequantize(const Ref& out_r, const Ref& w_r, int qtype, int64_t k) {
  T out = tensor(out_r, "out", 2), w = tensor(w_r, "weight", 2);
  const QType q = quant_type(qtype);
  require(q != QType::bf16, "dequantize: BF16 rows are not quantized (view them as bfloat16)");
  quant_weight(w, q, k);
  require(out.dim(0) == w.dim(0) && out.dim(1) == k, "dequantize: out must be [R, K] for weight [R, K]");
  // the superblock and Q5 types: through the blocks of 32 that hold the same values (converted_type)
  if (superblocks(q) || q == QType::q5_0 || q == QType::q5_1) {
    const FileType f = static_cast<FileType>(q);
    std::vector<uint8_t> blocks(static_cast<size_t>(w.dim(0) * quant_row_bytes(converted_type(f), k)));
    convert_quant(ConvertArgs{f, static_cast<const uint8_t*>(w.ptr), blocks.data(), w.dim(0), k});
    kernels().dequantize({converted_type(f), float_type(out), out.ptr, blocks.data(), w.dim(0), k, out.st(0)});
    return;
  }
  kernels().dequantize({q, float_type(out), out.ptr, static_cast<const uint8_t*>(w.ptr), w.dim(0), k, out.st(0)});
}

std::string bind(const std::vector<int>& cpus, const std::vector<int>& nodes, bool interleave) {
  require(!cpus.empty(), "bind_threads: cpus must not be empty");
  for (int cpu : cpus) require(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: CPU " + std::to_string(cpu) + " is out of range");
  for (int node : nodes) require(node >= 0 && node < 1024, "bind_threads: NUMA node " + std::to_string(node) + " is out of range");
  return bind_threads(cpus, nodes, interleave);
}

std::vector<std::string> compiled() {
  std::vector<std::string> names;
  for (const char* const* p = compiled_isas(); *p; ++p) names.emplace_back(*p);
  return names;
}

void use_isa(const std::string& name) {
  require(select_isa(name.c_str()), "ISA '" + name + "' is not compiled in or not supported by this CPU");
}

const char* const kBf16DotModes[] = {"auto", "on", "off"};  // Bf16Dot's order

void use_bf16_dot(const std::string& mode) {
  for (int i = 0; i < 3; ++i)
    if (mode == kBf16DotModes[i]) return set_bf16_dot(static_cast<Bf16Dot>(i));
  require(false, "bf16_dot mode '" + mode + "' is not one of auto, on, off");
}

const char* const kIntTilesModes[] = {"auto", "narrow", "wide"};  // IntTiles' order

void use_int_tiles(const std::string& mode) {
  for (int i = 0; i < 3; ++i)
    if (mode == kIntTilesModes[i]) return set_int_tiles(static_cast<IntTiles>(i));
  require(false, "int_tiles mode '" + mode + "' is not one of auto, narrow, wide");
}

const char* const kAmxTilesModes[] = {"auto", "off", "emulated"};  // AmxTiles' order

void use_amx_tiles(const std::string& mode) {
  for (int i = 0; i < 3; ++i)
    if (mode == kAmxTilesModes[i]) return set_amx_tiles(static_cast<AmxTiles>(i));
  require(false, "amx_tiles mode '" + mode + "' is not one of auto, off, emulated");
}

// ---- DecoderStack: the whole layer stack in one call (native/include/decoder.h) ----

using Parts = std::vector<std::tuple<Ref, int, int64_t>>;  // (packed data, type id, rows), stacked by rows

PackedMatrix packed_matrix(const Parts& parts, int64_t n, int64_t k, const std::string& name) {
  PackedMatrix m{{}, n, k};
  int64_t rows = 0;
  for (const auto& [ref, qtype, part_rows] : parts) {
    T w = tensor(ref, "weight", 1);
    const QType q = quant_type(qtype);
    try {
      packed_weight(w, q, part_rows, k);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(name + " " + e.what());
    }
    m.parts.push_back({static_cast<const uint8_t*>(w.ptr), q, part_rows});
    rows += part_rows;
  }
  require(!parts.empty() && rows == n, name + ": its parts must hold " + std::to_string(n) + " rows, got " + std::to_string(rows));
  return m;
}

const void* vector_of(const Ref& ref, const char* name, int code, int64_t n) {
  T v = tensor(ref, name, 1);
  contiguous(v);
  require(v.code == code && v.dim(0) == n, std::string(name) + ": must be [" + std::to_string(n) + "] in the activation dtype");
  return v.ptr;
}

std::unique_ptr<DecoderStack> make_stack(int dtype, int act, int64_t hidden, int64_t q_heads, int64_t kv_heads,
                                         int64_t head_dim, int64_t inter, float eps, float scale, const Ref& cs_r,
                                         const Ref& norm_r, ShmGroup* group) {
  require(dtype == F32 || dtype == BF16, "dtype: must be float32 (0) or bfloat16 (1)");
  require(act == 1 || act == 2, "act: the stack runs quantized activations only: 1 (int8) or 2 (int16)");
  require(hidden > 0 && head_dim > 0 && inter > 0 && q_heads > 0 && kv_heads > 0 && q_heads % kv_heads == 0,
          "DecoderStack: sizes must be positive and query heads a multiple of KV heads");
  require(eps > 0.f, "eps: must be positive");
  T cs = tensor(cs_r, "cos_sin", 2);
  contiguous(cs);
  require(cs.code == F32, "cos_sin: dtype must be float32");
  require(cs.dim(1) % 2 == 0 && cs.dim(1) <= head_dim && cs.dim(1) > 0, "cos_sin: width must be even and at most head_dim");
  DecoderShape shape{static_cast<DType>(dtype), static_cast<DType>(dtype), static_cast<ActQuant>(act), hidden, q_heads,
                     kv_heads, head_dim, inter, cs.dim(1), cs.dim(0), 0, 0, eps, scale,
                     static_cast<const float*>(cs.ptr), vector_of(norm_r, "final_norm", dtype, hidden)};
  return std::make_unique<DecoderStack>(shape, group);
}

// A layer's experts (app/model/layers.py MoE): the router [experts, hidden] in the activation dtype, each expert's
// gate/up [2 I, hidden] and down [hidden, I] parts (I: this rank's share of its features)
Experts stack_experts(const DecoderShape& s, const Ref& router_r, const std::vector<Parts>& gate_up,
                      const std::vector<Parts>& down, int64_t top_k, bool renormalize) {
  T router = tensor(router_r, "router", 2);
  contiguous(router);
  const int64_t count = router.dim(0);
  require(router.code == (s.dtype == DType::f32 ? F32 : BF16) && router.dim(1) == s.hidden,
          "router: must be [experts, " + std::to_string(s.hidden) + "] in the activation dtype");
  require(static_cast<int64_t>(gate_up.size()) == count && static_cast<int64_t>(down.size()) == count,
          "experts: the router scores " + std::to_string(count) + " experts, given " + std::to_string(gate_up.size()) +
              " gate/up and " + std::to_string(down.size()) + " down projections");
  require(top_k >= 1 && top_k <= count, "top_k: must be in [1, " + std::to_string(count) + "]");
  Experts e{router.ptr, {}, {}, top_k, renormalize};
  for (int64_t i = 0; i < count; ++i) {
    int64_t rows = 0;
    for (const auto& part : gate_up[i]) rows += std::get<2>(part);
    require(rows > 0 && rows % 2 == 0, "expert " + std::to_string(i) + " gate_up: must have 2 x its features rows");
    e.gate_up.push_back(packed_matrix(gate_up[i], rows, s.hidden, "expert " + std::to_string(i) + " gate_up"));
    e.down.push_back(packed_matrix(down[i], s.hidden, rows / 2, "expert " + std::to_string(i) + " down"));
  }
  return e;
}

void stack_add_layer(DecoderStack& stack, const Parts& qkv, const Parts& o, const Parts& gu, const Parts& down,
                     const Ref& in_norm, const Ref& post_norm, const std::optional<Ref>& bias, const Ref& kc_r,
                     const Ref& vc_r, const std::optional<Ref>& q_norm, const std::optional<Ref>& k_norm,
                     const std::optional<Ref>& router, const std::vector<Parts>& experts_gate_up,
                     const std::vector<Parts>& experts_down, int64_t top_k, bool renormalize) {
  DecoderShape s = stack.shape();
  const int code = s.dtype == DType::f32 ? F32 : BF16;
  const int64_t H = s.hidden, qw = s.q_heads * s.head_dim, qkvw = qw + 2 * s.kv_heads * s.head_dim;
  require(q_norm.has_value() == k_norm.has_value(), "q_norm, k_norm: give both or neither");
  T kc = tensor(kc_r, "key_cache", 4), vc = tensor(vc_r, "value_cache", 4);
  kv_caches(kc, vc);
  require(vc.dim(1) == s.kv_heads && vc.dim(3) == s.head_dim, "value_cache: must be [blocks, " +
                                                                  std::to_string(s.kv_heads) + ", block_size, " +
                                                                  std::to_string(s.head_dim) + "]");
  if (stack.num_layers() == 0) {
    s.cache_dtype = cache_type(kc), s.block_size = vc.dim(2), s.num_blocks = vc.dim(0);
    require(s.block_size > 0, "value_cache: block_size must be positive");
  } else {
    require(cache_type(kc) == s.cache_dtype && vc.dim(2) == s.block_size && vc.dim(0) == s.num_blocks,
            "key_cache: every layer's cache must have the first layer's dtype and shape");
  }
  require(router.has_value() == (gu.empty() && down.empty()),
          "gate_up, down: a layer has either a dense MLP (gate_up and down) or experts (a router): give one of them");
  require(router.has_value() || (experts_gate_up.empty() && experts_down.empty()),
          "experts_gate_up, experts_down: a layer's experts need its router");
  DecoderLayerWeights l{packed_matrix(qkv, qkvw, H, "qkv"),
                        packed_matrix(o, H, qw, "o"),
                        router ? PackedMatrix{} : packed_matrix(gu, 2 * s.inter, H, "gate_up"),
                        router ? PackedMatrix{} : packed_matrix(down, H, s.inter, "down"),
                        vector_of(in_norm, "input_norm", code, H),
                        vector_of(post_norm, "post_norm", code, H),
                        bias ? vector_of(*bias, "qkv_bias", code, qkvw) : nullptr,
                        q_norm ? vector_of(*q_norm, "q_norm", code, s.head_dim) : nullptr,
                        k_norm ? vector_of(*k_norm, "k_norm", code, s.head_dim) : nullptr,
                        kc.ptr,
                        vc.ptr,
                        router ? stack_experts(s, *router, experts_gate_up, experts_down, top_k, renormalize)
                               : Experts{}};
  stack.set_cache_shape(s.cache_dtype, s.block_size, s.num_blocks);
  stack.add_layer(l);
}

void stack_run(DecoderStack& stack, const Ref& x_r, const Ref& pos_r, const Ref& slots_r, const Ref& bt_r,
               const Ref& cl_r, const Ref& qs_r, const Ref& pr_r, const std::optional<Ref>& hr_r) {
  const DecoderShape& s = stack.shape();
  require(stack.num_layers() > 0, "DecoderStack: no layers");
  T x = tensor(x_r, "x", 2), pos = tensor(pos_r, "positions", 1), slots = tensor(slots_r, "slot_mapping", 1),
    bt = tensor(bt_r, "block_tables", 2), cl = tensor(cl_r, "context_lens", 1), qs = tensor(qs_r, "q_starts", 1),
    pr = tensor(pr_r, "prompt_rows", 1);
  contiguous(x);
  require(float_type(x) == s.dtype && x.dim(1) == s.hidden, "x: must be [tokens, " + std::to_string(s.hidden) +
                                                                 "] in the stack's dtype");
  integer(pos, I64), integer(slots, I64), integer(bt, I32), integer(cl, I32), integer(qs, I64);
  const int64_t tokens = x.dim(0);
  require(pos.dim(0) == tokens && slots.dim(0) == tokens, "positions, slot_mapping: must have one entry a token");
  const int64_t* p = static_cast<const int64_t*>(pos.ptr);
  const int64_t* sl = static_cast<const int64_t*>(slots.ptr);
  for (int64_t t = 0; t < tokens; ++t) {
    require(p[t] >= 0 && p[t] < s.max_position, "positions: " + std::to_string(p[t]) + " is outside the cos/sin table");
    require(sl[t] < s.num_blocks * s.block_size, "slot_mapping: slot " + std::to_string(sl[t]) + " is past the cache's " +
                                                     std::to_string(s.num_blocks * s.block_size) + " slots");
  }
  check_sequences(bt, cl, qs, tokens, s.num_blocks, s.block_size);
  integer(pr, I64);
  require(pr.dim(0) == cl.dim(0), "prompt_rows: must have one entry a sequence");
  const int64_t* q = static_cast<const int64_t*>(qs.ptr);
  const int64_t* prompt = static_cast<const int64_t*>(pr.ptr);
  for (int64_t i = 0; i < pr.dim(0); ++i)
    require(prompt[i] >= 0 && prompt[i] <= q[i + 1] - q[i],
            "prompt_rows: sequence " + std::to_string(i) + " has " + std::to_string(q[i + 1] - q[i]) + " rows, not " +
                std::to_string(prompt[i]) + " prompt rows");
  const int64_t* hidden = nullptr;  // (none: every row's final hidden state)
  if (hr_r) {
    T hr = tensor(*hr_r, "hidden_rows", 1);
    integer(hr, I64);
    require(hr.dim(0) == cl.dim(0), "hidden_rows: must have one entry a sequence");
    hidden = static_cast<const int64_t*>(hr.ptr);
    for (int64_t i = 0; i < hr.dim(0); ++i)
      require(hidden[i] >= 0 && hidden[i] <= q[i + 1] - q[i],
              "hidden_rows: sequence " + std::to_string(i) + " has " + std::to_string(q[i + 1] - q[i]) + " rows, not " +
                  std::to_string(hidden[i]));
  }
  const StepBatch batch{p, sl, static_cast<const int32_t*>(bt.ptr), static_cast<const int32_t*>(cl.ptr), q, prompt,
                        hidden, tokens, cl.dim(0), bt.dim(1)};
  py::gil_scoped_release release;
  stack.run(x.ptr, batch);
}

}  // namespace

void group_all_reduce(ShmGroup& group, const Ref& ref) {
  T t = tensor(ref, "tensor", std::get<2>(ref).size());
  contiguous(t);
  int64_t count = 1;
  for (int64_t d : t.shape) count *= d;
  const DType dtype = float_type(t);
  py::gil_scoped_release release;
  group.all_reduce(t.ptr, count, dtype == DType::f32 ? 0 : 1);
}

py::object group_broadcast(ShmGroup& group, const py::bytes& message, double timeout) {
  std::string data = message;
  std::optional<std::string> out;
  {
    py::gil_scoped_release release;
    out = group.broadcast(data, timeout);
  }
  if (!out) return py::none();
  return py::bytes(*out);
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native CPU kernels and thread/NUMA binding (see native/ and app/kernels/ops.py).";
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("touch_kv_blocks", &touch_kv_blocks);
  m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>());
  m.def("linear_f32_out", &linear_f32_out, py::call_guard<py::gil_scoped_release>());
  m.def("pack_quant", &pack_quant, py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &packed_linear, py::call_guard<py::gil_scoped_release>());
  m.def("packed_rows", &packed_rows, py::call_guard<py::gil_scoped_release>());
  m.def("packed_bytes", [](int qtype, int64_t n, int64_t k) { return packed_bytes(quant_type(qtype), n, k); });
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>());
  m.def("convert_quant", &convert_rows, py::call_guard<py::gil_scoped_release>());
  m.def("block_bytes", [](int qtype) { return quant_block_bytes(quant_type(qtype)); });
  m.def("converted_type", [](int from) { return static_cast<int>(converted_type(file_type(from))); });
  m.def("bind_threads", &bind, py::call_guard<py::gil_scoped_release>());
  m.def("memory_nodes", &memory_nodes, py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(kernels().isa); });
  m.def("widens_prompts", [](std::optional<int> qtype) {  // (no type: whether any type's are)
    if (qtype) return kernels().widens_prompts(quant_type(*qtype));
    return std::any_of(std::begin(kQTypes), std::end(kQTypes), [](QType t) { return kernels().widens_prompts(t); });
  }, py::arg("qtype") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("best_isa", [] { return std::string(best_isa()); });
  m.def("compiled_isas", &compiled);
  m.def("select_isa", &use_isa);
  m.def("bf16_dot", [] { return bf16_dot(); }, py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot_ratio", [] { return bf16_dot_ratio(); }, py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot_mode", [] { return std::string(kBf16DotModes[static_cast<int>(bf16_dot_mode())]); });
  m.def("set_bf16_dot", &use_bf16_dot);
  m.def("wide_int_tiles", [] { return wide_int_tiles(); }, py::call_guard<py::gil_scoped_release>());
  m.def("int_mul_ratio", [] { return int_mul_ratio(); }, py::call_guard<py::gil_scoped_release>());
  m.def("int_tiles_mode", [] { return std::string(kIntTilesModes[static_cast<int>(int_tiles_mode())]); });
  m.def("set_int_tiles", &use_int_tiles);
  m.def("amx_status", [] { return std::string(amx_status()); }, py::call_guard<py::gil_scoped_release>());
  m.def("amx_tiles_mode", [] { return std::string(kAmxTilesModes[static_cast<int>(amx_tiles_mode())]); });
  m.def("set_amx_tiles", &use_amx_tiles);
  m.def("amx_row_chunks", [] { return amx_row_chunks(); });
  m.def("amx_emulated_self_check", [] {  // in the kernels in force; None where it passes
    const char* why = "no AMX rows in these kernels";
#if defined(__x86_64__)
    const std::string isa = kernels().isa;
    if (isa == "avx512bf16") why = avx512bf16::amx_emulated_self_check();
    else if (isa == "avx512") why = avx512::amx_emulated_self_check();
    else if (isa == "avx2") why = avx2::amx_emulated_self_check();
#endif
    return why ? std::optional<std::string>(why) : std::nullopt;
  }, py::call_guard<py::gil_scoped_release>());
  m.def("max_threads", [] { return omp_get_max_threads(); });
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init(&make_stack), py::arg("dtype"), py::arg("act"), py::arg("hidden"), py::arg("q_heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"), py::arg("eps"), py::arg("scale"),
           py::arg("cos_sin"), py::arg("final_norm"), py::arg("group").none(true), py::keep_alive<1, 13>())
      .def("add_layer", &stack_add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv_bias").none(true), py::arg("key_cache"),
           py::arg("value_cache"), py::arg("q_norm").none(true), py::arg("k_norm").none(true),
           py::arg("router").none(true) = py::none(), py::arg("experts_gate_up") = std::vector<Parts>{},
           py::arg("experts_down") = std::vector<Parts>{}, py::arg("top_k") = 0, py::arg("renormalize") = false)
      .def("run", &stack_run, py::arg("x"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("context_lens"), py::arg("q_starts"), py::arg("prompt_rows"),
           py::arg("hidden_rows").none(true) = py::none())
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
  py::class_<ShmGroup>(m, "ShmGroup")
      .def(py::init<const std::string&, int, int, size_t, size_t, double>(), py::arg("name"), py::arg("rank"),
           py::arg("world"), py::arg("slot_bytes"), py::arg("broadcast_bytes"), py::arg("attach_timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_reduce", &group_all_reduce)
      .def("broadcast", &group_broadcast)
      .def("wait_attached", &ShmGroup::wait_attached, py::call_guard<py::gil_scoped_release>())
      .def("abort", &ShmGroup::abort)
      .def("close", &ShmGroup::close)
      .def_readwrite("timeout", &ShmGroup::timeout)
      .def("waiting_seconds", &ShmGroup::waiting_seconds, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("waiting_peer", &ShmGroup::waiting_peer)
      .def_property_readonly("rank", &ShmGroup::rank)
      .def_property_readonly("world", &ShmGroup::world);
}
