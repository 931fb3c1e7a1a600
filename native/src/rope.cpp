// Rotary position embedding, NeoX/Llama layout: each head's first rot_dim/2 features pair with the
// next rot_dim/2 (halves, not interleaved pairs). Positions are per token; the cos/sin table is built
// in Python (app/model/rope.py), where Llama-3 style frequency scaling is applied.
#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

template <typename T>
void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  T* x1 = x;
  T* x2 = x + half;
  int64_t i = 0;
  for (; i + VecF::N <= half; i += VecF::N) {
    VecF a = VecF::load(x1 + i), b = VecF::load(x2 + i);
    VecF c = VecF::load(cos + i), s = VecF::load(sin + i);
    VecF ra = a * c - b * s;
    VecF rb = VecF::fmadd(a, s, b * c);
    ra.store(x1 + i);
    rb.store(x2 + i);
  }
  for (; i < half; ++i) {
    float a = to_float(x1[i]), b = to_float(x2[i]);
    x1[i] = from_float<T>(a * cos[i] - b * sin[i]);
    x2[i] = from_float<T>(b * cos[i] + a * sin[i]);
  }
}

template <typename T>
void rope_impl(const RopeArgs& a) {
  T* q = static_cast<T*>(a.q);
  T* k = static_cast<T*>(a.k);
  const int64_t half = a.rot_dim / 2;
#pragma omp parallel for schedule(static) if (a.tokens * (a.q_heads + a.k_heads) * a.rot_dim >= kParallelElements)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* cos = a.cos_sin + a.positions[t] * a.rot_dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < a.q_heads; ++h) rotate_head(q + t * a.q_stride + h * a.head_dim, cos, sin, half);
    for (int64_t h = 0; h < a.k_heads; ++h) rotate_head(k + t * a.k_stride + h * a.head_dim, cos, sin, half);
  }
}

}  // namespace

void rotary_embedding(const RopeArgs& a) {
  if (a.dtype == DType::f32) rope_impl<float>(a);
  else rope_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
