// The sm80 forward entry of one kernel instantiation (head-dim bucket x element type).
// Each is explicitly instantiated in its own generated translation unit
// (src/cuda/manifest.cmake, fwd.inst.cu.in); fwd_dispatch.cu picks one per call.
#pragma once

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm80 {

// Launches the fused forward on p.stream; p is validated, p.d <= kHeadDim.
template <int kHeadDim, typename Element>
void run_fwd(const FwdParams& p);

}  // namespace flashattn::detail::cuda::sm80
