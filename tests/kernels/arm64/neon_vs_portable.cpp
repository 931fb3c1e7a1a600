// The arm64 NEON kernels against the portable ones on random inputs, built with the aarch64 cross
// compiler and run under qemu-aarch64 by tests/kernels/test_arm64.py (the portable kernels are
// themselves checked against torch on x86). Exit code: number of mismatches.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "kernels.h"
#include "vec.h"
using namespace appliance;
static std::mt19937 rng(1);
static std::vector<float> rnd(size_t n) { std::normal_distribution<float> d; std::vector<float> v(n); for (auto& x : v) x = d(rng); return v; }
static float maxdiff(const std::vector<float>& a, const std::vector<float>& b) { float m = 0; for (size_t i = 0; i < a.size(); ++i) m = std::fmax(m, std::fabs(a[i] - b[i])); return m; }
static std::vector<bf16> tobf(const std::vector<float>& v) { std::vector<bf16> o(v.size()); for (size_t i = 0; i < v.size(); ++i) o[i] = float_to_bf16(v[i]); return o; }
static std::vector<float> fromb(const std::vector<bf16>& v) { std::vector<float> o(v.size()); for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_float(v[i]); return o; }
int main() {
  int fails = 0;
  auto check = [&](const char* what, float d, float tol) { printf("%-28s max diff %.3g %s\n", what, d, d <= tol ? "ok" : "FAIL"); fails += d > tol; };
  const int64_t T = 5, H = 4109;
  auto x = rnd(T * H), w = rnd(H);
  std::vector<float> o1(T * H), o2(T * H);
  neon::rms_norm({DType::f32, o1.data(), x.data(), w.data(), T, H, H, H, 1e-5f});
  portable::rms_norm({DType::f32, o2.data(), x.data(), w.data(), T, H, H, H, 1e-5f});
  check("rms_norm f32", maxdiff(o1, o2), 1e-4);
  auto xb = tobf(x), wb = tobf(w); std::vector<bf16> b1(T * H), b2(T * H);
  neon::rms_norm({DType::bf16, b1.data(), xb.data(), wb.data(), T, H, H, H, 1e-5f});
  portable::rms_norm({DType::bf16, b2.data(), xb.data(), wb.data(), T, H, H, H, 1e-5f});
  check("rms_norm bf16", maxdiff(fromb(b1), fromb(b2)), 5e-2);
  const int64_t I = 1531; auto g = rnd(T * 2 * I); std::vector<float> s1(T * I), s2(T * I);
  for (auto& v : g) v *= 4;
  neon::silu_and_mul({DType::f32, s1.data(), g.data(), T, I, 2 * I, I});
  portable::silu_and_mul({DType::f32, s2.data(), g.data(), T, I, 2 * I, I});
  check("silu_and_mul f32", maxdiff(s1, s2), 1e-4);
  // attention: 2 sequences, GQA 9/3, head 64, block 16, contexts 37 and 70 with 37 and 4 new tokens
  const int64_t Hq = 9, Hk = 3, D = 64, B = 16, NB = 8;
  auto kc = rnd(NB * Hk * B * D), vc = rnd(NB * Hk * B * D);
  int32_t tables[2 * 5] = {3, 0, 7, -1, -1, 1, 6, 2, 5, 4};
  int32_t lens[2] = {37, 70};
  int64_t starts[3] = {0, 37, 41};
  auto q = rnd(41 * Hq * D); std::vector<float> a1(41 * Hq * D), a2(41 * Hq * D);
  AttentionArgs args{DType::f32, a1.data(), q.data(), kc.data(), vc.data(), tables, lens, starts, 2, Hq, Hk, D, B, 5, NB, Hq * D, Hq * D, 0.125f, DType::f32};
  neon::paged_attention(args); args.out = a2.data(); portable::paged_attention(args);
  check("paged_attention f32", maxdiff(a1, a2), 1e-4);
  auto qb = tobf(q), kb = tobf(kc), vb = tobf(vc); std::vector<bf16> c1(41 * Hq * D), c2(41 * Hq * D);
  AttentionArgs bargs{DType::bf16, c1.data(), qb.data(), kb.data(), vb.data(), tables, lens, starts, 2, Hq, Hk, D, B, 5, NB, Hq * D, Hq * D, 0.125f, DType::bf16};
  neon::paged_attention(bargs); bargs.out = c2.data(); portable::paged_attention(bargs);
  check("paged_attention bf16", maxdiff(fromb(c1), fromb(c2)), 2e-2);
  // a float16 cache under float32 q (the same layout as float32's, widened as it is loaded), and writing into it
  std::vector<f16> kh(kc.size()), vh(vc.size()), kh2(kc.size()), vh2(vc.size());
  for (size_t i = 0; i < kc.size(); ++i) kh[i] = from_float<f16>(kc[i]), vh[i] = from_float<f16>(vc[i]);
  std::vector<float> h1(41 * Hq * D), h2(41 * Hq * D);
  AttentionArgs hargs{DType::f32, h1.data(), q.data(), kh.data(), vh.data(), tables, lens, starts, 2, Hq, Hk, D, B, 5, NB, Hq * D, Hq * D, 0.125f, DType::f16};
  neon::paged_attention(hargs); hargs.out = h2.data(); portable::paged_attention(hargs);
  check("paged_attention f16 cache", maxdiff(h1, h2), 1e-4);
  int64_t slots[4] = {5, 40, 77, 127};
  auto nk = rnd(4 * Hk * D), nv = rnd(4 * Hk * D);
  nk[5] = 7e4f, nk[D + 2] = -1e9f, nv[3] = 65520.f, nv[D + 9] = -INFINITY;  // saturated to +-65,504 (vector and scalar)
  CacheWriteArgs wargs{DType::f32, nk.data(), nv.data(), kh.data(), vh.data(), slots, 4, Hk, D, B, NB, Hk * D, Hk * D, DType::f16};
  kh2 = kh, vh2 = vh;
  neon::write_kv_cache(wargs); wargs.key_cache = kh2.data(), wargs.value_cache = vh2.data(); portable::write_kv_cache(wargs);
  int differ = 0;
  for (size_t i = 0; i < kh.size(); ++i) differ += kh[i].bits != kh2[i].bits || vh[i].bits != vh2[i].bits;
  check("write_kv_cache f16 (bits)", static_cast<float>(differ), 0);
  // attention over key tiles of several 8-token blocks, head_dim 72 (not a multiple of the vector),
  // GQA 6/2: a 150-token prompt and a 5-token extend after 88 cached tokens
  const int64_t Hq2 = 6, Hk2 = 2, D2 = 72, B2 = 8, NB2 = 32, M2 = 19;
  auto kc2 = rnd(NB2 * Hk2 * B2 * D2), vc2 = rnd(NB2 * Hk2 * B2 * D2);
  std::vector<int32_t> tables2(2 * M2, -1);
  for (int b = 0; b < 19; ++b) tables2[b] = 18 - b;           // sequence 0: blocks 18..0
  for (int b = 0; b < 12; ++b) tables2[M2 + b] = 19 + b;      // sequence 1: blocks 19..30
  int32_t lens2[2] = {150, 93};
  int64_t starts2[3] = {0, 150, 155};
  auto q2 = rnd(155 * Hq2 * D2); std::vector<float> e1(q2.size()), e2(q2.size());
  AttentionArgs args2{DType::f32, e1.data(), q2.data(), kc2.data(), vc2.data(), tables2.data(), lens2, starts2, 2, Hq2, Hk2, D2, B2, M2, NB2, Hq2 * D2, Hq2 * D2, 0.125f, DType::f32};
  neon::paged_attention(args2); args2.out = e2.data(); portable::paged_attention(args2);
  check("paged_attention B8 D72 f32", maxdiff(e1, e2), 1e-4);
  // rope
  const int64_t P = 64, rot = 64; std::vector<float> cs(P * rot); for (int64_t p = 0; p < P; ++p) for (int64_t i = 0; i < rot / 2; ++i) { double a = p * std::pow(10000.0, -2.0 * i / rot); cs[p * rot + i] = std::cos(a); cs[p * rot + rot / 2 + i] = std::sin(a); }
  int64_t pos[5] = {0, 3, 17, 63, 9}; auto rq = rnd(5 * Hq * D), rk = rnd(5 * Hk * D); auto rq2 = rq, rk2 = rk;
  neon::rotary_embedding({DType::f32, rq.data(), rk.data(), pos, cs.data(), 5, Hq, Hk, D, rot, Hq * D, Hk * D, P});
  portable::rotary_embedding({DType::f32, rq2.data(), rk2.data(), pos, cs.data(), 5, Hq, Hk, D, rot, Hq * D, Hk * D, P});
  check("rotary f32", std::fmax(maxdiff(rq, rq2), maxdiff(rk, rk2)), 1e-5);
  // kept-quantized linear, Q4_1 blocks (fp16 d = 0.01, m = -0.05; random nibbles), 3 x 96 @ (37 x 96)^T
  const int64_t QN = 37, QK = 96, QM = 3;
  std::vector<uint8_t> qw(QN * QK / 32 * 20);
  for (size_t b = 0; b < qw.size(); b += 20) { qw[b] = 0x1f; qw[b + 1] = 0x21; qw[b + 2] = 0x66; qw[b + 3] = 0xaa; for (int i = 4; i < 20; ++i) qw[b + i] = rng() & 0xff; }
  std::vector<uint8_t> packed(packed_bytes(QType::q4_1, QN, QK)), packed2(packed.size());
  neon::pack_quant({QType::q4_1, qw.data(), packed.data(), QN, QK});
  portable::pack_quant({QType::q4_1, qw.data(), packed2.data(), QN, QK});
  check("pack_quant q4_1", packed == packed2 ? 0.f : 1.f, 0.f);
  auto qx = rnd(QM * QK); std::vector<float> qo1(QM * QN), qo2(QM * QN);
  for (ActQuant act : {ActQuant::int16, ActQuant::none}) {
    neon::packed_linear({QType::q4_1, act, DType::f32, DType::f32, qo1.data(), qx.data(), packed.data(), QM, QK, QN, QK, QN});
    portable::packed_linear({QType::q4_1, act, DType::f32, DType::f32, qo2.data(), qx.data(), packed.data(), QM, QK, QN, QK, QN});
    check(act == ActQuant::int16 ? "packed_linear q4_1 int16" : "packed_linear q4_1 float", maxdiff(qo1, qo2), 1e-4);
  }
  // bfloat16 weights packed (BF16): rows of random bf16 values; x float32, then bfloat16
  std::vector<uint16_t> bw(QN * QK);
  for (auto& v : bw) { const float f = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) * 1e-4f; uint32_t u; std::memcpy(&u, &f, 4); v = static_cast<uint16_t>(u >> 16); }
  std::vector<uint8_t> bpacked(packed_bytes(QType::bf16, QN, QK)), bpacked2(bpacked.size());
  neon::pack_quant({QType::bf16, reinterpret_cast<const uint8_t*>(bw.data()), bpacked.data(), QN, QK});
  portable::pack_quant({QType::bf16, reinterpret_cast<const uint8_t*>(bw.data()), bpacked2.data(), QN, QK});
  check("pack_quant bf16", bpacked == bpacked2 ? 0.f : 1.f, 0.f);
  neon::packed_linear({QType::bf16, ActQuant::int16, DType::f32, DType::f32, qo1.data(), qx.data(), bpacked.data(), QM, QK, QN, QK, QN});
  portable::packed_linear({QType::bf16, ActQuant::int16, DType::f32, DType::f32, qo2.data(), qx.data(), bpacked.data(), QM, QK, QN, QK, QN});
  check("packed_linear bf16 f32 x", maxdiff(qo1, qo2), 1e-4);
  std::vector<uint16_t> bx(QM * QK);
  for (size_t i = 0; i < bx.size(); ++i) { uint32_t u; std::memcpy(&u, &qx[i], 4); bx[i] = static_cast<uint16_t>(u >> 16); }
  neon::packed_linear({QType::bf16, ActQuant::int16, DType::bf16, DType::f32, qo1.data(), bx.data(), bpacked.data(), QM, QK, QN, QK, QN});
  portable::packed_linear({QType::bf16, ActQuant::int16, DType::bf16, DType::f32, qo2.data(), bx.data(), bpacked.data(), QM, QK, QN, QK, QN});
  check("packed_linear bf16 bf16 x", maxdiff(qo1, qo2), 1e-4);
  // Q8_H32 (a converted Q6_K: a byte a weight, u - 32, float32 d per 16 weights): its own tile, x's
  // quantization keeping each half block's sum; 7 x 96 @ (37 x 96)^T at int16 and int8
  std::vector<uint8_t> hw(QN * QK / 32 * 40);
  for (size_t b = 0; b < hw.size(); b += 40) {
    const float d0 = 0.002f * (1 + rng() % 7), d1 = -0.003f * (1 + rng() % 5);
    std::memcpy(&hw[b], &d0, 4), std::memcpy(&hw[b + 4], &d1, 4);
    for (int i = 8; i < 40; ++i) hw[b + i] = rng() % 64;
  }
  std::vector<uint8_t> hpacked(packed_bytes(QType::q8_h32, QN, QK)), hpacked2(hpacked.size());
  neon::pack_quant({QType::q8_h32, hw.data(), hpacked.data(), QN, QK});
  portable::pack_quant({QType::q8_h32, hw.data(), hpacked2.data(), QN, QK});
  check("pack_quant q8_h32", hpacked == hpacked2 ? 0.f : 1.f, 0.f);
  const int64_t HM = 7;
  auto hx = rnd(HM * QK); std::vector<float> ho1(HM * QN), ho2(HM * QN);
  for (ActQuant act : {ActQuant::int16, ActQuant::int8}) {
    neon::packed_linear({QType::q8_h32, act, DType::f32, DType::f32, ho1.data(), hx.data(), hpacked.data(), HM, QK, QN, QK, QN});
    portable::packed_linear({QType::q8_h32, act, DType::f32, DType::f32, ho2.data(), hx.data(), hpacked.data(), HM, QK, QN, QK, QN});
    check(act == ActQuant::int16 ? "packed_linear q8_h32 int16" : "packed_linear q8_h32 int8", maxdiff(ho1, ho2), 1e-4);
  }
  // Q2_K to Q6_K and IQ4_XS in their superblocks, and IQ4_NL, Q5_0, Q5_1 (random bytes, small positive fp16
  // scales): codes times the superblock's scalars in the tile, the IQ4 codebook looked up, the fifth and
  // sixth bits added from their planes; 7 x 512 @ (37 x 512)^T at int16, int8 and float activations
  const int64_t SK = 512;
  auto sx = rnd(HM * SK);
  for (QType q : {QType::q2_k, QType::q3_k, QType::q4_k, QType::q5_k, QType::q6_k, QType::iq4_xs, QType::iq4_nl,
                  QType::q5_0, QType::q5_1}) {
    const int64_t block = quant_block_bytes(q);
    std::vector<uint8_t> sw(QN * quant_row_bytes(q, SK));
    for (auto& v : sw) v = rng() & 0xff;
    for (size_t b = 0; b < sw.size(); b += block)
      for (int64_t at : q == QType::q6_k   ? std::vector<int64_t>{208}
                        : q == QType::q2_k ? std::vector<int64_t>{80, 82}
                        : q == QType::q3_k ? std::vector<int64_t>{108}
                        : q == QType::iq4_xs || q == QType::iq4_nl || q == QType::q5_0 ? std::vector<int64_t>{0}
                                                                   : std::vector<int64_t>{0, 2}) {
        const uint16_t h = static_cast<uint16_t>(0x0400 + rng() % 0x800);  // 2^-14 .. 2^-12: weights within +-1
        std::memcpy(&sw[b + at], &h, 2);
      }
    std::vector<uint8_t> sp(packed_bytes(q, QN, SK)), sp2(sp.size());
    neon::pack_quant({q, sw.data(), sp.data(), QN, SK});
    portable::pack_quant({q, sw.data(), sp2.data(), QN, SK});
    const char* name = q == QType::q2_k ? "q2_k" : q == QType::q3_k ? "q3_k" : q == QType::q4_k ? "q4_k" : q == QType::q5_k ? "q5_k"
                     : q == QType::q6_k ? "q6_k" : q == QType::iq4_xs ? "iq4_xs" : q == QType::iq4_nl ? "iq4_nl"
                     : q == QType::q5_0 ? "q5_0" : "q5_1";
    check((std::string("pack_quant ") + name).c_str(), sp == sp2 ? 0.f : 1.f, 0.f);
    std::vector<float> so1(HM * QN), so2(HM * QN);
    for (ActQuant act : {ActQuant::int16, ActQuant::int8, ActQuant::none}) {
      neon::packed_linear({q, act, DType::f32, DType::f32, so1.data(), sx.data(), sp.data(), HM, SK, QN, SK, QN});
      portable::packed_linear({q, act, DType::f32, DType::f32, so2.data(), sx.data(), sp.data(), HM, SK, QN, SK, QN});
      check((std::string("packed_linear ") + name).c_str(), maxdiff(so1, so2), 1e-4);
    }
  }
  printf("%s\n", fails ? "NEON DIFFERS" : "NEON matches portable");
  return fails;
}
