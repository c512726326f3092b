// Makes a CUDA device current for the lifetime of a call and restores the previous one.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/runtime/cuda_check.hpp"

namespace flashattn::detail::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLASHATTN_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) FLASHATTN_CUDA_CHECK(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace flashattn::detail::cuda
