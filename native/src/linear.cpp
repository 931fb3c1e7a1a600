// The LM head: logits = x @ W^T with float32 accumulation AND float32 output, whatever W's dtype.
// A bfloat16 GEMM would round logits to bf16 (a step of 0.125 at 25): close candidates would then
// tie or swap, and greedy decoding would change. Memory-bound: W is read once per step.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
namespace {

template <typename T>
float dot(const float* x, const T* w, int64_t n) {
  VecF acc0 = VecF::zero(), acc1 = VecF::zero();
  int64_t i = 0;
  for (; i + 2 * VecF::N <= n; i += 2 * VecF::N) {  // two accumulators: more FMAs in flight
    acc0 = VecF::fmadd(VecF::load(x + i), VecF::load(w + i), acc0);
    acc1 = VecF::fmadd(VecF::load(x + i + VecF::N), VecF::load(w + i + VecF::N), acc1);
  }
  for (; i + VecF::N <= n; i += VecF::N) acc0 = VecF::fmadd(VecF::load(x + i), VecF::load(w + i), acc0);
  float s = (acc0 + acc1).reduce_add();
  for (; i < n; ++i) s += x[i] * to_float(w[i]);
  return s;
}

// Four rows of x against one weight row, the weight row's loads shared; each row's sum in dot()'s exact order
// (two accumulators, then one, then the scalar tail), so a row's logits never depend on its place in the batch
template <typename T>
void dot4(const float* const x[4], const T* w, int64_t n, float* out[4]) {
  VecF a0[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  VecF a1[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  int64_t i = 0;
  for (; i + 2 * VecF::N <= n; i += 2 * VecF::N) {
    const VecF v0 = VecF::load(w + i), v1 = VecF::load(w + i + VecF::N);
    for (int r = 0; r < 4; ++r) {
      a0[r] = VecF::fmadd(VecF::load(x[r] + i), v0, a0[r]);
      a1[r] = VecF::fmadd(VecF::load(x[r] + i + VecF::N), v1, a1[r]);
    }
  }
  for (; i + VecF::N <= n; i += VecF::N) {
    const VecF v = VecF::load(w + i);
    for (int r = 0; r < 4; ++r) a0[r] = VecF::fmadd(VecF::load(x[r] + i), v, a0[r]);
  }
  for (int r = 0; r < 4; ++r) {
    float s = (a0[r] + a1[r]).reduce_add();
    for (int64_t j = i; j < n; ++j) s += x[r][j] * to_float(w[j]);
    *out[r] = s;
  }
}

// Rows of x a work item takes against every weight row, where the weight is small enough to stay in cache
// across items (a mixture's router, [experts, hidden]); a large one (the LM head) is read once, every row of x
// against each of its rows in turn. The router's logits for a 2048-row prefill (128 experts, hidden 2,048,
// float32) took 83 ms as the head's loop (x read again for each expert), torch's GEMM 10 ms.
constexpr int64_t kRowTile = 16;
constexpr int64_t kCachedWeightBytes = 1 << 22;

template <typename T>
void linear_impl(const LinearArgs& a) {
  const int64_t K = a.in_features, V = a.out_features, S = a.rows;
  // x as float32 rows: float32 x read in place, bfloat16 widened once
  const float* xf = nullptr;
  int64_t stride = a.x_stride;
  std::vector<float> widened;
  if constexpr (std::is_same_v<T, float>) {
    xf = static_cast<const float*>(a.x);
  } else {
    const T* x = static_cast<const T*>(a.x);
    widened.resize(S * K);
#pragma omp parallel for schedule(static) if (S * K >= (1 << 16))
    for (int64_t s = 0; s < S; ++s)
      for (int64_t k = 0; k < K; ++k) widened[s * K + k] = to_float(x[s * a.x_stride + k]);
    xf = widened.data();
    stride = K;
  }
  const T* w = static_cast<const T*>(a.weight);
  float* out = a.out;
  const bool cached = V * K * static_cast<int64_t>(sizeof(T)) <= kCachedWeightBytes;
  const int64_t tile = cached ? kRowTile : std::max<int64_t>(S, 1);
  const int64_t tiles = (S + tile - 1) / tile;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t v = 0; v < V; ++v) {
      const T* row = w + v * K;
      int64_t s = t * tile;
      const int64_t end = std::min(S, s + tile);
      for (; s + 4 <= end; s += 4) {
        const float* x4[4] = {xf + s * stride, xf + (s + 1) * stride, xf + (s + 2) * stride, xf + (s + 3) * stride};
        float* o4[4] = {out + s * V + v, out + (s + 1) * V + v, out + (s + 2) * V + v, out + (s + 3) * V + v};
        dot4(x4, row, K, o4);
      }
      for (; s < end; ++s) out[s * V + v] = dot(xf + s * stride, row, K);
    }
  }
}

}  // namespace

void linear_f32_out(const LinearArgs& a) {
  if (a.dtype == DType::f32) linear_impl<float>(a);
  else linear_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
