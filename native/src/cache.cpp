// Writing new keys and values into the paged KV cache. Within one (block, KV head), float32 and float16 caches
// hold keys [head_dim, block_size] (transposed, so that attention scores a vector of keys at a time) and values
// [block_size, head_dim] (one head's tokens contiguous for P.V to stream through); bfloat16 caches hold
// the same with neighbours paired in 32-bit lanes, keys [head_dim / 2, block_size, 2] and values
// [block_size / 2, head_dim, 2], the operand layout of vdpbf16ps (attention.cpp says why).
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "vec.h"
#include "work.h"

namespace appliance::APPLIANCE_ISA {
namespace {

// A float16 cache saturates: a key or value beyond the largest half, +-65,504 (infinities too), is stored as that,
// where rounding would make it infinite and every score or output it meets NaN. NaN stays NaN: the scalar
// comparisons are false for it, x86's min/max return their second operand (the value) and NEON's return NaN; all
// of which holds only without -ffast-math / -ffinite-math-only (native/CMakeLists.txt has neither).
constexpr float kHalfMax = 65504.0f;
inline float saturate_half(float x) { return x > kHalfMax ? kHalfMax : x < -kHalfMax ? -kHalfMax : x; }
inline VecF saturate_half(VecF x) { return VecF::min(VecF::set1(kHalfMax), VecF::max(VecF::set1(-kHalfMax), x)); }

template <typename C>
inline C to_cache(float x) {
  if constexpr (std::is_same_v<C, f16>) x = saturate_half(x);
  return from_float<C>(x);
}

// one head's row of D values into the cache, converted when the cache's dtype differs
template <typename T, typename C>
inline void put(C* dst, const T* src, int64_t D) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, D * sizeof(T));
  } else {
    int64_t d = 0;
    for (; d + VecF::N <= D; d += VecF::N) {
      VecF x = VecF::load(src + d);
      if constexpr (std::is_same_v<C, f16>) x = saturate_half(x);
      x.store(dst + d);
    }
    for (; d < D; ++d) dst[d] = to_cache<C>(to_float(src[d]));
  }
}

template <typename T, typename C>
void write_impl(const CacheWriteArgs& a) {
  const T* key = static_cast<const T*>(a.key);
  const T* value = static_cast<const T*>(a.value);
  C* kc = static_cast<C*>(a.key_cache);
  C* vc = static_cast<C*>(a.value_cache);
#pragma omp parallel for schedule(static) if (2 * a.tokens * a.kv_heads * a.head_dim >= kParallelElements)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;  // padding: no cache slot
    const int64_t block = slot / a.block_size, offset = slot % a.block_size;
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      const int64_t base = (block * a.kv_heads + h) * a.block_size * a.head_dim;
      const T* k = key + t * a.key_stride + h * a.head_dim;
      const T* v = value + t * a.value_stride + h * a.head_dim;
      if constexpr (!std::is_same_v<C, bf16>) {  // float32, float16
        put(vc + base + offset * a.head_dim, v, a.head_dim);
        for (int64_t d = 0; d < a.head_dim; ++d) kc[base + d * a.block_size + offset] = to_cache<C>(to_float(k[d]));
      } else {  // feature d of key `offset`: pair d / 2, lane `offset`, half d % 2; of the value: pair offset / 2
        C* kp = kc + base + 2 * offset;
        for (int64_t d = 0; d < a.head_dim; ++d) kp[(d / 2) * 2 * a.block_size + d % 2] = from_float<C>(to_float(k[d]));
        C* vp = vc + base + (offset / 2) * 2 * a.head_dim + offset % 2;
        for (int64_t d = 0; d < a.head_dim; ++d) vp[2 * d] = from_float<C>(to_float(v[d]));
      }
    }
  }
}

}  // namespace

void write_kv_cache(const CacheWriteArgs& a) {
  const bool f32 = a.dtype == DType::f32, cache_f32 = a.cache_dtype == DType::f32;
  if (a.cache_dtype == DType::f16) f32 ? write_impl<float, f16>(a) : write_impl<bf16, f16>(a);
  else if (f32 && cache_f32) write_impl<float, float>(a);
  else if (f32) write_impl<float, bf16>(a);
  else if (cache_f32) write_impl<bf16, float>(a);
  else write_impl<bf16, bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
