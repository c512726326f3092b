// Launch of one sm90 forward configuration; explicitly instantiated per head-dim bucket
// in fwd_hdim*.cu so the kernels compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/cuda_check.hpp"
#include "cuda/sm90/fwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

template <class Cfg, typename Element>
void launch_fwd(const FwdArgs& args) {
  auto kernel = fwd_kernel<Cfg, Element>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  FLASHATTN_CUDA_CHECK(attr);
  const FwdParams& p = args.p;
  const dim3 grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.h_q, p.batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(p.stream)>>>(args);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda::sm90
