// The oracle itself: closed-form cases, and its gradients against central finite
// differences of its own forward (fp64). Named CpuReference.* with the CPU suite.
#include <cmath>
#include <functional>

#include <gtest/gtest.h>

#include "reference/reference.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

RefProblem random_problem(Rng& rng, int batch, int s_q, int s_k, int h_q, int h_k, int d) {
  RefProblem p;
  p.h_q = h_q;
  p.h_k = h_k;
  p.d = d;
  p.scale = 1.0 / std::sqrt(double(d));
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int b = 0; b < batch; ++b) {
    RefSeq s;
    s.s_q = s_q;
    s.s_k = s_k;
    for (int e = 0; e < s_q * h_q * d; ++e) s.q.push_back(normal(rng));
    for (int e = 0; e < s_q * h_q * d; ++e) s.dout.push_back(normal(rng));
    for (int e = 0; e < s_k * h_k * d; ++e) s.k.push_back(normal(rng));
    for (int e = 0; e < s_k * h_k * d; ++e) s.v.push_back(normal(rng));
    p.seqs.push_back(std::move(s));
  }
  return p;
}

// sum over sequences of <out, dout>: its gradient is what the backward returns.
double loss(const RefProblem& p) {
  const std::vector<RefOutput> f = reference_forward(p);
  double l = 0;
  for (std::size_t b = 0; b < f.size(); ++b)
    for (std::size_t e = 0; e < f[b].out.size(); ++e) l += f[b].out[e] * p.seqs[b].dout[e];
  return l;
}

void expect_gradients_match_finite_differences(RefProblem p) {
  const std::vector<RefGrads> g = reference_backward(p);
  constexpr double kStep = 1e-5;
  struct Field {
    const char* name;
    std::vector<double> RefSeq::*input;
    const std::vector<double> RefGrads::*grad;
  };
  const Field fields[] = {{"dq", &RefSeq::q, &RefGrads::dq},
                          {"dk", &RefSeq::k, &RefGrads::dk},
                          {"dv", &RefSeq::v, &RefGrads::dv}};
  for (const Field& f : fields) {
    std::vector<double> fd, an;
    for (std::size_t b = 0; b < p.seqs.size(); ++b) {
      std::vector<double>& x = p.seqs[b].*(f.input);
      for (std::size_t e = 0; e < x.size(); ++e) {
        const double x0 = x[e];
        x[e] = x0 + kStep;
        const double lp = loss(p);
        x[e] = x0 - kStep;
        const double lm = loss(p);
        x[e] = x0;
        fd.push_back((lp - lm) / (2 * kStep));
        an.push_back((g[b].*(f.grad))[e]);
      }
    }
    const ErrorStats s = error_stats(an, fd);
    // Central differences: O(step^2) truncation plus O(1e-16 / step) cancellation.
    EXPECT_LE(s.max_abs_err, 1e-7 * std::max(1.0, s.max_abs_ref))
        << f.name << ": analytic vs finite differences, worst [" << s.worst << "] "
        << an[s.worst] << " vs " << fd[s.worst];
    EXPECT_GT(s.max_abs_ref, 0.0) << f.name << " is identically zero: the check is vacuous";
  }
}

TEST(CpuReference, SingleKeyGivesItsValue) {
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 2, 3, 1, 2, 1, 5);
  const std::vector<RefOutput> f = reference_forward(p);
  for (std::size_t b = 0; b < f.size(); ++b)
    for (int i = 0; i < 3; ++i)
      for (int h = 0; h < 2; ++h) {
        double dot = 0;
        for (int c = 0; c < 5; ++c) dot += p.seqs[b].q[(i * 2 + h) * 5 + c] * p.seqs[b].k[c];
        EXPECT_DOUBLE_EQ(f[b].lse[h * 3 + i], dot * p.scale);
        for (int c = 0; c < 5; ++c) EXPECT_DOUBLE_EQ(f[b].out[(i * 2 + h) * 5 + c], p.seqs[b].v[c]);
      }
}

TEST(CpuReference, ZeroQueryAveragesVisibleValues) {
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 1, 4, 6, 1, 1, 3);
  for (double& x : p.seqs[0].q) x = 0;
  p.mask = semantics::Mask::make(true, 1, -1);  // row i sees keys i+1 .. i+3 (diag = i + 2)
  const std::vector<RefOutput> f = reference_forward(p);
  for (int i = 0; i < 4; ++i) {
    const int j0 = std::max(0, i + 2 - 1), j1 = i + 2;
    EXPECT_NEAR(f[0].lse[i], std::log(double(j1 - j0 + 1)), 1e-15);
    for (int c = 0; c < 3; ++c) {
      double mean = 0;
      for (int j = j0; j <= j1; ++j) mean += p.seqs[0].v[j * 3 + c];
      EXPECT_NEAR(f[0].out[i * 3 + c], mean / (j1 - j0 + 1), 1e-15);
    }
  }
}

TEST(CpuReference, EmptyRowsAreZeroWithMinusInfLse) {
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 1, 6, 3, 2, 2, 4);
  p.mask = semantics::Mask::make(true, -1, -1);  // s_q > s_k: rows 0..2 see nothing
  const std::vector<RefOutput> f = reference_forward(p);
  const std::vector<RefGrads> g = reference_backward(p);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 6; ++i) {
      if (i < 3) {
        EXPECT_EQ(f[0].lse[h * 6 + i], -INFINITY);
        for (int c = 0; c < 4; ++c) {
          EXPECT_EQ(f[0].out[(i * 2 + h) * 4 + c], 0.0);
          EXPECT_EQ(g[0].dq[(i * 2 + h) * 4 + c], 0.0);
        }
      } else {
        EXPECT_TRUE(std::isfinite(f[0].lse[h * 6 + i]));
      }
    }
}

