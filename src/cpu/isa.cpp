#include "cpu/isa.hpp"

#include <atomic>
#include <cstdlib>
#include <string>

#include "cpu/bf16_kernels.hpp"
#include "flashattn/error.hpp"

namespace flashattn::detail::cpu {
namespace {

constexpr const char* kEnvName = "FLASHATTN_CPU_ISA (environment)";

bool cpu_has_avx512bf16() noexcept {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return bf16x::built() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

Isa best_isa() noexcept { return cpu_has_avx512bf16() ? Isa::kAvx512Bf16 : Isa::kAvx2; }

std::string supported_list() {
  std::string s = "avx2";
  if (isa_supported(Isa::kAvx512Bf16)) s += " or avx512bf16";
  return s;
}

// The environment's choice, parsed once: the path, or the error to raise on every call.
struct EnvChoice {
  Isa isa = Isa::kAvx2;
  bool bad_value = false, unsupported = false;
  std::string value;
};

const EnvChoice& env_choice() {
  static const EnvChoice choice = [] {
    EnvChoice c;
    const char* v = std::getenv("FLASHATTN_CPU_ISA");
    if (v == nullptr || *v == '\0') {
      c.isa = best_isa();
      return c;
    }
    c.value = v;
    if (c.value == "avx2") {
      c.isa = Isa::kAvx2;
    } else if (c.value == "avx512bf16") {
      c.isa = Isa::kAvx512Bf16;
      c.unsupported = !isa_supported(c.isa);
    } else {
      c.bad_value = true;
    }
    return c;
  }();
  return choice;
}

// -1: no override, else the Isa's value.
std::atomic<int> g_override{-1};

}  // namespace

const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512Bf16: return "avx512bf16";
  }
  return "?";
}

bool isa_supported(Isa isa) noexcept {
  if (isa == Isa::kAvx2) return true;
  static const bool bf16 = cpu_has_avx512bf16();
  return bf16;
}

Isa active_isa() {
  const int o = g_override.load(std::memory_order_relaxed);
  if (o >= 0) return static_cast<Isa>(o);
  const EnvChoice& c = env_choice();
  if (c.bad_value)
    throw InvalidArgument("flashattn (CPU backend)", kEnvName, "avx2 or avx512bf16", "'" + c.value + "'");
  if (c.unsupported)
    throw Unsupported("flashattn (CPU backend)", kEnvName,
                      "a path this CPU supports (" + supported_list() + ")", "'" + c.value + "'");
  return c.isa;
}

void set_isa_override(std::optional<Isa> isa) {
  if (isa && !isa_supported(*isa))
    throw Unsupported("flashattn (CPU backend)", "set_isa_override",
                      "a path this CPU supports (" + supported_list() + ")", isa_name(*isa));
  g_override.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

}  // namespace flashattn::detail::cpu
