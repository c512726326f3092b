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

}  // namespace flashattn::detail::cuda
