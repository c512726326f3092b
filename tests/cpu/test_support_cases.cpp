// The test support's own invariants: what the suites' cases and copies rely on.
#include <vector>

#include <gtest/gtest.h>

#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

// An undefined tensor stays undefined when copied (a copy once made it a one-element
// scalar); a defined one, empty or not, keeps its shape and values.
TEST(SupportHostTensor, CopiesKeepUndefinedEmptyAndValues) {
  const HostTensor undefined;
  const HostTensor copy(undefined);
  EXPECT_TRUE(copy.empty());
  EXPECT_EQ(copy.rank(), 0);
  HostTensor assigned(DType::kFloat32, {2});
  assigned = undefined;
  EXPECT_TRUE(assigned.empty());

  const HostTensor zero_rows(DType::kBFloat16, {0, 3});
  const HostTensor zero_copy(zero_rows);
  EXPECT_TRUE(zero_copy.empty());
  EXPECT_EQ(zero_copy.shape(), zero_rows.shape());
  EXPECT_NE(zero_copy.data(), nullptr);

  HostTensor values(DType::kFloat32, {2, 3});
  for (int i = 0; i < 6; ++i) values.set(i, 0.5 * i - 1.0);
  const HostTensor values_copy(values);
  EXPECT_EQ(values_copy.shape(), values.shape());
  EXPECT_TRUE(values_copy.bitwise_equal(values));
  EXPECT_NE(values_copy.data(), values.data());
}

// A copied varlen case (no qv, seqused_k with an empty sequence) gives the same oracle
// problem as the original and runs forward and backward on the CPU: the path of
// CudaIndexGuards.VarlenOutOfRangeUnderCapture, which crashed in problem() on the copy.
TEST(SupportVarlenCase, CopyKeepsTheProblem) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 273, 285}, {0, 90, 130, 330, 346}, 4, 2, 64, DType::kBFloat16);
  c.set_seqused_k({0, 40, 200, 3});
  c.opts.causal = true;
  VarlenCase copy = c;
  EXPECT_TRUE(copy.qv.empty());
  const RefProblem problem = copy.problem();
  ASSERT_EQ(problem.seqs.size(), c.problem().seqs.size());
  EXPECT_TRUE(problem.seqs[0].qv.empty());
  copy.poison_forward();
  copy.run_forward();
  expect_forward_matches(problem, DType::kBFloat16, forward_results(copy));
  copy.poison_backward();
  copy.run_backward();
}

}  // namespace
}  // namespace flashattn::test
