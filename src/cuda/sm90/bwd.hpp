// The sm90a (Hopper) backward family: the main kernel (TMA, wgmma, warp-specialized) run
// inside the backward pipeline that both families share (workspace, preprocess D,
// postprocess dQ: sm80::backward with this family's main kernel). The dispatch asks
// bwd_unsupported() first and runs the sm80 main kernel, with a debug log naming the
// reason, when it is not null.
#pragma once

#include "core/params.hpp"
#include "cuda/collective/bwd_workspace.hpp"

namespace flashattn::detail::cuda::sm90 {

// nullptr when the sm90a backward runs this call on device p.device_index (a Hopper
// GPU); else a short reason, e.g. "dropout", "head dim", "not built".
const char* bwd_unsupported(const BwdParams& p) noexcept;

// The main kernel: dK, dV written, dQ added to ws.dq_accum, on `stream` (cudaStream_t).
// Precondition: bwd_unsupported(p) == nullptr.
void run_bwd_main(const BwdParams& p, const BwdWorkspace& ws, void* stream);

}  // namespace flashattn::detail::cuda::sm90
