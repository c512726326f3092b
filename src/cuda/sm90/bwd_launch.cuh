// Launch of one sm90 backward configuration; explicitly instantiated per head-dim bucket
// in bwd_hdim*.cu so the kernels compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm90/bwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

template <class Cfg, typename Element>
void launch_bwd(const BwdArgs& args, void* stream) {
  auto kernel = args.raw_scores ? bwd_kernel<Cfg, Element, true> : bwd_kernel<Cfg, Element, false>;
  FLASHATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const BwdParams& p = args.p;
  const dim3 grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.h_k, p.batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(args);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda::sm90
