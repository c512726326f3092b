// The sm80 backward's 99 KiB configurations (sm86 / sm89 parts, emulated here with
// opts.smem_cap = 101376 on any GPU; sm80/bwd_config.cuh: 64 query rows, 128 keys up to
// d = 64 and 64 keys above, one or two Q / dO stages) against the fp64 oracle under the
// suite's tolerance rule, outputs poisoned before every call: every bucket up to 160 and
// dims between them, fp16 and bf16, GQA, causal / window / softcap / ALiBi / dropout, odd
// lengths, varlen with empty sequences and seqused_k, deterministic reruns bit-identical.
// Head dims above 160 have no configuration there: the backward declines them with an
// Unsupported error naming the shared memory needed and granted.
#include <cuda_runtime.h>

#include <string>
#include <initializer_list>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr int kCap = 101376;  // 99 KiB: the opt-in shared memory per block of sm86 / sm89

// The head dims of `wanted` that run in a compiled bucket of at most 160, which has a 99 KiB
// configuration (a build whose FLASHATTN_HEAD_DIMS lack 160 runs d = 160 in a larger bucket,
// which declines under the cap: AboveD160Declines's cases).
std::vector<int> dims_within_99k(std::initializer_list<int> wanted) {
  std::vector<int> d;
  for (int x : wanted) {
    const int bucket = detail::cuda::head_dim_bucket(x);
    if (bucket > 0 && bucket <= 160) d.push_back(x);
  }
  return d;
}

void check_dense_under_cap(DenseCase& c) {
  c.opts.smem_cap = kCap;
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  ASSERT_NO_THROW(c.run_forward());  // CPU forward: the out / lse being differentiated
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  cuda_backward(c);
  expect_backward_written_and_matching(c, p, c.dtype, fwd);
}

TEST(CudaBackward99K, HeadDimsMatchOracle) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  int ran = 0;
  for (int d : dims_within_99k({32, 40, 64, 72, 96, 128, 136, 160})) {
    ASSERT_FALSE(backward_over_cap(d, kCap)) << "d " << d << " has no 99 KiB configuration";
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, Shape{2, 147, 211, 4, 2, d}, dtype);
      c.opts.causal = d % 64 == 0;
      check_dense_under_cap(c);
      ++ran;
    }
  }
  EXPECT_GT(ran, 0);
}

// Masks and score modifiers at the small tiles of d 64 (128 keys, two stages), 96 (64
// keys, two stages) and 128 / 160 (64 keys, one stage).
TEST(CudaBackward99K, FeaturesMatchOracle) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : dims_within_99k({64, 96, 128, 160})) {
    for (int variant = 0; variant < 4; ++variant) {
      DenseCase c = DenseCase::random(rng, Shape{1, 190 + variant, 260 - variant, 8, 2, d}, DType::kBFloat16);
      switch (variant) {
        case 0:  // a window on both sides and softcap
          c.opts.window_left = 45;
          c.opts.window_right = 13;
          c.opts.softcap = 3.0f;
          break;
        case 1:  // causal with s_q > s_k
          c = DenseCase::random(rng, Shape{1, 300, 90, 4, 1, d}, DType::kFloat16);
          c.opts.causal = true;
          break;
        case 2:  // ALiBi per batch, causal
          c.set_alibi(random_alibi(rng, 1, 8, true), true);
          c.opts.causal = true;
          break;
        default:  // dropout
          c.opts.dropout_p = 0.2f;
          c.opts.seed = rng();
          c.opts.offset = rng();
          break;
      }
      SCOPED_TRACE("d " + std::to_string(d) + " variant " + std::to_string(variant));
      check_dense_under_cap(c);
    }
  }
}

TEST(CudaBackward99K, VarlenWithEmptySequencesAndSequsedK) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : dims_within_99k({64, 128, 160})) {
    // Lengths 70, 0, 133, 1, 200 (queries) and 90, 40, 0, 150, 201 (keys).
    VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 203, 204, 404}, {0, 90, 130, 130, 280, 481}, 4, 2, d,
                                    DType::kBFloat16, 5, 7);
    c.set_seqused_k({77, 40, 0, 150, 190});
    c.opts.causal = true;
    c.opts.smem_cap = kCap;
    SCOPED_TRACE("d " + std::to_string(d));
    ASSERT_NO_THROW(c.run_forward());
    const RefProblem p = c.problem();
    const ForwardResults fwd = forward_results(c);
    cuda_varlen_backward(c);
    expect_backward_written_and_matching(c, p, c.dtype, fwd);
    for (double x : c.dkv_unused_rows()) ASSERT_EQ(x, 0.0) << "dk / dv beyond seqused_k";
  }
}

// dq added in key-tile order behind the per-tile counters: reruns give the same bits.
TEST(CudaBackward99K, DeterministicRunsAreBitIdentical) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : dims_within_99k({64, 128, 160})) {
    DenseCase c = DenseCase::random(rng, Shape{2, 333, 517, 4, 2, d}, DType::kBFloat16);
    c.opts.causal = true;
    c.opts.deterministic = true;
    SCOPED_TRACE("d " + std::to_string(d));
    check_dense_under_cap(c);
    const HostTensor dq1 = c.dq, dk1 = c.dk, dv1 = c.dv;
    cuda_backward(c);
    EXPECT_TRUE(c.dq.bitwise_equal(dq1)) << "dq differs between deterministic runs";
    EXPECT_TRUE(c.dk.bitwise_equal(dk1)) << "dk differs between deterministic runs";
    EXPECT_TRUE(c.dv.bitwise_equal(dv1)) << "dv differs between deterministic runs";
  }
}

// Above d = 160 the K / V tiles and one Q / dO stage alone exceed 99 KiB: Unsupported,
// naming the bytes needed and granted (so too d = 160 in a build without its bucket).
TEST(CudaBackward99K, AboveD160Declines) {
  FA_REQUIRE_GPU();
  int declined = 0;
  for (int d : built_head_dims({160, 192, 224, 256})) {
    if (detail::cuda::head_dim_bucket(d) <= 160) continue;
    ASSERT_TRUE(backward_over_cap(d, kCap)) << "d " << d;
    expect_backward_declined(d, kCap);
    ++declined;
  }
  if (declined == 0) GTEST_SKIP() << "no head-dim bucket above 160 in this build";
}

}  // namespace
}  // namespace flashattn::test
