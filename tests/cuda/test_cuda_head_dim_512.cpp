// CUDA forward at head dims above 256 (issue 22): d and d_v up to 512 run in the sm80
// family's 512 bucket (S = Q K^T over all of d in every block, V and O in 256-column slices
// over the grid; the sm90 family declines these calls and runs sm80), against the fp64
// oracle under the suite's tolerance rule, outputs poisoned before every call: d in {264,
// 320, 512}, (d, d_v) pairs with d_v above and below 256 (512 / 256, 320 / 512, 192 / 512,
// 512 / 64), causal (s_q below and above s_k), sliding windows, softcap, ALiBi, dropout,
// learnable sinks, GQA, odd lengths, lse; varlen with empty sequences, seqused_k and
// seqused_q. What the 512 bucket declines is an Unsupported error naming the argument with
// nothing written: block-sparse masks and less shared memory than its tile (a 99 KiB GPU,
// here opts.smem_cap). Skipped where the build has no 512 bucket (FLASHATTN_HEAD_DIMS). The
// backward at these head dims: test_cuda_backward_512.cpp; KV-cache calls:
// test_cuda_kvcache_512.cpp.
#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/dense_features.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_mask.hpp"
#include "cuda/device_runs.hpp"
#include "cuda/sm80/tile_size.hpp"
#include "flashattn/error.hpp"
#include "support/block_mask.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using ::testing::HasSubstr;

bool built_512() { return detail::cuda::supports_wide_head_dim(512); }
// Under gpu.sh's 99 KiB rerun (FLASHATTN_SMEM_CAP) the 512 bucket has no tile: the forward
// tests skip there, and CudaHeadDim512Declined.SmallSharedMemory checks the error.
bool fits_env_cap_512() {
  const int cap = env_smem_cap();
  return cap == 0 || cap >= detail::cuda::fwd_smem_bytes(detail::cuda::fwd_tile_small(512), 512);
}

using Dims = DenseFeatures;

class CudaHeadDim512 : public ::testing::TestWithParam<Dims> {};

TEST_P(CudaHeadDim512, ForwardMatchesOracle) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  if (!fits_env_cap_512()) GTEST_SKIP() << "no 512 tile within FLASHATTN_SMEM_CAP=" << env_smem_cap();
  const Dims& f = GetParam();
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = dense_feature_case(rng, f, dtype);
      SCOPED_TRACE(std::string(family_str(family)) + " " + c.shape.str() + " " + dtype_name(dtype) + " " +
                   describe(c.call_options()));
      cuda_forward(c, family);
      const ForwardResults got = forward_results(c);
      EXPECT_TRUE(fully_written("out", got.out));
      EXPECT_TRUE(fully_written("lse", got.lse));
      expect_forward_matches(c.problem(), dtype, got);
    }
  }
}

