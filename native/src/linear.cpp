// The LM head: logits = x @ W^T with float32 accumulation AND float32 output, whatever W's dtype.
// A bfloat16 GEMM would round logits to bf16 (a step of 0.125 at 25): close candidates would then
// tie or swap, and greedy decoding would change. Memory-bound: W is read once per step.
#include <algorithm>
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

template <typename T>
void linear_impl(const LinearArgs& a) {
  // x: [S, K] -> float32 once; each weight row is then used for every sequence while it is in cache
  const T* x = static_cast<const T*>(a.x);
  std::vector<float> xf(a.rows * a.in_features);
  for (int64_t s = 0; s < a.rows; ++s)
    for (int64_t k = 0; k < a.in_features; ++k) xf[s * a.in_features + k] = to_float(x[s * a.x_stride + k]);
  const T* w = static_cast<const T*>(a.weight);
  float* out = a.out;
#pragma omp parallel for schedule(static)
  for (int64_t v = 0; v < a.out_features; ++v) {
    const T* row = w + v * a.in_features;
    for (int64_t s = 0; s < a.rows; ++s) out[s * a.out_features + v] = dot(&xf[s * a.in_features], row, a.in_features);
  }
}

}  // namespace

void linear_f32_out(const LinearArgs& a) {
  if (a.dtype == DType::f32) linear_impl<float>(a);
  else linear_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
