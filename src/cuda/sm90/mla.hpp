// The sm90a (Hopper) MLA kernel (mla_kernel.cuh: FlashAttention-3's qv on wgmma and TMA):
// the dispatch (src/cuda/dispatch.cu) asks mla_unsupported() first and runs the sm80 MLA
// kernel, with a debug log naming the reason, where it is not null.
#pragma once

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm90 {

// nullptr when the sm90 MLA kernel runs this call with p.qv on device p.device_index (a
// Hopper GPU); else a short reason. What neither MLA kernel covers (sm80::plan_mla's
// Unsupported errors: fp8 caches, d > 64, d_v > 512, tree masks, dropout, ...) is not
// answered here: run_mla raises those errors as the sm80 path does.
const char* mla_unsupported(const FwdParams& p) noexcept;

// Launches it on p.stream with sm80::plan_mla's plan (split count, workspace layout), so
// that forward_workspace_size holds for either kernel. Precondition: mla_unsupported(p) ==
// nullptr.
void run_mla(const FwdParams& p);

}  // namespace flashattn::detail::cuda::sm90
