// Launch of one sm90 forward configuration; explicitly instantiated per head-dim bucket
// in fwd_hdim*.cu so the kernels compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_attribute.hpp"
#include "flashattn/error.hpp"
#include "cuda/sm90/fwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

template <class Cfg, typename Element, typename Out>
void launch_fwd(FwdArgs& args) {
  auto kernel = args.raw_scores ? fwd_kernel<Cfg, Element, true, Out> : fwd_kernel<Cfg, Element, false, Out>;
  // Per launch (a function attribute is per device; the call costs about a microsecond).
  FLASHATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const FwdParams& p = args.p;
  args.m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int per_head = p.mask.right >= 0 ? (args.m_blocks + 1) / 2 : args.m_blocks;  // work_tile
  const std::int64_t work = std::int64_t(per_head) * p.h_q * p.batch;
  if (work > std::numeric_limits<int>::max()) {
    throw Unsupported("flashattn::forward", "q",
                      "at most 2^31 - 1 units of query tiles of " + std::to_string(Cfg::kBlockM) +
                          " rows on the sm90 path",
                      std::to_string(work) + " units");
  }
  args.n_units = static_cast<int>(work);
  const int sms = device_attribute<cudaDevAttrMultiProcessorCount>(p.device_index, 132);
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>(work, sms));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(p.stream)>>>(args);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda::sm90