TEST(CpuReference, DropoutProbsMatchKeepRule) {
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 2, 19, 21, 2, 1, 4);
  p.dropout_p = 0.3;
  p.rng = {rng(), rng(), semantics::dropout_threshold(0.3f)};
  const std::vector<RefOutput> f = reference_forward(p);
  RefProblem plain = p;
  plain.dropout_p = 0;
  plain.rng.threshold = 0;
  const std::vector<RefOutput> u = reference_forward(plain);
  std::int64_t kept = 0, total = 0;
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 19; ++i)
        for (int j = 0; j < 21; ++j) {
          const std::size_t e = std::size_t((h * 19 + i) * 21 + j);
          const bool keep = p.keep(b, h, i, j);
          EXPECT_EQ(f[b].probs[e], keep ? u[b].probs[e] : 0.0);
          kept += keep;
          ++total;
        }
  EXPECT_NEAR(double(kept) / double(total), 0.7, 0.06);
  for (int b = 0; b < 2; ++b) EXPECT_EQ(f[b].lse, u[b].lse);  // lse of the un-dropped softmax
}

TEST(CpuReference, NaiveFp64MatchesOracle) {
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 2, 9, 13, 4, 2, 7);
  p.softcap = 2.5;
  p.alibi = {0.5, 0.25, 0.125, 0.0625};
  p.mask = semantics::Mask::make(false, 5, 2);
  const std::vector<RefOutput> f = reference_forward(p);
  const std::vector<RefOutput> n = naive_forward(p, DType::kFloat64);
  EXPECT_LE(error_stats(concat_out(n), concat_out(f)).max_abs_err, 1e-13);
  EXPECT_LE(error_stats(concat_lse(n), concat_lse(f)).max_abs_err, 1e-6);  // lse rounded to fp32
  const std::vector<RefGrads> g = reference_backward(p);
  const std::vector<RefGrads> ng = naive_backward(p, DType::kFloat64, f);
  EXPECT_LE(error_stats(concat_dq(ng), concat_dq(g)).max_abs_err, 1e-12);
  EXPECT_LE(error_stats(concat_dk(ng), concat_dk(g)).max_abs_err, 1e-12);
  EXPECT_LE(error_stats(concat_dv(ng), concat_dv(g)).max_abs_err, 1e-12);
}

TEST(CpuReference, NaiveFp16ErrorIsAtDtypeLevel) {
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 1, 16, 16, 2, 2, 16);
  for (RefSeq& s : p.seqs)
    for (auto* v : {&s.q, &s.k, &s.v, &s.dout})
      for (double& x : *v) x = round_to(DType::kFloat16, x);
  const std::vector<RefOutput> f = reference_forward(p);
  const ErrorStats e = error_stats(concat_out(naive_forward(p, DType::kFloat16)), concat_out(f));
  EXPECT_GT(e.max_abs_err, 0.0);
  EXPECT_LT(e.max_abs_err, 20 * dtype_epsilon(DType::kFloat16) * e.max_abs_ref);
}

struct FeatureCase {
  const char* name;
  int s_q, s_k, h_q, h_k;
  bool causal;
  int left, right;
  double softcap;
  bool alibi, alibi_per_batch;
  double dropout;
};

void PrintTo(const FeatureCase& f, std::ostream* os) { *os << f.name; }

class CpuReferenceGrad : public ::testing::TestWithParam<FeatureCase> {};

TEST_P(CpuReferenceGrad, MatchesFiniteDifferences) {
  const FeatureCase& c = GetParam();
  FA_SEEDED_RNG(rng);
  RefProblem p = random_problem(rng, 2, c.s_q, c.s_k, c.h_q, c.h_k, 3);
  p.mask = semantics::Mask::make(c.causal, c.left, c.right);
  p.softcap = c.softcap;
  if (c.alibi) {
    p.alibi_per_batch = c.alibi_per_batch;
    for (int e = 0; e < (c.alibi_per_batch ? 2 : 1) * c.h_q; ++e) p.alibi.push_back(uniform_real(rng, 0.05, 1.0));
  }
  if (c.dropout > 0) {
    p.dropout_p = c.dropout;
    p.rng = {rng(), rng(), semantics::dropout_threshold(float(c.dropout))};
  }
  expect_gradients_match_finite_differences(p);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, CpuReferenceGrad,
    ::testing::Values(FeatureCase{"plain", 4, 5, 2, 2, false, -1, -1, 0, false, false, 0},
                      FeatureCase{"gqa", 5, 4, 4, 1, false, -1, -1, 0, false, false, 0},
                      FeatureCase{"causal", 6, 3, 2, 1, true, -1, -1, 0, false, false, 0},
                      FeatureCase{"window", 5, 7, 2, 2, false, 1, 2, 0, false, false, 0},
                      FeatureCase{"softcap", 4, 6, 2, 1, false, -1, -1, 1.5, false, false, 0},
                      FeatureCase{"alibi", 4, 6, 2, 2, true, -1, -1, 0, true, false, 0},
                      FeatureCase{"alibi_batch", 4, 6, 2, 2, false, 2, -1, 0, true, true, 0},
                      FeatureCase{"dropout", 9, 10, 2, 1, false, -1, -1, 0, false, false, 0.4},
                      FeatureCase{"everything", 9, 6, 4, 2, true, 3, -1, 2.0, true, true, 0.25}),
    [](const ::testing::TestParamInfo<FeatureCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace flashattn::test
