// CPU backend, varlen seqused_q (issue 22): of sequence b's query slots only the first
// seqused_q[b] are computed, with s_q = seqused_q[b] in the visibility rule; the rows past
// them have out 0, lse -inf, dq 0 and debug probs 0, and nothing in them is read (they hold
// NaN here). Forward and backward against the fp64 oracle in every dtype, with masks,
// seqused_k, dropout, learnable sinks, empty sequences; the argument checks.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr DType kAllDtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};

void expect_unused_rows_empty(const VarlenCase& c, bool backward) {
  std::size_t bad_out = 0, bad_lse = 0, bad_dq = 0, bad_probs = 0;
  for (double x : c.q_unused_rows(c.out)) bad_out += x != 0.0;
  for (double x : c.lse_unused_rows()) bad_lse += x != -INFINITY;
  if (backward)
    for (double x : c.q_unused_rows(c.dq)) bad_dq += x != 0.0;
  if (!c.probs.shape().empty()) {
    for (int b = 0; b < c.batch(); ++b)
      for (int h = 0; h < c.h_q; ++h)
        for (int i = c.used_q(b); i < c.len_q(b); ++i)
          for (int j = 0; j < c.max_k(); ++j) bad_probs += c.probs.at({h, c.cu_q[b] + i, j}) != 0.0;
  }
  EXPECT_EQ(bad_out, 0u) << "out of rows past seqused_q not 0";
  EXPECT_EQ(bad_lse, 0u) << "lse of rows past seqused_q not -inf";
  EXPECT_EQ(bad_dq, 0u) << "dq of rows past seqused_q not 0";
  EXPECT_EQ(bad_probs, 0u) << "probs of rows past seqused_q not 0";
}

void check_seqused_q(VarlenCase& c) {
  SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " h_q=" + std::to_string(c.h_q) + " h_k=" +
               std::to_string(c.h_k) + " " + describe(c.call_options()));
  c.poison_unused_q_rows();
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
  expect_unused_rows_empty(c, true);
  if (!c.seqused_k.empty()) {
    for (double x : c.dkv_unused_rows()) ASSERT_EQ(x, 0.0) << "dk/dv of a key beyond seqused_k";
  }
}

TEST(CpuSequsedQ, MatchesOracleInEveryDtype) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {7, 0, 19, 33, 1, 12}, lk = {9, 4, 19, 20, 5, 0};
  for (DType dtype : kAllDtypes) {
    for (int mode = 0; mode < 4; ++mode) {
      VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 4, 2, 16, dtype, 2, 1);
      // Used: none, all, some; zero-length sequences stay 0.
      c.set_seqused_q({3, 0, 19, uniform_int(rng, 0, 33), 0, 12});
      c.opts.causal = mode >= 1;
      if (mode == 2) {
        c.opts.window_left = 5;
        c.set_seqused_k({9, 2, 11, 20, 5, 0});
      }
      if (mode == 3) {
        c.opts.softcap = 3.0f;
        c.sink.set(random_sink(rng, 4));
      }
      check_seqused_q(c);
    }
  }
}

// The visibility rule uses s_q = seqused_q: bottom-right alignment at the used rows (a
// causal row's diagonal moves with it), as a sequence of seqused_q queries.
TEST(CpuSequsedQ, SameAsTheShorterSequence) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, offsets({20, 20}), offsets({30, 25}), 2, 1, 8, DType::kFloat64);
  c.opts.causal = true;
  c.set_seqused_q({6, 13});
  c.run_forward();
  // The same queries as sequences of 6 and 13 rows.
  VarlenCase s = VarlenCase::make(rng, offsets({6, 13}), offsets({30, 25}), 2, 1, 8, DType::kFloat64);
  s.opts.causal = true;
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < s.len_q(b); ++i)
      for (int e = 0; e < 2 * 8; ++e) s.q.set((s.cu_q[b] + i) * 16 + e, c.q.get((c.cu_q[b] + i) * 16 + e));
  s.k = c.k;
  s.v = c.v;
  s.run_forward();
  EXPECT_TRUE(bitwise_equal("out", c.out_concat(), s.out_concat()));
  EXPECT_TRUE(bitwise_equal("lse", c.lse_concat(), s.lse_concat()));
}

TEST(CpuSequsedQ, DropoutProbsAndSplitFreeDecodeRows) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {13, 1, 29}, lk = {19, 4, 29};
  VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 6, 3, 16, DType::kBFloat16);
  c.opts.dropout_p = 0.2f;
  c.opts.seed = rng();
  c.opts.causal = true;
  c.set_seqused_q({5, 1, 17});
  c.want_probs();
  check_seqused_q(c);
}

TEST(CpuSequsedQ, BadValuesNameTheArgument) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, offsets({4, 6}), offsets({4, 6}), 2, 1, 8, DType::kFloat32);
  for (const std::vector<int>& bad : {std::vector<int>{5, 6}, std::vector<int>{4, -1}}) {
    c.set_seqused_q(bad);
    try {
      c.run_forward();
      FAIL() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), "seqused_q");
      EXPECT_NE(std::string(e.what()).find(bad[0] == 5 ? "seqused_q[0] in [0, 4]" : "seqused_q[1] in [0, 6]"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace flashattn::test
