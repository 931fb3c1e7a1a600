// x quantized per block of 32 for the integer tiles (packed.h's Activations): one int8 plane h (ActQuant int8, as
// llama.cpp's Q8 blocks) or two, h and l (int16: x = scale (256 h + l), about 16 bits), with the sums the tiles'
// zero points and mins take; or kept float32 for the exact tiles (none).
#include <limits>

#include "packed.h"

namespace appliance::APPLIANCE_ISA {
namespace {

// One block: h = round(x * 127 / max|x|) and, with two planes, l = round((x * 127 / max|x| - h) * 256),
// both in [-127, 127]; x is then max|x| / 127 * (h + l / 256) to about 2^-16 of max|x|.
// A block whose max|x| is below 1e-36 is taken as zeros (denormals: SiLU of a very negative gate).
// A block with a NaN or an infinity gets scale NaN (and zeros for integers): every tile multiplies
// by x's scale, so the row's outputs come out NaN, as float32 arithmetic would give them, and a broken model's
// NaN reaches its logits (the sampler gives such a row no token) instead of becoming finite numbers here.
template <typename T, bool kHalves>
void quantize_block(const T* x, int planes, int8_t* q, float& scale, int32_t& isum, int32_t* isum_first) {
  constexpr int V = kQuantBlock / VecF::N;
  VecF v[V];  // in registers throughout: going through a float array on the stack stalled on store forwarding
  VecF peak = VecF::zero();
  for (int c = 0; c < V; ++c) {
    v[c] = VecF::load(x + c * VecF::N);
    peak = VecF::max(peak, VecF::max(v[c], VecF::zero() - v[c]));
  }
  // a block of zeros (scale 0) or of NaN (scale NaN): no integers, no sums
  const auto empty = [&](float s) {
    std::memset(q, 0, planes * kQuantBlock);
    scale = s, isum = 0;
    if (kHalves) *isum_first = 0;
  };
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float amax = peak.reduce_max();
  constexpr float kTiny = 1e-36f;  // (127 / amax overflows below 127 / FLT_MAX, ~3.7e-37)
  if (!(amax >= kTiny)) {  // zeros, or too small to scale (as zeros); or a NaN among them
    bool finite = amax == amax;  // (a NaN in the first vector can be dropped by the second's max: look)
    for (int i = 0; i < kQuantBlock && finite; ++i) finite = to_float(x[i]) == to_float(x[i]);
    return empty(finite ? 0.f : kNaN);
  }
  const VecF inv = VecF::set1(127.f / amax);
  VecF sum = VecF::zero(), first = VecF::zero();  // of the combined integers, exact in float32 (|256 h + l| * 32 < 2^24)
  for (int c = 0; c < V; ++c) {
    if (kHalves && c == V / 2) first = sum;
    const VecF y = v[c] * inv, h = VecF::round(y);
    h.store_int8(q + c * VecF::N);
    if (planes == 2) {
      const VecF l = VecF::min(VecF::max(VecF::round((y - h) * VecF::set1(256.f)), VecF::set1(-127.f)), VecF::set1(127.f));
      l.store_int8(q + kQuantBlock + c * VecF::N);
      sum = sum + VecF::fmadd(h, VecF::set1(256.f), l);
    } else {
      sum = sum + h;
    }
  }
  scale = planes == 2 ? amax / 127.f / 256.f : amax / 127.f;
  const float total = sum.reduce_add();  // one horizontal sum a block: they were the critical path
  if (total != total) return empty(kNaN);  // a NaN or infinite x (vmaxps can drop a NaN from amax; inf makes x * 0 NaN)
  isum = static_cast<int32_t>(total);
  if (kHalves) *isum_first = static_cast<int32_t>(first.reduce_add());
}

template <typename T>
void prepare_row(const T* x, int64_t k, Activations& a, int64_t row) {
  const int64_t at = row * a.blocks;
  if (a.planes == 0) {
    float* f = a.fx.data() + row * k;
    for (int64_t c = 0; c < k; ++c) f[c] = to_float(x[c]);
    for (int64_t b = 0; b < a.blocks; ++b) {
      float s = 0.f;
      for (int i = 0; i < kQuantBlock; ++i) s += f[b * kQuantBlock + i];
      a.fsum[at + b] = s;
    }
    return;
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    int8_t* q = a.q.data() + (at + b) * a.planes * kQuantBlock;
    if (a.halves) quantize_block<T, true>(x + b * kQuantBlock, a.planes, q, a.scale[at + b], a.isum[at + b], &a.isum_first[at + b]);
    else quantize_block<T, false>(x + b * kQuantBlock, a.planes, q, a.scale[at + b], a.isum[at + b], nullptr);
    a.fsum[at + b] = a.scale[at + b] * static_cast<float>(a.isum[at + b]);
    if (a.words) {
      int16_t* w = a.xw.data() + (at + b) * kQuantBlock;
      for (int i = 0; i < kQuantBlock; ++i) w[i] = static_cast<int16_t>(256 * q[i] + q[kQuantBlock + i]);
    }
  }
}

}  // namespace

// Room for x's blocks, sized before any thread writes them.
void size_for(const PackedLinearArgs& p, Activations& a) {
  a.planes = static_cast<int>(p.act), a.rows = p.rows, a.blocks = p.in_features / kQuantBlock;
  a.halves = packed_layout(p.qtype).halves, a.words = false;
  const size_t cells = static_cast<size_t>(a.rows * a.blocks);
  a.fsum.resize(cells);
  if (a.planes == 0) {
    a.fx.resize(cells * kQuantBlock);
  } else {
    a.q.resize(cells * a.planes * kQuantBlock), a.scale.resize(cells), a.isum.resize(cells);
    if (a.halves) a.isum_first.resize(cells);
    const PackedLayout L = packed_layout(p.qtype);
    a.words = a.planes == 2 && (a.rows > word_rows_above(L) || byte_words(L));
    if (a.words) a.xw.resize(cells * kQuantBlock);
  }
}

void prepare(const PackedLinearArgs& p, Activations& a, int64_t row) {
  if (p.x_dtype == DType::f32) prepare_row(static_cast<const float*>(p.x) + row * p.x_stride, p.in_features, a, row);
  else prepare_row(static_cast<const bf16*>(p.x) + row * p.x_stride, p.in_features, a, row);
}

}  // namespace appliance::APPLIANCE_ISA
