// The sm90a (Hopper) forward family: TMA, wgmma and warp-specialized kernels.
// The dispatch (src/cuda) asks fwd_unsupported() first and falls back to the sm80 family
// with a debug log naming the reason when it is not null.
#pragma once

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm90 {

// Whether the sm90a forward kernels were compiled into this build (90 in
// FLASHATTN_CUDA_ARCHS).
bool fwd_built() noexcept;

// nullptr when the sm90a forward runs this call on device p.device_index (a Hopper GPU);
// else a short reason, e.g. "dropout", "paged KV cache", "not built".
const char* fwd_unsupported(const FwdParams& p) noexcept;

// Launches the sm90a forward on p.stream. Precondition: fwd_unsupported(p) == nullptr.
void run_fwd(const FwdParams& p);

}  // namespace flashattn::detail::cuda::sm90
