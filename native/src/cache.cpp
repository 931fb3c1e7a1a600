// Writing new keys and values into the paged KV cache: [blocks, kv_heads, block_size, head_dim],
// so that one head's tokens of a block are contiguous for attention to stream through.
#include <cstring>

#include "kernels.h"
#include "vec.h"

namespace appliance::APPLIANCE_ISA {
namespace {

template <typename T>
void write_impl(const CacheWriteArgs& a) {
  const T* key = static_cast<const T*>(a.key);
  const T* value = static_cast<const T*>(a.value);
  T* kc = static_cast<T*>(a.key_cache);
  T* vc = static_cast<T*>(a.value_cache);
  const int64_t row = a.head_dim * static_cast<int64_t>(sizeof(T));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;  // padding: no cache slot
    const int64_t block = slot / a.block_size, offset = slot % a.block_size;
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      const int64_t dst = ((block * a.kv_heads + h) * a.block_size + offset) * a.head_dim;
      std::memcpy(kc + dst, key + t * a.key_stride + h * a.head_dim, row);
      std::memcpy(vc + dst, value + t * a.value_stride + h * a.head_dim, row);
    }
  }
}

}  // namespace

void write_kv_cache(const CacheWriteArgs& a) {
  if (a.dtype == DType::f32) write_impl<float>(a);
  else write_impl<bf16>(a);
}

}  // namespace appliance::APPLIANCE_ISA
