// CUDA, v with its own head dim (d_v != d; DeepSeek-V3's prefill (192, 128), issue 22):
// forward and backward on every kernel family this GPU runs (each computes in the bucket of
// the larger head dim with the smaller one's columns zero-filled and not stored; the sm90
// family's backward declines it and runs sm80), against the fp64 oracle under the suite's tolerance
// rule, outputs poisoned; dense with masks, softcap, dropout, GQA, and varlen with
// seqused_k. Head dims whose bucket is not in this build are skipped.
#include <string>
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

struct Dims {
  const char* name;
  int s_q, s_k, h_q, h_k, d, d_v;
  bool causal;
  int left;
  float softcap, dropout;
};

void PrintTo(const Dims& f, std::ostream* os) { *os << f.name; }

bool built(int d, int d_v) {
  return detail::cuda::supports_head_dim(d) && detail::cuda::supports_head_dim(d_v) &&
         detail::cuda::supports_head_dim(std::max(d, d_v));
}

class CudaHeadDimV : public ::testing::TestWithParam<Dims> {};

TEST_P(CudaHeadDimV, ForwardAndBackwardMatchOracle) {
  FA_REQUIRE_GPU();
  const Dims& f = GetParam();
  if (!built(f.d, f.d_v)) GTEST_SKIP() << "head dims not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, Shape{2, f.s_q, f.s_k, f.h_q, f.h_k, f.d, f.d_v}, dtype);
      c.opts.causal = f.causal;
      c.opts.window_left = f.left;
      c.opts.softcap = f.softcap;
      c.opts.dropout_p = f.dropout;
      c.opts.seed = rng();
      c.opts.offset = rng();
      SCOPED_TRACE(std::string(family_str(family)) + " " + c.shape.str() + " " + dtype_name(dtype) + " " +
                   describe(c.call_options()));
      cuda_forward(c, family);
      const RefProblem p = c.problem();
      const ForwardResults fwd = forward_results(c);
      EXPECT_TRUE(fully_written("out", fwd.out));
      expect_forward_matches(p, dtype, fwd);
      if (backward_over_cap(std::max(f.d, f.d_v))) {  // a 99 KiB part: no backward above d = 160
        expect_backward_declined(std::max(f.d, f.d_v));
        continue;
      }
      cuda_backward(c);
      expect_backward_written_and_matching(c, p, dtype, fwd);
    }
  }
}

// Lengths that end inside the query and key tiles.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaHeadDimV,
    ::testing::Values(Dims{"deepseek_192_128", 133, 197, 2, 2, 192, 128, false, -1, 0, 0},
                      Dims{"d192_dv128_causal_gqa", 150, 150, 4, 1, 192, 128, true, -1, 0, 0},
                      Dims{"d128_dv64_window", 230, 190, 2, 2, 128, 64, false, 45, 0, 0},
                      Dims{"d64_dv128_causal", 129, 260, 4, 2, 64, 128, true, -1, 0, 0},
                      Dims{"d96_dv32_softcap", 121, 187, 2, 1, 96, 32, false, -1, 3.0f, 0},
                      Dims{"d128_dv256_dropout", 97, 130, 2, 2, 128, 256, false, -1, 0, 0.2f}),
    [](const ::testing::TestParamInfo<Dims>& info) { return std::string(info.param.name); });

// Varlen (DeepSeek's prefill packs sequences): (192, 128) with GQA, causal, empty
// sequences and seqused_k.
TEST(CudaHeadDimV, VarlenWithSeqused) {
  FA_REQUIRE_GPU();
  if (!built(192, 128)) GTEST_SKIP() << "head dims not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 203, 204, 404}, {0, 90, 130, 130, 280, 481}, 4, 2, 192,
                                      dtype, 5, 7, 128);
      c.set_seqused_k({77, 40, 0, 150, 190});
      c.opts.causal = true;
      SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype));
      cuda_varlen_forward(c, family);
      const RefProblem p = c.problem();
      const ForwardResults fwd = forward_results(c);
      expect_forward_matches(p, dtype, fwd);
      if (backward_over_cap(192)) {  // a 99 KiB part: no backward above d = 160
        expect_backward_declined(192);
        continue;
      }
      cuda_varlen_backward(c, family);
      expect_backward_written_and_matching(c, p, dtype, fwd, false);
      for (double x : c.dkv_unused_rows()) ASSERT_EQ(x, 0.0) << "dk / dv beyond seqused_k";
    }
  }
}

}  // namespace
}  // namespace flashattn::test
