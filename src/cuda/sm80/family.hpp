// The sm80 kernel family as the dispatch (src/cuda/dispatch.cu) sees it: forward (dense,
// varlen and the KV-cache decode path), backward and their workspace needs. Runs on every
// GPU from sm80 on. The caller has validated p, resolved p.smem_limit (every configuration
// it picks fits in it) and made p.device_index current.
#pragma once

#include <cstddef>

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm80 {

void forward(const FwdParams& p);
std::size_t forward_workspace_size(const FwdParams& p);
void backward(const BwdParams& p);
std::size_t backward_workspace_size(const BwdParams& p);

}  // namespace flashattn::detail::cuda::sm80
