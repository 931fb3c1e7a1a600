// SwiGLU: out = silu(gate) * up, with gate and up the two halves of one [T, 2I] projection.
#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

template <typename T>
void silu_and_mul_impl(const SiluMulArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const VecF one = VecF::set1(1.f);
#pragma omp parallel for schedule(static) if (a.tokens * a.inter >= kParallelElements)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const T* gate = x + t * a.x_stride;
    const T* up = gate + a.inter;
    T* o = out + t * a.out_stride;
    int64_t i = 0;
    for (; i + VecF::N <= a.inter; i += VecF::N) {
      VecF g = VecF::load(gate + i);
      VecF silu = g / (one + exp(VecF::zero() - g));
      (silu * VecF::load(up + i)).store(o + i);
    }
    for (; i < a.inter; ++i) {
      float g = to_float(gate[i]);
      o[i] = from_float<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
    }
  }
}

}  // namespace

void silu_and_mul(const SiluMulArgs& a) {
  if (a.dtype == DType::f32) silu_and_mul_impl<float>(a);
  else silu_and_mul_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
