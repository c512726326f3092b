// Internal: which CUDA kernel family runs a call, and how much shared memory per block its
// configuration may use. Pure functions of (compute capability, the device's opt-in shared
// memory, what the caller asked for), so they are tested without a GPU; the CUDA dispatch
// (src/cuda/dispatch.cu) feeds them the device's numbers.
#pragma once

#include <string>

#include "flashattn/attention.hpp"

namespace flashattn::detail {

// The oldest GPU the CUDA backend runs (sm80 family: mma.sync, ldmatrix, cp.async).
inline constexpr int kMinComputeCapability = 80;
// The smallest opt-in shared memory per block of a supported GPU (sm86 / sm89: 99 KiB);
// every sm80 head-dim bucket has a forward configuration within it, and the lowest cap
// Options::smem_cap accepts.
inline constexpr int kMinSmemPerBlock = 99 * 1024;

// What the caller asked for: Options::kernel_family / smem_cap, or the environment
// (FLASHATTN_KERNEL_FAMILY, FLASHATTN_SMEM_CAP) where those are at their defaults.
struct KernelRequest {
  KernelFamily family = KernelFamily::kAuto;
  int smem_cap = 0;  // 0 = the device's limit
};

struct KernelChoice {
  KernelFamily family = KernelFamily::kSm80;  // never kAuto
  int smem_limit = 0;  // bytes per block a configuration may use: min(device, cap)
};

// The family and shared-memory limit for a call on a device of compute capability `cc`
// (major * 10 + minor) with `smem_optin` bytes of opt-in shared memory per block. Auto takes
// sm90 on cc 9.0 when `sm90_built`, else sm80. Throws Unsupported (naming the capability)
// below sm80, or when sm90 is forced on anything but cc 9.0 (sm90a code runs there only).
// A forced sm90 in a build without it still resolves to sm90: the family's own check
// (sm90::fwd_unsupported: "not built") sends the call back to sm80.
KernelChoice choose_kernel_family(const char* fn, int cc, int smem_optin, KernelRequest request,
                                  bool sm90_built);

const char* kernel_family_name(KernelFamily f) noexcept;  // "auto", "sm80", "sm90"
std::string compute_capability_string(int cc);             // "compute capability 8.6"

// One environment variable's parse: its value or what was wrong with it.
struct EnvParse {
  bool ok = true;
  std::string name, expected, actual;  // for InvalidArgument when !ok
};
struct KernelEnv {
  KernelRequest request;  // defaults where a variable is unset or empty
  EnvParse family, smem_cap;
};
// Parses the two variables' values (nullptr = unset): FLASHATTN_KERNEL_FAMILY = auto | sm80 |
// sm90, FLASHATTN_SMEM_CAP = 0 or a byte count >= kMinSmemPerBlock.
KernelEnv parse_kernel_env(const char* family, const char* smem_cap);
// The process's environment, read and parsed once (thread-safe).
const KernelEnv& kernel_env();

}  // namespace flashattn::detail
