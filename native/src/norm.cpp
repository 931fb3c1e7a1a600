// RMSNorm and the fused residual-add + RMSNorm, float32 or bfloat16 in, float32 accumulation.
#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= n; i += VecF::N) {
    VecF v = VecF::load(x + i);
    acc = VecF::fmadd(v, v, acc);
  }
  float total = acc.reduce_add();
  for (; i < n; ++i) total += to_float(x[i]) * to_float(x[i]);
  return total;
}

// out = x * inv_rms * weight (out may alias x)
template <typename T>
void scale_row(T* out, const T* x, const T* weight, float inv_rms, int64_t n) {
  VecF s = VecF::set1(inv_rms);
  int64_t i = 0;
  for (; i + VecF::N <= n; i += VecF::N) (VecF::load(x + i) * s * VecF::load(weight + i)).store(out + i);
  for (; i < n; ++i) out[i] = from_float<T>(to_float(x[i]) * inv_rms * to_float(weight[i]));
}

template <typename T>
void rms_norm_impl(const NormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const T* w = static_cast<const T*>(a.weight);
#pragma omp parallel for schedule(static) if (a.tokens * a.hidden >= kParallelElements)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const T* row = x + t * a.x_stride;
    float inv = 1.f / std::sqrt(sum_of_squares(row, a.hidden) / static_cast<float>(a.hidden) + a.eps);
    scale_row(out + t * a.out_stride, row, w, inv, a.hidden);
  }
}

// residual = x + residual (rounded to T, as a separate add would), then x = rms_norm(residual)
template <typename T>
void add_rms_norm_impl(const AddNormArgs& a) {
  T* x = static_cast<T*>(a.x);
  T* res = static_cast<T*>(a.residual);
  const T* w = static_cast<const T*>(a.weight);
#pragma omp parallel for schedule(static) if (a.tokens * a.hidden >= kParallelElements)
  for (int64_t t = 0; t < a.tokens; ++t) {
    T* xr = x + t * a.x_stride;
    T* rr = res + t * a.residual_stride;
    int64_t i = 0;
    for (; i + VecF::N <= a.hidden; i += VecF::N) (VecF::load(xr + i) + VecF::load(rr + i)).store(rr + i);
    for (; i < a.hidden; ++i) rr[i] = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
    float inv = 1.f / std::sqrt(sum_of_squares(rr, a.hidden) / static_cast<float>(a.hidden) + a.eps);
    scale_row(xr, rr, w, inv, a.hidden);
  }
}

}  // namespace

void rms_norm(const NormArgs& a) {
  if (a.dtype == DType::f32) rms_norm_impl<float>(a);
  else rms_norm_impl<bf16>(a);
}

void add_rms_norm(const AddNormArgs& a) {
  if (a.dtype == DType::f32) add_rms_norm_impl<float>(a);
  else add_rms_norm_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
