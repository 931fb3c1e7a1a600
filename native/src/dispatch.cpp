// Picks the kernel implementation for this CPU at load time; never one the CPU cannot run.
#include <atomic>
#include <cstring>
#include <mutex>
#include <string_view>

#include "kernels.h"

namespace appliance {
namespace {

#define APPLIANCE_TABLE(isa) \
  KernelTable { #isa, isa::rms_norm, isa::add_rms_norm, isa::rotary_embedding, isa::silu_and_mul, \
                isa::write_kv_cache, isa::paged_attention, isa::linear_f32_out, isa::pack_quant, \
                isa::packed_linear, isa::packed_linears, isa::packed_rows, isa::dequantize, isa::widens_prompts, \
                std::string_view(#isa) == "avx512bf16" }

#if defined(__x86_64__)
const KernelTable kTables[] = {APPLIANCE_TABLE(avx512bf16), APPLIANCE_TABLE(avx512), APPLIANCE_TABLE(avx2),
                               APPLIANCE_TABLE(portable)};
const char* const kCompiled[] = {"avx512bf16", "avx512", "avx2", "portable", nullptr};

bool cpu_supports(const char* isa) {
  __builtin_cpu_init();
  // every x86 tier but portable is built with -mavx2 -mfma -mf16c (F16C: quantized blocks' float16 scales, float16
  // weights and caches)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  // the avx512bf16 tier also uses VNNI's vpdpbusd; every CPU with AVX512-BF16 has it
  if (!std::strcmp(isa, "avx512bf16")) return avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  if (!std::strcmp(isa, "avx512")) return avx512;
  if (!std::strcmp(isa, "avx2")) return avx2;
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

std::atomic<const KernelTable*> g_current{nullptr};  // set before the kernels run; read from OpenMP workers too

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
  g_current.store(table, std::memory_order_relaxed);
  return true;
}

namespace {
// A kernel choice that this CPU's instruction rates make (measured once a process, on first use: the issue rate
// of one instruction as a fraction of vfmadd231ps'), unless the caller forces it. mode: 0 measures; else the
// forced value of the choice's enum.
struct MeasuredChoice {
  std::atomic<int> mode{0};
  std::once_flag once;
  double ratio = 0.0;

  double measured(const char* isa, double (*probe)()) {
    std::call_once(once, [&] {
      if (probe != nullptr && cpu_supports(isa)) ratio = probe();
    });
    return ratio;
  }
  // the forced choice (`yes`: the enum's value for true), or whether the measured ratio reaches `threshold`
  bool chosen(int yes, const char* isa, double (*probe)(), double threshold) {
    const int forced = mode.load(std::memory_order_relaxed);
    return forced != 0 ? forced == yes : measured(isa, probe) >= threshold;
  }
};

#if defined(__x86_64__)
double (*const kBf16DotProbe)() = avx512bf16::bf16_dot_issue_ratio;
double (*const kIntMulProbe)() = avx2::int_mul_issue_ratio;
#else
double (*const kBf16DotProbe)() = nullptr;
double (*const kIntMulProbe)() = nullptr;
#endif

MeasuredChoice g_bf16_dot;  // Bf16Dot
constexpr double kBf16DotRatio = 0.5;  // vdpbf16ps' rate, as a fraction of the FMA's, from which it pays
MeasuredChoice g_int_tiles;  // IntTiles
constexpr double kWideIntTiles = 0.75;  // vpmaddubsw's rate, as a fraction of the FMA's, from which wide tiles pay
}  // namespace

double bf16_dot_ratio() { return g_bf16_dot.measured("avx512bf16", kBf16DotProbe); }
void set_bf16_dot(Bf16Dot mode) { g_bf16_dot.mode.store(static_cast<int>(mode)); }
Bf16Dot bf16_dot_mode() { return static_cast<Bf16Dot>(g_bf16_dot.mode.load()); }
bool bf16_dot() {
  return g_bf16_dot.chosen(static_cast<int>(Bf16Dot::on), "avx512bf16", kBf16DotProbe, kBf16DotRatio);
}

double int_mul_ratio() { return g_int_tiles.measured("avx2", kIntMulProbe); }
void set_int_tiles(IntTiles mode) { g_int_tiles.mode.store(static_cast<int>(mode)); }
IntTiles int_tiles_mode() { return static_cast<IntTiles>(g_int_tiles.mode.load()); }
bool wide_int_tiles() {
  return g_int_tiles.chosen(static_cast<int>(IntTiles::wide), "avx2", kIntMulProbe, kWideIntTiles);
}

namespace {
std::atomic<int> g_amx_mode{0};  // AmxTiles
std::once_flag g_amx_once;
const char* g_amx_why = "not an x86-64 build";  // null: this process may use the CPU's tile multiplies

bool amx_usable() {
#if defined(__x86_64__)
  std::call_once(g_amx_once, [] {
    g_amx_why = cpu_supports("avx512bf16") ? avx512bf16::amx_check() : "the CPU has no AVX512-BF16 and VNNI";
  });
#endif
  return g_amx_why == nullptr;
}
}  // namespace

void set_amx_tiles(AmxTiles mode) { g_amx_mode.store(static_cast<int>(mode)); }
AmxTiles amx_tiles_mode() { return static_cast<AmxTiles>(g_amx_mode.load()); }
AmxRows amx_in_force() {
  switch (amx_tiles_mode()) {
    case AmxTiles::off: return AmxRows::none;
    case AmxTiles::emulated: return AmxRows::emulated;
    default: return amx_usable() && kernels().amx_tiles ? AmxRows::hardware : AmxRows::none;
  }
}
const char* amx_status() {
  switch (amx_in_force()) {
    case AmxRows::hardware: return "in use";
    case AmxRows::emulated: return "emulated in software (tests)";
    default:
      if (amx_tiles_mode() == AmxTiles::off) return "off";
      return amx_usable() ? "usable, but the kernels in force are not avx512bf16" : g_amx_why;
  }
}

namespace {
alignas(64) std::atomic<int64_t> g_amx_row_chunks{0};  // (a line of its own: the hot path reads its neighbours)
}
void count_amx_row_chunk() { g_amx_row_chunks.fetch_add(1, std::memory_order_relaxed); }
int64_t amx_row_chunks() { return g_amx_row_chunks.load(std::memory_order_relaxed); }

const KernelTable& kernels() {
  const KernelTable* current = g_current.load(std::memory_order_relaxed);
  if (current == nullptr) {
    current = find(best_isa());
    g_current.store(current, std::memory_order_relaxed);
  }
  return *current;
}

}  // namespace appliance
