// What the CUDA suites (tests/cuda) share: the skip-without-GPU and CUDA-status macros, and
// a device copy of a host test tensor whose view() has the host tensor's layout on cuda:0,
// for calling the public API with CUDA tensors.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "support/host_tensor.hpp"

#define FA_REQUIRE_GPU()                                                             \
  do {                                                                               \
    if (detail::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

#define FA_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

namespace flashattn::test {

// Eager CUDA calls check their index tensors on the device by default (no host copy, no
// synchronisation; FLASHATTN_DEVICE_INDEX_CHECKS=0 copies them to the host instead). A test
// that needs one path sets it for its scope, whatever the environment says.
class IndexCheckPathScope {
 public:
  explicit IndexCheckPathScope(detail::cuda::IndexCheckPath path) { detail::cuda::set_index_check_path(path); }
  ~IndexCheckPathScope() { detail::cuda::set_index_check_path(detail::cuda::IndexCheckPath::kEnvironment); }
  IndexCheckPathScope(const IndexCheckPathScope&) = delete;
  IndexCheckPathScope& operator=(const IndexCheckPathScope&) = delete;
};

class DeviceCopy {
 public:
  explicit DeviceCopy(const HostTensor& h) : bytes_(h.bytes()) {
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(ptr_, h.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
    view_ = h.view_on(ptr_, Device::cuda(0));
  }
  ~DeviceCopy() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  const Tensor& view() const { return view_; }
  void* data() const { return ptr_; }
  void download(HostTensor& h) const {
    if (bytes_ > 0) EXPECT_EQ(cudaMemcpy(h.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  void upload(const HostTensor& h) const {
    if (bytes_ > 0) EXPECT_EQ(cudaMemcpy(ptr_, h.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  Tensor view_;
};

}  // namespace flashattn::test
