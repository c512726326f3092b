// The host side of the MLA kernel (mla_kernel.cuh): run_mla sets the dynamic shared memory
// and launches one instantiation over (row chunks x splits, KV heads, sequences). The
// translation units mla_fp16.cu and mla_bf16.cu instantiate it, one element type each.
#pragma once

#include <cuda_runtime.h>

#include "core/params.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm80/mla_kernel.cuh"
#include "cuda/sm80/mla_launch.hpp"

namespace flashattn::detail::cuda::sm80 {

template <typename Element>
void run_mla(const FwdParams& p, const MlaArgs& a) {
  auto kernel = mla_kernel<Element>;
  constexpr int kSmem = MlaTraits::kSmemBytes;
  FLASHATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(static_cast<unsigned>(a.row_chunks * a.splits), static_cast<unsigned>(p.h_k),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, MlaTraits::kThreads, kSmem, static_cast<cudaStream_t>(p.stream)>>>(p, a);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda::sm80
