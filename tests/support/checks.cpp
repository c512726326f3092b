#include "support/checks.hpp"

#include <algorithm>
#include <cmath>
#include <exception>

#include <gtest/gtest.h>

#include "support/compare.hpp"

namespace flashattn::test {

namespace {
std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }
double max_keys(const RefProblem& p) {
  int n = 1;
  for (const RefSeq& s : p.seqs) n = std::max(n, s.s_k);
  return n;
}
double max_queries(const RefProblem& p) {
  int n = 1;
  for (const RefSeq& s : p.seqs) n = std::max(n, s.s_q);
  return n;
}
}  // namespace

std::vector<RefOutput> split_forward(const RefProblem& p, const ForwardResults& r) {
  std::vector<RefOutput> parts(p.seqs.size());
  std::size_t o = 0, l = 0;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const std::size_t n_out = sz(std::int64_t(p.seqs[b].s_q) * p.h_q * p.dv());
    const std::size_t n_lse = sz(std::int64_t(p.seqs[b].s_q) * p.h_q);
    parts[b].out.assign(r.out.begin() + std::ptrdiff_t(o), r.out.begin() + std::ptrdiff_t(o + n_out));
    parts[b].lse.assign(r.lse.begin() + std::ptrdiff_t(l), r.lse.begin() + std::ptrdiff_t(l + n_lse));
    o += n_out;
    l += n_lse;
  }
  return parts;
}

ForwardExpectation ForwardExpectation::of(const RefProblem& p, DType dtype) {
  return {reference_forward(p), naive_forward(p, dtype)};
}

void expect_forward_matches(const RefProblem& p, DType dtype, const ForwardResults& got,
                            const ForwardExpectation* expectation, double floor_ulps) {
  ForwardExpectation local;
  if (!expectation) {
    local = ForwardExpectation::of(p, dtype);
    expectation = &local;
  }
  const std::vector<double> ref_out = concat_out(expectation->ref);
  const std::vector<double> ref_lse = concat_lse(expectation->ref);
  double out_magnitude = 0;
  for (const RefOutput& r : expectation->ref)
    for (double m : r.out_mag) out_magnitude = std::max(out_magnitude, m);
  const double key_terms = max_keys(p);
  EXPECT_TRUE(fully_written("out", got.out));
  EXPECT_TRUE(fully_written("lse", got.lse));
  EXPECT_TRUE(close_to_reference("out", got.out, ref_out, concat_out(expectation->naive), dtype,
                                 floor_ulps, out_magnitude, key_terms));
  EXPECT_TRUE(close_to_reference("lse", got.lse, ref_lse, concat_lse(expectation->naive), DType::kFloat32,
                                 kDefaultFloorUlps, 0.0, key_terms));
  // Rows that see no key: out exactly 0 and lse -inf (close_to_reference checks the -inf).
  std::size_t o = 0, l = 0, bad = 0;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const RefSeq& s = p.seqs[b];
    for (int i = 0; i < s.s_q; ++i)
      for (int h = 0; h < p.h_q; ++h) {
        if (ref_lse[l + sz(std::int64_t(h) * s.s_q + i)] != -INFINITY) continue;
        for (int c = 0; c < p.dv(); ++c) bad += got.out[o + sz((std::int64_t(i) * p.h_q + h) * p.dv() + c)] != 0.0;
      }
    o += sz(std::int64_t(s.s_q) * p.h_q * p.dv());
    l += sz(std::int64_t(s.s_q) * p.h_q);
  }
  EXPECT_EQ(bad, 0u) << "out elements of rows that see no key are not exactly 0";
  if (!got.probs.empty()) {
    const std::vector<double> ref_probs = concat_probs(expectation->ref);
    EXPECT_TRUE(fully_written("probs", got.probs));
    EXPECT_TRUE(close_to_reference("probs", got.probs, ref_probs, concat_probs(expectation->naive),
                                   DType::kFloat32));
    std::size_t nonzero_where_zero = 0;
    for (std::size_t e = 0; e < ref_probs.size() && e < got.probs.size(); ++e)
      nonzero_where_zero += ref_probs[e] == 0.0 && got.probs[e] != 0.0;
    EXPECT_EQ(nonzero_where_zero, 0u) << "probs not exactly 0 where the oracle masks or drops";
  }
}

