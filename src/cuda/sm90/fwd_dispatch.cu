// Placeholder until the sm90a forward lands: the family is not built, every call falls back.
#include "cuda/sm90/fwd.hpp"

namespace flashattn::detail::cuda::sm90 {
bool fwd_built() noexcept { return false; }
const char* fwd_unsupported(const FwdParams&) noexcept { return "not built"; }
void run_fwd(const FwdParams&) {}
}  // namespace flashattn::detail::cuda::sm90
