// Picks the kernel implementation for this CPU at load time; never one the CPU cannot run.
#include <atomic>
#include <cstring>
#include <mutex>

#include "kernels.h"

namespace appliance {
namespace {

#define APPLIANCE_TABLE(isa) \
  KernelTable { #isa, isa::rms_norm, isa::add_rms_norm, isa::rotary_embedding, isa::silu_and_mul, \
                isa::write_kv_cache, isa::paged_attention, isa::linear_f32_out, isa::pack_quant, \
                isa::packed_linear, isa::packed_rows, isa::dequantize, isa::widens_prompts }

#if defined(__x86_64__)
const KernelTable kTables[] = {APPLIANCE_TABLE(avx512bf16), APPLIANCE_TABLE(avx512), APPLIANCE_TABLE(avx2),
                               APPLIANCE_TABLE(portable)};
const char* const kCompiled[] = {"avx512bf16", "avx512", "avx2", "portable", nullptr};

bool cpu_supports(const char* isa) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  // the avx512bf16 tier also uses VNNI's vpdpbusd; every CPU with AVX512-BF16 has it
  if (!std::strcmp(isa, "avx512bf16")) return avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  if (!std::strcmp(isa, "avx512")) return avx512;
  if (!std::strcmp(isa, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return !std::strcmp(isa, "portable");
}
#elif defined(__aarch64__)
const KernelTable kTables[] = {APPLIANCE_TABLE(neon), APPLIANCE_TABLE(portable)};
const char* const kCompiled[] = {"neon", "portable", nullptr};

bool cpu_supports(const char* isa) { return !std::strcmp(isa, "neon") || !std::strcmp(isa, "portable"); }
#else
const KernelTable kTables[] = {APPLIANCE_TABLE(portable)};
const char* const kCompiled[] = {"portable", nullptr};

bool cpu_supports(const char* isa) { return !std::strcmp(isa, "portable"); }
#endif

const KernelTable* find(const char* name) {
  for (const KernelTable& table : kTables)
    if (!std::strcmp(table.isa, name)) return &table;
  return nullptr;
}

const KernelTable* g_current = nullptr;

}  // namespace

const char* best_isa() {
  for (const KernelTable& table : kTables)  // ordered best first
    if (cpu_supports(table.isa)) return table.isa;
  return "portable";
}

const char* const* compiled_isas() { return kCompiled; }

bool select_isa(const char* name) {
  const KernelTable* table = find(name);
  if (table == nullptr || !cpu_supports(name)) return false;
  g_current = table;
  return true;
}

namespace {
std::atomic<int> g_bf16_dot{static_cast<int>(Bf16Dot::automatic)};
std::once_flag g_ratio_once;
double g_ratio = 0.0;
constexpr double kBf16DotRatio = 0.5;  // vdpbf16ps' rate, as a fraction of the FMA's, from which it pays
}  // namespace

double bf16_dot_ratio() {
  std::call_once(g_ratio_once, [] {
#if defined(__x86_64__)
    if (cpu_supports("avx512bf16")) g_ratio = avx512bf16::bf16_dot_issue_ratio();
#endif
  });
  return g_ratio;
}

void set_bf16_dot(Bf16Dot mode) { g_bf16_dot.store(static_cast<int>(mode)); }
Bf16Dot bf16_dot_mode() { return static_cast<Bf16Dot>(g_bf16_dot.load()); }

bool bf16_dot() {
  switch (static_cast<Bf16Dot>(g_bf16_dot.load(std::memory_order_relaxed))) {
    case Bf16Dot::on: return true;
    case Bf16Dot::off: return false;
    default: return bf16_dot_ratio() >= kBf16DotRatio;
  }
}

namespace {
std::atomic<int> g_int_tiles{static_cast<int>(IntTiles::automatic)};
std::once_flag g_int_ratio_once;
double g_int_ratio = 0.0;
constexpr double kWideIntTiles = 0.75;  // vpmaddubsw's rate, as a fraction of the FMA's, from which wide tiles pay
}  // namespace

double int_mul_ratio() {
  std::call_once(g_int_ratio_once, [] {
#if defined(__x86_64__)
    if (cpu_supports("avx2")) g_int_ratio = avx2::int_mul_issue_ratio();
#endif
  });
  return g_int_ratio;
}

void set_int_tiles(IntTiles mode) { g_int_tiles.store(static_cast<int>(mode)); }
IntTiles int_tiles_mode() { return static_cast<IntTiles>(g_int_tiles.load()); }

bool wide_int_tiles() {
  switch (static_cast<IntTiles>(g_int_tiles.load(std::memory_order_relaxed))) {
    case IntTiles::wide: return true;
    case IntTiles::narrow: return false;
    default: return int_mul_ratio() >= kWideIntTiles;
  }
}

const KernelTable& kernels() {
  if (g_current == nullptr) g_current = find(best_isa());
  return *g_current;
}

}  // namespace appliance
