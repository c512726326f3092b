// CUDA launch limits that depend on lengths (issue 25): a causal or window forward indexes
// query tiles by grid z in the sm80 family (at most 65535 tiles of 64 rows), so a sequence
// with more query rows is an Unsupported naming q, raised before anything runs: out keeps
// its poison. The same shape without a mask (tiles in grid x) runs.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_copy.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"

namespace flashattn::test {
namespace {

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { cudaMalloc(&p, bytes); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

TEST(CudaLaunchLimits, CausalQueryRowsBeyondTheGridAreUnsupported) {
  FA_REQUIRE_GPU();
  constexpr std::int64_t kRows = 65535LL * 64 + 1, kKeys = 16, kD = 64;
  const std::size_t q_bytes = std::size_t(kRows) * kD * 2, kv_bytes = std::size_t(kKeys) * kD * 2;
  DeviceBuffer q(q_bytes), k(kv_bytes), v(kv_bytes), out(q_bytes), lse(std::size_t(kRows) * 4);
  ASSERT_NE(q.p, nullptr);
  ASSERT_NE(k.p, nullptr);
  ASSERT_NE(v.p, nullptr);
  ASSERT_NE(out.p, nullptr);
  ASSERT_NE(lse.p, nullptr);
  FA_CUDA_OK(cudaMemset(q.p, 0, q_bytes));
  FA_CUDA_OK(cudaMemset(k.p, 0, kv_bytes));
  FA_CUDA_OK(cudaMemset(v.p, 0, kv_bytes));
  FA_CUDA_OK(cudaMemset(out.p, 0xff, q_bytes));
  const auto dev = Device::cuda(0);
  const Tensor tq = Tensor::contiguous(q.p, DType::kBFloat16, {1, kRows, 1, kD}, dev);
  const Tensor tk = Tensor::contiguous(k.p, DType::kBFloat16, {1, kKeys, 1, kD}, dev);
  const Tensor tv = Tensor::contiguous(v.p, DType::kBFloat16, {1, kKeys, 1, kD}, dev);
  const Tensor to = Tensor::contiguous(out.p, DType::kBFloat16, {1, kRows, 1, kD}, dev);
  const Tensor tl = Tensor::contiguous(lse.p, DType::kFloat32, {1, 1, kRows}, dev);
  for (int mode = 0; mode < 2; ++mode) {
    Options o;
    o.causal = mode == 0;
    o.window_left = mode == 1 ? 100 : -1;
    try {
      forward(tq, tk, tv, to, tl, o);
      FAIL() << "a causal / window forward of " << kRows << " query rows was accepted";
    } catch (const Unsupported& e) {
      EXPECT_EQ(e.argument(), "q") << e.what();
      EXPECT_NE(std::string(e.what()).find("at most 4194240 query rows"), std::string::npos) << e.what();
    }
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> head(64), tail(64);
  FA_CUDA_OK(cudaMemcpy(head.data(), out.p, 128, cudaMemcpyDeviceToHost));
  FA_CUDA_OK(cudaMemcpy(tail.data(), static_cast<char*>(out.p) + q_bytes - 128, 128, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 64; ++i) {
    ASSERT_EQ(head[std::size_t(i)], 0xffff) << "out written at element " << i;
    ASSERT_EQ(tail[std::size_t(i)], 0xffff) << "out written near its end";
  }
  // Unbounded: the query tiles go in grid x and the call runs (q = k = v = 0: out 0).
  Options plain;
  try {
    forward(tq, tk, tv, to, tl, plain);
  } catch (const Unsupported& e) {
    GTEST_SKIP() << "head dim 64 not built: " << e.what();
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  FA_CUDA_OK(cudaMemcpy(tail.data(), static_cast<char*>(out.p) + q_bytes - 128, 128, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 64; ++i) ASSERT_EQ(tail[std::size_t(i)], 0) << "last row of out";
}

}  // namespace
}  // namespace flashattn::test