// Lengths end inside the 64-row query tiles and the 32-key tiles; s_k = 1000 runs many key
// tiles through the interior loop.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaHeadDim512,
    ::testing::Values(
        Dims{"d264", 2, 77, 133, 2, 2, 264, 264, false, -1, -1, 0, 0, false, 0},
        Dims{"d320_causal_gqa4", 2, 150, 150, 4, 1, 320, 320, true, -1, -1, 0, 0, false, 0},
        Dims{"d512", 1, 131, 197, 2, 2, 512, 512, false, -1, -1, 0, 0, false, 0},
        Dims{"d512_one_row", 2, 1, 77, 2, 1, 512, 512, false, -1, -1, 0, 0, false, 0},
        Dims{"d512_causal_long_gqa2", 1, 150, 1000, 4, 2, 512, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_causal_sq_gt_sk", 1, 300, 90, 2, 1, 512, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_causal", 2, 200, 200, 2, 2, 512, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_window", 1, 230, 190, 2, 2, 512, 512, false, 45, 13, 0, 0, false, 0},
        Dims{"d512_dv256_window", 2, 97, 160, 2, 2, 512, 256, false, 45, -1, 0, 0, false, 0},
        Dims{"d512_dv256_causal", 1, 129, 260, 4, 2, 512, 256, true, -1, -1, 0, 0, false, 0},
        Dims{"d320_dv512_softcap", 1, 121, 187, 2, 1, 320, 512, false, -1, -1, 3.0f, 0, false, 0},
        Dims{"d192_dv512_causal_gqa2", 2, 130, 130, 4, 2, 192, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_dv64_alibi", 1, 100, 150, 2, 2, 512, 64, false, -1, -1, 0, 1, false, 0},
        Dims{"d512_alibi_causal", 1, 111, 111, 2, 1, 512, 512, true, -1, -1, 0, 1, false, 0},
        Dims{"d512_softcap_window", 1, 140, 170, 2, 2, 512, 512, false, 60, 20, 2.5f, 0, false, 0},
        Dims{"d512_dropout", 1, 137, 211, 2, 1, 512, 512, true, -1, -1, 0, 0, false, 0.2f},
        Dims{"d400_dv320_dropout", 1, 90, 150, 2, 2, 400, 320, false, -1, -1, 0, 0, false, 0.25f},
        Dims{"d512_sink_causal", 1, 150, 150, 4, 2, 512, 512, true, -1, -1, 0, 0, true, 0},
        Dims{"d264_dv512_sink", 1, 70, 99, 2, 1, 264, 512, false, -1, -1, 0, 0, true, 0}),
    [](const ::testing::TestParamInfo<Dims>& info) { return std::string(info.param.name); });

// Varlen: causal with GQA, empty sequences and seqused_k at (320, 512); seqused_q at 512 (the
// rows past it: out 0, lse -inf, their q NaN and never read).
TEST(CudaHeadDim512Varlen, SequsedKAndQ) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  if (!fits_env_cap_512()) GTEST_SKIP() << "no 512 tile within FLASHATTN_SMEM_CAP=" << env_smem_cap();
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      {
        VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 203, 204, 404}, {0, 90, 130, 130, 280, 481}, 4, 2, 320,
                                        dtype, 5, 7, 512);
        c.set_seqused_k({77, 40, 0, 150, 190});
        c.opts.causal = true;
        SCOPED_TRACE(std::string(family_str(family)) + " seqused_k (320, 512) " + dtype_name(dtype));
        cuda_varlen_forward(c, family);
        expect_forward_matches(c.problem(), dtype, forward_results(c));
      }
      {
        const std::vector<int> lq = {70, 0, 133, 1, 200}, lk = {90, 40, 0, 150, 201};
        VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 2, 1, 512, dtype, 5, 7);
        c.set_seqused_q({uniform_int(rng, 1, 69), 0, 129, 0, uniform_int(rng, 65, 199)});
        c.opts.softcap = 4.0f;
        SCOPED_TRACE(std::string(family_str(family)) + " seqused_q 512 " + dtype_name(dtype));
        c.poison_unused_q_rows();
        cuda_varlen_forward(c, family);
        expect_forward_matches(c.problem(), dtype, forward_results(c));
        for (double x : c.q_unused_rows(c.out)) ASSERT_EQ(x, 0.0) << "out of a row past seqused_q";
        for (double x : c.lse_unused_rows()) ASSERT_EQ(x, -INFINITY) << "lse of a row past seqused_q";
      }
    }
  }
}

// The 512 bucket has no block-sparse kernel: Unsupported naming opts.block_sparse, out not
// written (a mask of 128 x 128 blocks, which every other bucket runs).
TEST(CudaHeadDim512Declined, BlockSparseMask) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 200, 260, 2, 1, 512}, DType::kBFloat16);
  const HostBlockMask m = random_mask(rng, 1, 2, 200, 260, 128, 128, false, false, 0.5, true);
  c.poison_forward();
  const HostTensor out0 = c.out;
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse);
  DeviceMask dm;
  Options o = c.call_options();
  dm.apply(m, o);
  try {
    flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
    ADD_FAILURE() << "a block-sparse mask accepted at d = 512";
  } catch (const Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'opts.block_sparse'"));
    EXPECT_THAT(e.what(), HasSubstr("head dims above 256"));
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  EXPECT_TRUE(c.out.bitwise_equal(out0)) << "out written by a declined call";
}

// A GPU with 99 KiB of shared memory per block (sm86 / sm89; opts.smem_cap here) has no
// 512 tile: Unsupported naming q, its head dim and the bytes needed and available.
TEST(CudaHeadDim512Declined, SmallSharedMemory) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 70, 90, 2, 1, 320, 512}, DType::kFloat16);
  c.poison_forward();
  const HostTensor out0 = c.out;
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse);
  Options o = c.call_options();
  o.smem_cap = 101376;
  try {
    flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
    ADD_FAILURE() << "the 512 bucket ran within 99 KiB of shared memory";
  } catch (const Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q'"));
    EXPECT_THAT(e.what(), HasSubstr("bytes of shared memory per block for head dim d = 320, d_v = 512"));
    EXPECT_THAT(e.what(), HasSubstr("got 101376 bytes"));
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  EXPECT_TRUE(c.out.bitwise_equal(out0)) << "out written by a declined call";
}

}  // namespace
}  // namespace flashattn::test
