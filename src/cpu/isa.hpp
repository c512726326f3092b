// Runtime choice of the CPU backend's instruction-set path.
//
// The backend is compiled for a portable baseline (x86-64-v3: AVX2 + FMA, or the
// compiler's default off x86). Kernels that need more live in their own translation units
// compiled with the extra -m flags (bf16_avx512.cpp) and are called only when the path
// chosen here allows it:
//   kAvx2        the baseline everywhere (the name of the x86-64-v3 build; also the only
//                path off x86);
//   kAvx512Bf16  AVX-512 F/BW/VL/DQ + AVX512_BF16 (vdpbf16ps): products of two bf16 inputs
//                (Q K^T, dO V^T) as bf16 dot products (docs/semantics.md, CPU backend).
// The path is chosen once per process: FLASHATTN_CPU_ISA=avx2|avx512bf16 when set, else
// the best the CPU supports (cpuid). Tests switch paths with set_isa_override.
#pragma once

#include <optional>

namespace flashattn::detail::cpu {

enum class Isa { kAvx2, kAvx512Bf16 };

// "avx2" or "avx512bf16" (the FLASHATTN_CPU_ISA spelling).
const char* isa_name(Isa isa) noexcept;

// Whether this CPU (and this build) can run the path.
bool isa_supported(Isa isa) noexcept;

// The path of the calls made now: the override when set, else FLASHATTN_CPU_ISA (read once),
// else the best supported one. Throws InvalidArgument naming FLASHATTN_CPU_ISA for an unknown
// value and Unsupported for a path this CPU lacks.
Isa active_isa();

// Tests: forces the path of later calls (std::nullopt: back to the environment / cpuid
// choice). Throws Unsupported when the CPU lacks the path. Not for concurrent calls.
void set_isa_override(std::optional<Isa> isa);

}  // namespace flashattn::detail::cpu