void expect_backward_matches(const RefProblem& p, DType dtype, const ForwardResults& forward,
                             const BackwardResults& got) {
  const std::vector<RefGrads> ref = reference_backward(p);
  const std::vector<RefGrads> naive = naive_backward(p, dtype, split_forward(p, forward));
  EXPECT_TRUE(fully_written("dq", got.dq));
  EXPECT_TRUE(fully_written("dk", got.dk));
  EXPECT_TRUE(fully_written("dv", got.dv));
  auto magnitude = [&](std::vector<double> RefGrads::*field) {
    double m = 0;
    for (const RefGrads& g : ref)
      for (double x : g.*field) m = std::max(m, x);
    return m;
  };
  // dq sums over keys; dk and dv over the queries of every head of a group.
  const double query_terms = max_queries(p) * double(p.h_q / p.h_k);
  EXPECT_TRUE(close_to_reference("dq", got.dq, concat_dq(ref), concat_dq(naive), dtype, kDefaultFloorUlps,
                                 magnitude(&RefGrads::dq_mag), max_keys(p)));
  EXPECT_TRUE(close_to_reference("dk", got.dk, concat_dk(ref), concat_dk(naive), dtype, kDefaultFloorUlps,
                                 magnitude(&RefGrads::dk_mag), query_terms));
  EXPECT_TRUE(close_to_reference("dv", got.dv, concat_dv(ref), concat_dv(naive), dtype, kDefaultFloorUlps,
                                 magnitude(&RefGrads::dv_mag), query_terms));
  // The sink's gradient sums one term per query row of every sequence (fp32 output).
  if (!p.sink.empty() && !got.dsink.empty()) {
    double rows = 0;
    for (const RefSeq& s : p.seqs) rows += s.s_q;
    std::vector<double> mag(sz(p.h_q), 0.0);  // per head, summed over the sequences
    for (const RefGrads& g : ref)
      for (std::size_t h = 0; h < g.dsink_mag.size() && h < mag.size(); ++h) mag[h] += g.dsink_mag[h];
    EXPECT_TRUE(fully_written("dsink", got.dsink));
    EXPECT_TRUE(close_to_reference("dsink", got.dsink, concat_dsink(ref), concat_dsink(naive),
                                   DType::kFloat32, kDefaultFloorUlps,
                                   *std::max_element(mag.begin(), mag.end()), std::max(rows, 1.0)));
  }
  // Rows that see no key: dq exactly 0.
  const std::vector<RefOutput> f = reference_forward(p);
  std::size_t o = 0, bad = 0;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const RefSeq& s = p.seqs[b];
    for (int i = 0; i < s.s_q; ++i)
      for (int h = 0; h < p.h_q; ++h) {
        if (f[b].lse[sz(std::int64_t(h) * s.s_q + i)] != -INFINITY) continue;
        for (int c = 0; c < p.d; ++c) bad += got.dq[o + sz((std::int64_t(i) * p.h_q + h) * p.d + c)] != 0.0;
      }
    o += sz(std::int64_t(s.s_q) * p.h_q * p.d);
  }
  EXPECT_EQ(bad, 0u) << "dq elements of rows that see no key are not exactly 0";
  // Keys no query of their group sees: dk and dv exactly 0.
  std::size_t kv = 0, kv_v = 0, bad_kv = 0;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const RefSeq& s = p.seqs[b];
    for (int j = 0; j < s.s_k; ++j) {
      bool seen = false;
      for (int i = 0; i < s.s_q && !seen; ++i) {
        if (s.element_mask.empty()) {
          seen = semantics::key_visible(i, j, s.s_q, s.s_k, p.mask);
        } else {  // a block-sparse mask: seen by any head
          for (int h = 0; h < p.h_q && !seen; ++h)
            seen = s.element_mask[sz((std::int64_t(h) * s.s_q + i) * s.s_k + j)] != 0;
        }
      }
      if (seen) continue;
      for (int e = 0; e < p.h_k * p.d; ++e) bad_kv += got.dk[kv + sz(std::int64_t(j) * p.h_k * p.d + e)] != 0.0;
      for (int e = 0; e < p.h_k * p.dv(); ++e)
        bad_kv += got.dv[kv_v + sz(std::int64_t(j) * p.h_k * p.dv() + e)] != 0.0;
    }
    kv += sz(std::int64_t(s.s_k) * p.h_k * p.d);
    kv_v += sz(std::int64_t(s.s_k) * p.h_k * p.dv());
  }
  EXPECT_EQ(bad_kv, 0u) << "dk/dv elements of keys that no query sees are not exactly 0";
}

ForwardResults forward_results(const DenseCase& c) {
  ForwardResults r{c.out.to_double(), c.lse.to_double(), {}};
  if (!c.probs.shape().empty()) r.probs = c.probs.to_double();
  return r;
}

BackwardResults backward_results(const DenseCase& c) {
  return {c.dq.to_double(), c.dk.to_double(), c.dv.to_double(), c.sink.grad_values()};
}

ForwardResults forward_results(const VarlenCase& c) {
  ForwardResults r{c.out_concat(), c.lse_concat(), {}};
  if (!c.probs.shape().empty()) r.probs = c.probs_concat();
  return r;
}

BackwardResults backward_results(const VarlenCase& c) {
  return {c.dq_concat(), c.dk_concat(), c.dv_concat(), c.sink.grad_values()};
}

ForwardResults forward_results(const KVCacheCase& c) { return {c.out.to_double(), c.lse.to_double(), {}}; }

namespace {
BackwardResults expect_written_and_matching(BackwardResults got, const RefProblem& p, DType dtype,
                                            const ForwardResults& forward, bool dq_written) {
  if (dq_written) EXPECT_TRUE(fully_written("dq", got.dq));
  EXPECT_TRUE(fully_written("dk", got.dk));
  EXPECT_TRUE(fully_written("dv", got.dv));
  expect_backward_matches(p, dtype, forward, got);
  return got;
}
}  // namespace

