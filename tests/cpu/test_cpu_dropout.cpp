// CPU backend, dropout: the kept set is the oracle's (semantics::DropoutRng::keep),
// read back through Options::return_probs; the empirical keep rate is 1 - p; outputs
// and gradients match the oracle with the same mask; seed and offset select the mask.
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

TEST(CpuDropout, ProbsReproduceTheKeepMask) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 37, 45, 4, 2, 16), dtype);
    c.opts.dropout_p = 0.3f;
    c.opts.seed = rng();
    c.opts.offset = rng();
    c.opts.causal = true;
    c.opts.window_left = 30;
    c.want_probs();
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + describe(c.call_options()));
    c.poison_forward();
    ASSERT_NO_THROW(c.run_forward());
    const RefProblem p = c.problem();
    // out, lse and probs against the oracle (probs exactly 0 wherever the oracle's are).
    expect_forward_matches(p, dtype, forward_results(c));
    std::int64_t dropped_nonzero = 0, kept_zero = 0, masked_nonzero = 0, dropped = 0, visible = 0;
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 4; ++h)
        for (int i = 0; i < 37; ++i)
          for (int j = 0; j < 45; ++j) {
            const double prob = c.probs.at({b, h, i, j});
            if (!semantics::key_visible(i, j, 37, 45, p.mask)) {
              masked_nonzero += prob != 0.0;
              continue;
            }
            ++visible;
            if (!p.keep(b, h, i, j)) {
              ++dropped;
              dropped_nonzero += prob != 0.0;
            } else {
              kept_zero += !(prob > 0.0);
            }
          }
    EXPECT_EQ(dropped_nonzero, 0) << "probs nonzero where the oracle drops";
    EXPECT_EQ(kept_zero, 0) << "probs zero where the oracle keeps";
    EXPECT_EQ(masked_nonzero, 0) << "probs nonzero where masked";
    EXPECT_GT(dropped, 0);
    EXPECT_LT(dropped, visible);
  }
}

TEST(CpuDropout, EmpiricalKeepRate) {
  FA_SEEDED_RNG(rng);
  for (float p : {0.1f, 0.5f, 0.85f}) {
    DenseCase c = DenseCase::random(rng, shape_of(1, 128, 512, 4, 1, 4), DType::kFloat32);
    c.opts.dropout_p = p;
    c.opts.seed = rng();
    c.opts.offset = rng();
    c.want_probs();
    SCOPED_TRACE(describe(c.call_options()));
    c.poison_forward();
    ASSERT_NO_THROW(c.run_forward());
    std::int64_t kept = 0;
    const std::int64_t n = c.probs.numel();
    for (std::int64_t e = 0; e < n; ++e) kept += c.probs.get(e) != 0.0;
    const double rate = double(kept) / double(n);
    const double sigma = std::sqrt(double(p) * (1.0 - p) / double(n));
    EXPECT_NEAR(rate, 1.0 - p, 6 * sigma) << "keep rate over " << n << " elements";
  }
}

TEST(CpuDropout, OutputAndGradientsMatchOracleWithTheSameMask) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    DenseCase c = DenseCase::random(rng, shape_of(3, 40, 33, 4, 1, 8), dtype);
    c.opts.dropout_p = 0.45f;
    c.opts.seed = rng();
    c.opts.offset = rng();
    c.set_alibi(random_alibi(rng, 3, 4, false), false);
    c.opts.softcap = 6.0f;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + describe(c.call_options()));
    c.poison_forward();
    ASSERT_NO_THROW(c.run_forward());
    const RefProblem p = c.problem();
    expect_forward_matches(p, dtype, forward_results(c));
    c.poison_backward();
    ASSERT_NO_THROW(c.run_backward());
    expect_backward_matches(p, dtype, forward_results(c), backward_results(c));
  }
}

TEST(CpuDropout, SeedAndOffsetSelectTheMask) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 32, 64, 2, 2, 8), DType::kFloat32);
  c.opts.dropout_p = 0.5f;
  c.opts.seed = rng();
  c.opts.offset = rng();
  c.want_probs();
  auto mask = [&] {
    c.poison_forward();
    c.run_forward();
    std::vector<bool> m;
    for (std::int64_t e = 0; e < c.probs.numel(); ++e) m.push_back(c.probs.get(e) != 0.0);
    return m;
  };
  auto differing = [](const std::vector<bool>& a, const std::vector<bool>& b) {
    std::size_t n = 0;
    for (std::size_t e = 0; e < a.size(); ++e) n += a[e] != b[e];
    return double(n) / double(a.size());
  };
  const std::vector<bool> m0 = mask();
  const std::vector<double> out0 = c.out.to_double();
  EXPECT_EQ(mask(), m0) << "same seed and offset, different mask";
  EXPECT_TRUE(bitwise_equal("out", c.out.to_double(), out0));
  const std::uint64_t seed = c.opts.seed;
  c.opts.seed = seed ^ (std::uint64_t(1) << 40);  // high word of the seed
  EXPECT_NEAR(differing(mask(), m0), 0.5, 0.1);
  c.opts.seed = seed;
  c.opts.offset += 1;
  EXPECT_NEAR(differing(mask(), m0), 0.5, 0.1);
  c.opts.offset += std::uint64_t(1) << 32;  // high word of the offset
  EXPECT_NEAR(differing(mask(), m0), 0.5, 0.1);
}

TEST(CpuDropout, ZeroProbabilityIsNoDropout) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 20, 30, 2, 1, 8), DType::kFloat32);
  c.poison_forward();
  c.run_forward();
  const std::vector<double> out0 = c.out.to_double();
  c.opts.dropout_p = 0.0f;
  c.opts.seed = rng();
  c.poison_forward();
  c.run_forward();
  EXPECT_TRUE(bitwise_equal("out", c.out.to_double(), out0));
}

}  // namespace
}  // namespace flashattn::test
