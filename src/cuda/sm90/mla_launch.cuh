// The launch of the sm90 MLA kernel (mla_kernel.cuh), instantiated per element type in
// mla_fp16.cu and mla_bf16.cu so the two compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm90/mla_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

// Over (row chunks x splits, KV heads, sequences), as the sm80 MLA kernel.
template <typename Element>
void launch_mla(const FwdParams& p, const MlaArgs& a) {
  auto kernel = mla_kernel<Element>;
  constexpr int kSmem = MlaConfig::kSmemBytes;
  // Per launch (a function attribute is per device; the call costs about a microsecond).
  FLASHATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(static_cast<unsigned>(a.split.row_chunks * a.split.splits), static_cast<unsigned>(p.h_k),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, MlaConfig::kThreads, kSmem, static_cast<cudaStream_t>(p.stream)>>>(p, a);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda::sm90