BackwardResults expect_backward_written_and_matching(const DenseCase& c, const RefProblem& p, DType dtype,
                                                     const ForwardResults& forward, bool dq_written) {
  return expect_written_and_matching(backward_results(c), p, dtype, forward, dq_written);
}
BackwardResults expect_backward_written_and_matching(const VarlenCase& c, const RefProblem& p, DType dtype,
                                                     const ForwardResults& forward, bool dq_written) {
  return expect_written_and_matching(backward_results(c), p, dtype, forward, dq_written);
}

void expect_gradients_match_central_differences(DenseCase& c) {
  auto loss = [&] {
    c.run_forward();
    double l = 0;
    for (std::int64_t e = 0; e < c.out.numel(); ++e) l += c.out.get(e) * c.dout.get(e);
    return l;
  };
  ASSERT_NO_THROW(c.run_forward());
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  constexpr double kStep = 1e-5;
  const std::pair<HostTensor*, HostTensor*> pairs[] = {{&c.q, &c.dq}, {&c.k, &c.dk}, {&c.v, &c.dv}};
  const char* names[] = {"dq", "dk", "dv"};
  for (int t = 0; t < 3; ++t) {
    HostTensor& x = *pairs[t].first;
    const std::vector<double> analytic = pairs[t].second->to_double();
    ASSERT_EQ(analytic.size(), static_cast<std::size_t>(x.numel()));
    std::vector<double> fd(analytic.size());
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      const double x0 = x.get(e);
      x.set(e, x0 + kStep);
      const double lp = loss();
      x.set(e, x0 - kStep);
      const double lm = loss();
      x.set(e, x0);
      fd[static_cast<std::size_t>(e)] = (lp - lm) / (2 * kStep);
    }
    const ErrorStats s = error_stats(analytic, fd);
    EXPECT_TRUE(fully_written(names[t], analytic));
    // The backward reads the fp32 lse, so its gradients carry ~1e-7 relative error.
    EXPECT_LE(s.max_abs_err, 1e-6 * std::max(1.0, s.max_abs_ref))
        << names[t] << " worst [" << s.worst << "]: backward " << analytic[s.worst] << " vs FD " << fd[s.worst];
    EXPECT_GT(s.max_abs_ref, 0.0) << names[t] << " vanishes: vacuous check";
  }
}

ForwardResults run_and_check_kvcache(KVCacheCase& c, const ForwardExpectation* expectation) {
  c.poison_outputs();
  try {
    c.run();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "kvcache_forward threw: " << e.what();
    return {};
  }
  const ForwardResults got = forward_results(c);
  expect_forward_matches(c.problem(), c.cfg.dtype, got, expectation);
  EXPECT_TRUE(c.k_cache.bitwise_equal(c.k_cache_expected))
      << "k_cache after the call differs from the expected append (new rows at cache_seqlens, rest untouched)";
  EXPECT_TRUE(c.v_cache.bitwise_equal(c.v_cache_expected))
      << "v_cache after the call differs from the expected append (new rows at cache_seqlens, rest untouched)";
  return got;
}

SplitAgreement SplitAgreement::of(const ForwardExpectation& expect) {
  return {error_stats(concat_out(expect.naive), concat_out(expect.ref)).max_abs_err,
          error_stats(concat_lse(expect.naive), concat_lse(expect.ref))};
}

void SplitAgreement::expect_agrees(DType dtype, const ForwardResults& split,
                                   const ForwardResults& one) const {
  const ErrorStats d = error_stats(split.out, one.out);
  const double bound =
      2 * (2 * naive_out_err + kDefaultFloorUlps * dtype_epsilon(dtype) * d.max_abs_ref);
  EXPECT_LE(d.max_abs_err, bound) << "split result vs num_splits=1";
  const double lse_bound = 2 * (2 * naive_lse.max_abs_err + kDefaultFloorUlps *
                                                              dtype_epsilon(DType::kFloat32) *
                                                              naive_lse.max_abs_ref);
  EXPECT_LE(error_stats(split.lse, one.lse).max_abs_err, lse_bound) << "lse vs num_splits=1";
}

void expect_split_counts_agree(const KVCacheCase& base, const ForwardExpectation& expect, DType dtype,
                               std::initializer_list<int> splits,
                               const std::function<ForwardResults(KVCacheCase&)>& run) {
  ASSERT_TRUE(splits.size() > 0 && *splits.begin() == 1) << "the num_splits = 1 run comes first";
  const SplitAgreement agree = SplitAgreement::of(expect);
  ForwardResults one;
  for (int splits_now : splits) {
    SCOPED_TRACE("num_splits " + std::to_string(splits_now));
    KVCacheCase c = base;
    c.num_splits = splits_now;
    const ForwardResults got = run(c);
    if (splits_now == 1) {
      one = got;
    } else {
      agree.expect_agrees(dtype, got, one);
    }
  }
}

}  // namespace flashattn::test
