// CUDA tensors with a block-sparse mask (Options::block_sparse): no CUDA kernel reads the
// mask yet, so every entry point declines it with an Unsupported error naming
// opts.block_sparse, before anything is written (the outputs keep their poison), rather
// than computing the dense attention.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_copy.hpp"
#include "flashattn/error.hpp"
#include "support/cases.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

HostTensor int32_tensor(std::vector<std::int64_t> shape, const std::vector<int>& values) {
  HostTensor t(DType::kInt32, std::move(shape));
  for (std::size_t i = 0; i < values.size(); ++i) t.as<std::int32_t>()[i] = values[i];
  return t;
}

template <class F>
void expect_declined(F&& call) {
  try {
    call();
    FAIL() << "no error";
  } catch (const Unsupported& e) {
    EXPECT_EQ(e.argument(), "opts.block_sparse") << e.what();
    EXPECT_NE(std::string(e.what()).find("CPU backend"), std::string::npos) << e.what();
  }
}

TEST(CudaBlockSparse, DenseForwardAndBackwardAreDeclined) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 130, 130, 2, 2, 64}, DType::kFloat16);
  c.poison_forward();
  c.poison_backward();
  // Two 128 x 128 query blocks, each visiting key block 0 (partial).
  const HostTensor cnt = int32_tensor({1, 1, 2}, {1, 1});
  const HostTensor idx = int32_tensor({1, 1, 2, 2}, {0, 0, 0, 0});
  for (bool mask_on_device : {true, false}) {
    DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk),
        dv(c.dv), dcnt(cnt), didx(idx);
    Options o;
    o.block_sparse.mask_block_cnt = mask_on_device ? dcnt.view() : cnt.view();
    o.block_sparse.mask_block_idx = mask_on_device ? didx.view() : idx.view();
    expect_declined([&] { flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o); });
    expect_declined([&] {
      flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                          dq.view(), dk.view(), dv.view(), o);
    });
    expect_declined([&] { flashattn::backward_workspace_size(q.view(), k.view(), v.view(), o); });
    FA_CUDA_OK(cudaDeviceSynchronize());
    HostTensor got = c.out;
    out.download(got);
    EXPECT_EQ(got.count_nan(), got.numel()) << "out was written";
  }
}

}  // namespace
}  // namespace flashattn::test
