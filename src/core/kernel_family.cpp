#include "core/kernel_family.hpp"

#include <cerrno>
#include <cstdlib>
#include <limits>

#include "flashattn/error.hpp"

namespace flashattn::detail {

const char* kernel_family_name(KernelFamily f) noexcept {
  switch (f) {
    case KernelFamily::kAuto: return "auto";
    case KernelFamily::kSm80: return "sm80";
    case KernelFamily::kSm90: return "sm90";
  }
  return "unknown";
}

std::string compute_capability_string(int cc) {
  return "compute capability " + std::to_string(cc / 10) + "." + std::to_string(cc % 10);
}

KernelChoice choose_kernel_family(const char* fn, int cc, int smem_optin, KernelRequest request,
                                  bool sm90_built) {
  if (cc < kMinComputeCapability) {
    throw Unsupported(fn, "q", "a GPU of compute capability >= 8.0 (the sm80 kernel family)",
                      compute_capability_string(cc));
  }
  KernelChoice choice;
  switch (request.family) {
    case KernelFamily::kAuto:
      choice.family = cc == 90 && sm90_built ? KernelFamily::kSm90 : KernelFamily::kSm80;
      break;
    case KernelFamily::kSm80:
      choice.family = KernelFamily::kSm80;
      break;
    case KernelFamily::kSm90:
      if (cc != 90) {
        throw Unsupported(fn, "opts.kernel_family",
                          "sm90 only on a GPU of compute capability 9.0 (sm90a: H100, H200)",
                          "sm90 forced on a GPU of " + compute_capability_string(cc));
      }
      choice.family = KernelFamily::kSm90;
      break;
  }
  choice.smem_limit = smem_optin;
  if (request.smem_cap > 0 && request.smem_cap < choice.smem_limit) choice.smem_limit = request.smem_cap;
  return choice;
}

KernelEnv parse_kernel_env(const char* family, const char* smem_cap) {
  KernelEnv env;
  if (family != nullptr && *family != '\0') {
    const std::string v = family;
    if (v == "auto") {
      env.request.family = KernelFamily::kAuto;
    } else if (v == "sm80") {
      env.request.family = KernelFamily::kSm80;
    } else if (v == "sm90") {
      env.request.family = KernelFamily::kSm90;
    } else {
      env.family = {false, "FLASHATTN_KERNEL_FAMILY (environment)", "auto, sm80 or sm90", "'" + v + "'"};
    }
  }
  if (smem_cap != nullptr && *smem_cap != '\0') {
    const std::string v = smem_cap;
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    const bool number = end != v.c_str() && *end == '\0' && errno == 0 && v[0] != '-' && v[0] != '+';
    if (number && (n == 0 || (n >= kMinSmemPerBlock && n <= std::numeric_limits<int>::max()))) {
      env.request.smem_cap = static_cast<int>(n);
    } else {
      env.smem_cap = {false, "FLASHATTN_SMEM_CAP (environment)",
                      "0 (the device's limit) or a byte count >= " + std::to_string(kMinSmemPerBlock),
                      "'" + v + "'"};
    }
  }
  return env;
}

const KernelEnv& kernel_env() {
  static const KernelEnv env =
      parse_kernel_env(std::getenv("FLASHATTN_KERNEL_FAMILY"), std::getenv("FLASHATTN_SMEM_CAP"));
  return env;
}

}  // namespace flashattn::detail
