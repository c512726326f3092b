// A build without the sm90 target: the family is not built, every call falls back.
#include "cuda/sm90/fwd.hpp"

namespace flashattn::detail::cuda::sm90 {
bool fwd_built() noexcept { return false; }
const char* fwd_unsupported(const FwdParams&) noexcept { return "not built (no 90 in FLASHATTN_CUDA_ARCHS)"; }
void run_fwd(const FwdParams&) {}
}  // namespace flashattn::detail::cuda::sm90
