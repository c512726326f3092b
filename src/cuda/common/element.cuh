// The device element type of a 16-bit flashattn::DType.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flashattn/tensor.hpp"

namespace flashattn::detail::cuda {

template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kFloat16> {
  using type = __half;
};
template <>
struct ElementOf<DType::kBFloat16> {
  using type = __nv_bfloat16;
};

}  // namespace flashattn::detail::cuda
