// Two fp32 values rounded (nearest even) into one register of two 16-bit values, the
// first in the low half: the layout of the 16-bit MMA operands (mma.sync, wgmma) and of
// 32-bit stores. Generation-neutral; every family uses it.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashattn::detail::cuda {

template <typename Element>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (__is_same(Element, __half)) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

// A 16-bit A operand from an fp32 accumulator: an m64nN wgmma's accumulator (8 values per
// thread per 16 columns) and the A fragment of an m64nNk16 wgmma (four registers per k-step)
// share their thread / row / column layout, so k-step kk's registers are the accumulator's
// values 8 kk .. 8 kk + 7 paired in order (P for P V in the forward, P^T and dS^T in the
// backward).
template <typename Element, int kSteps, int kN>
__device__ __forceinline__ void pack_a_frags(const float (&acc)[kN], std::uint32_t (&a)[kSteps][4]) {
  static_assert(8 * kSteps <= kN, "pack_a_frags: the accumulator holds fewer than 8 values per k-step");
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[kk][j] = pack2<Element>(acc[8 * kk + 2 * j], acc[8 * kk + 2 * j + 1]);
  }
}

}  // namespace flashattn::detail::cuda
