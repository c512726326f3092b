// CPU backend, learnable attention sinks (Options::learnable_sink, FlashAttention-4's
// learnable_sink, gpt-oss): forward, backward with the sink's gradient, varlen, KV cache
// (dense, paged, packed GQA decode, split-KV), sliding windows, against the fp64 oracle
// (reference.hpp adds the sink to each row's max and denominator); finite differences of
// the public fp64 forward for dq, dk, dv and d sink; the exact rules (a row that sees no
// key: out 0, lse = sink; a sink of -inf is no sink); determinism of d sink.
#include <cmath>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr DType kAllDtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

void check_dense(DenseCase& c, bool with_backward) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  ASSERT_FALSE(p.sink.empty());
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  if (!with_backward) return;
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  const BackwardResults got = backward_results(c);
  ASSERT_EQ(got.dsink.size(), static_cast<std::size_t>(c.shape.h_q));
  expect_backward_matches(p, c.dtype, fwd, got);
}

struct Feature {
  const char* name;
  int s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  float dropout;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

class CpuSinkFeature : public ::testing::TestWithParam<Feature> {};

TEST_P(CpuSinkFeature, ForwardAndBackwardMatchOracleInEveryDtype) {
  const Feature& f = GetParam();
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, f.s_q, f.s_k, f.h_q, f.h_k, f.d), dtype);
    c.opts.causal = f.causal;
    c.opts.window_left = f.left;
    c.opts.window_right = f.right;
    c.opts.softcap = f.softcap;
    c.opts.dropout_p = f.dropout;
    c.opts.seed = rng();
    c.opts.offset = rng();
    c.sink.set(random_sink(rng, f.h_q));
    check_dense(c, true);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, CpuSinkFeature,
    ::testing::Values(Feature{"plain", 23, 31, 2, 2, 16, false, -1, -1, 0, 0},
                      Feature{"gqa4", 17, 29, 8, 2, 8, false, -1, -1, 0, 0},
                      Feature{"mqa_causal", 13, 37, 4, 1, 12, true, -1, -1, 0, 0},
                      Feature{"causal_sq_gt_sk", 40, 15, 2, 1, 16, true, -1, -1, 0, 0},
                      // gpt-oss: causal sliding window (its layers use 128 tokens)
                      Feature{"causal_window", 45, 45, 4, 2, 8, true, 7, -1, 0, 0},
                      Feature{"causal_window_128", 150, 203, 2, 1, 8, true, 128, -1, 0, 0},
                      Feature{"window_both", 25, 35, 2, 2, 8, false, 5, 3, 0, 0},
                      Feature{"softcap", 21, 27, 2, 1, 16, false, -1, -1, 2.5f, 0},
                      Feature{"dropout", 37, 41, 2, 1, 16, true, -1, -1, 0, 0.25f},
                      Feature{"everything", 29, 34, 8, 2, 12, true, 11, -1, 4.0f, 0.2f}),
    [](const ::testing::TestParamInfo<Feature>& i) { return std::string(i.param.name); });

// ALiBi (per head and per (batch, head)) with a sink, and the debug probabilities: P is
// normalised with the sink (rows sum to 1 - P_sink), after dropout.
TEST(CpuSink, AlibiAndDebugProbs) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat64}) {
    for (int per_batch = 0; per_batch < 2; ++per_batch) {
      DenseCase c = DenseCase::random(rng, shape_of(2, 21, 27, 4, 2, 16), dtype);
      c.opts.causal = per_batch == 1;
      c.set_alibi(random_alibi(rng, 2, 4, per_batch == 1), per_batch == 1);
      c.opts.dropout_p = per_batch == 1 ? 0.2f : 0.0f;
      c.opts.seed = rng();
      c.want_probs();
      c.sink.set(random_sink(rng, 4));
      check_dense(c, true);
      if (dtype != DType::kFloat64 || per_batch == 1) continue;
      // Without dropout: each row's probabilities sum to 1 - exp(sink - lse).
      for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 4; ++h)
          for (int i = 0; i < 21; ++i) {
            double sum = 0;
            for (int j = 0; j < 27; ++j) sum += c.probs.at({b, h, i, j});
            const double p_sink = std::exp(double(c.sink.logits[static_cast<std::size_t>(h)]) - c.lse.at({b, h, i}));
            EXPECT_NEAR(sum, 1.0 - p_sink, 1e-6) << "row " << i;
          }
    }
  }
}

TEST(CpuSink, OddLengthsAndHeadDims) {
  FA_SEEDED_RNG(rng);
  for (int s : {1, 17, 113}) {
    for (int d : {3, 64}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, s, s + 6, 4, 2, d), DType::kBFloat16);
      c.opts.causal = s != 17;
      c.sink.set(random_sink(rng, 4));
      check_dense(c, true);
    }
  }
}

// Sinks far above and below the scores: the sink dominates the row (out -> 0, lse -> sink)
// or vanishes; nothing overflows.
TEST(CpuSink, ExtremeSinks) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 19, 23, 4, 2, 16), dtype);
    c.opts.causal = true;
    c.sink.set({-60.0f, 60.0f, 0.0f, 20.0f});
    check_dense(c, true);
  }
}

// A row that sees no key: out exactly 0, lse exactly the sink; its dq is 0 and it adds
// nothing to d sink (D_i = dO . 0 = 0).
TEST(CpuSink, RowsThatSeeNoKey) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    // causal with s_q > s_k: the first s_q - s_k rows see nothing.
    DenseCase c = DenseCase::random(rng, shape_of(1, 30, 12, 2, 1, 8), dtype);
    c.opts.causal = true;
    c.sink.set({0.75f, -1.5f});
    check_dense(c, true);
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 18; ++i) {
        ASSERT_EQ(c.lse.at({0, h, i}), static_cast<double>(c.sink.logits[h])) << "row " << i;
        for (int e = 0; e < 8; ++e) {
          ASSERT_EQ(c.out.at({0, i, h, e}), 0.0) << "row " << i;
          ASSERT_EQ(c.dq.at({0, i, h, e}), 0.0) << "row " << i;
        }
      }
  }
  // No keys at all: d sink is exactly 0 and lse is the sink everywhere.
  DenseCase none = DenseCase::random(rng, shape_of(2, 5, 0, 2, 1, 8), DType::kFloat32);
  none.sink.set({1.0f, 2.0f});
  check_dense(none, true);
  for (double g : none.sink.grad.to_double()) EXPECT_EQ(g, 0.0);
  for (std::int64_t e = 0; e < none.lse.numel(); ++e) EXPECT_EQ(none.lse.get(e), e % 10 < 5 ? 1.0 : 2.0);
}

// A sink of -inf is no sink: bit-identical outputs and gradients, and d sink = 0.
TEST(CpuSink, MinusInfinityIsNoSink) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat64}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 21, 33, 4, 2, 16), dtype);
    c.opts.causal = true;
    c.opts.window_left = 9;
    c.run_forward();
    c.run_backward();
    const std::vector<double> out0 = c.out.to_double(), lse0 = c.lse.to_double(), dq0 = c.dq.to_double(),
                              dk0 = c.dk.to_double(), dv0 = c.dv.to_double();
    const float inf = std::numeric_limits<float>::infinity();
    c.sink.set({-inf, -inf, -inf, -inf});
    c.poison_forward();
    c.run_forward();
    c.poison_backward();
    c.run_backward();
    EXPECT_TRUE(bitwise_equal("out", c.out.to_double(), out0));
    EXPECT_TRUE(bitwise_equal("lse", c.lse.to_double(), lse0));
    EXPECT_TRUE(bitwise_equal("dq", c.dq.to_double(), dq0));
    EXPECT_TRUE(bitwise_equal("dk", c.dk.to_double(), dk0));
    EXPECT_TRUE(bitwise_equal("dv", c.dv.to_double(), dv0));
    for (double g : c.sink.grad.to_double()) EXPECT_EQ(g, 0.0);
  }
}

// The sink changes the result (the test above would pass if it were ignored) and only
// through the denominator: out_with = out_without * exp(lse_without - lse_with).
TEST(CpuSink, OnlyRescalesTheRow) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 9, 14, 2, 1, 8), DType::kFloat64);
  c.run_forward();
  const std::vector<double> out0 = c.out.to_double(), lse0 = c.lse.to_double();
  c.sink.set({0.5f, 2.0f});
  c.run_forward();
  double max_change = 0;
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 9; ++i) {
      const double l0 = lse0[static_cast<std::size_t>(h * 9 + i)], l1 = c.lse.at({0, h, i});
      EXPECT_NEAR(l1, std::log(std::exp(l0) + std::exp(double(c.sink.logits[h]))), 1e-6);
      for (int e = 0; e < 8; ++e) {
        const double o0 = out0[static_cast<std::size_t>((i * 2 + h) * 8 + e)];
        // lse is stored in fp32 (API): exp(l0 - l1) is known to ~|l| * 2^-24 relative.
        EXPECT_NEAR(c.out.at({0, i, h, e}), o0 * std::exp(l0 - l1), 1e-6 * std::fabs(o0));
        max_change = std::max(max_change, std::fabs(c.out.at({0, i, h, e}) - o0));
      }
    }
  EXPECT_GT(max_change, 1e-3) << "the sink did not change the output";
}

// Central finite differences of the public fp64 forward against the backward: dq, dk,
// dv and d sink (the sink's derivation: dS_sink = P_sink (0 - D_i)).
struct FdCase {
  const char* name;
  int s_q, s_k, h_q, h_k, d;
  bool causal;
  int left;
  float softcap;
  float dropout;
};

void PrintTo(const FdCase& f, std::ostream* os) { *os << f.name; }

class CpuSinkFiniteDifferences : public ::testing::TestWithParam<FdCase> {};

TEST_P(CpuSinkFiniteDifferences, Fp64) {
  const FdCase& f = GetParam();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, f.s_q, f.s_k, f.h_q, f.h_k, f.d), DType::kFloat64);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.softcap = f.softcap;
  c.opts.softmax_scale = 0.4f;
  c.opts.dropout_p = f.dropout;
  c.opts.seed = rng();
  c.sink.set(random_sink(rng, f.h_q, -1.0, 1.5));
  SCOPED_TRACE(describe(c.call_options()));
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
    EXPECT_LE(s.max_abs_err, 1e-6 * std::max(1.0, s.max_abs_ref))
        << names[t] << " worst [" << s.worst << "]: backward " << analytic[s.worst] << " vs FD " << fd[s.worst];
    EXPECT_GT(s.max_abs_ref, 0.0) << names[t] << " vanishes: vacuous check";
  }
  // d sink: the sink is an fp32 tensor, so the step is a float one (1/1024: exact in fp32
  // for the drawn logits' magnitude); central differences in fp64 of the loss.
  const std::vector<double> analytic = c.sink.grad.to_double();
  std::vector<double> fd(analytic.size());
  constexpr float kSinkStep = 1.0f / 1024.0f;
  const std::vector<float> base = c.sink.logits;
  for (std::size_t h = 0; h < base.size(); ++h) {
    std::vector<float> up = base, down = base;
    up[h] += kSinkStep;
    down[h] -= kSinkStep;
    c.sink.set(up);
    const double lp = loss();
    c.sink.set(down);
    const double lm = loss();
    fd[h] = (lp - lm) / (double(up[h]) - double(down[h]));
  }
  c.sink.set(base);
  const ErrorStats s = error_stats(analytic, fd);
  EXPECT_TRUE(fully_written("dsink", analytic));
  // Central differences with step 2^-10 have truncation error ~ step^2 * |f'''| / 6.
  EXPECT_LE(s.max_abs_err, 1e-5 * std::max(1.0, s.max_abs_ref))
      << "dsink worst [" << s.worst << "]: backward " << analytic[s.worst] << " vs FD " << fd[s.worst];
  EXPECT_GT(s.max_abs_ref, 1e-3) << "dsink vanishes: vacuous check";
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuSinkFiniteDifferences,
                         ::testing::Values(FdCase{"plain", 4, 5, 2, 2, 3, false, -1, 0, 0},
                                           FdCase{"gqa", 5, 4, 4, 1, 3, false, -1, 0, 0},
                                           FdCase{"causal_window", 6, 4, 2, 1, 3, true, 2, 0, 0},
                                           FdCase{"softcap", 4, 6, 2, 1, 5, false, -1, 1.5f, 0},
                                           FdCase{"dropout", 9, 10, 2, 1, 3, false, -1, 0, 0.3f},
                                           FdCase{"everything", 9, 7, 4, 2, 3, true, 4, 2.0f, 0.25f}),
                         [](const ::testing::TestParamInfo<FdCase>& i) { return std::string(i.param.name); });

// deterministic = true: d sink bit-identical for 1, 2 and 3 threads (it is summed in a
// fixed order whatever the flag, so also without it).
TEST(CpuSink, SinkGradientDeterministicAcrossThreadCounts) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(3, 113, 97, 8, 2, 16), DType::kFloat16);
  c.opts.causal = true;
  c.opts.window_left = 40;
  c.sink.set(random_sink(rng, 8));
  c.run_forward();
  std::vector<double> g0;
  for (int threads : {1, 2, 3, 1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    c.opts.num_threads = threads;
    c.poison_backward();
    ASSERT_NO_THROW(c.run_backward());
    if (g0.empty()) {
      g0 = c.sink.grad.to_double();
      expect_backward_matches(c.problem(), c.dtype, forward_results(c), backward_results(c));
      continue;
    }
    EXPECT_TRUE(bitwise_equal("dsink", c.sink.grad.to_double(), g0));
  }
}

// The sink's gradient is optional: without learnable_sink_grad dq, dk, dv are the same.
TEST(CpuSink, BackwardWithoutSinkGradient) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 20, 26, 4, 2, 8), DType::kFloat32);
  c.opts.causal = true;
  c.sink.set(random_sink(rng, 4));
  check_dense(c, true);
  const std::vector<double> dq0 = c.dq.to_double(), dk0 = c.dk.to_double(), dv0 = c.dv.to_double();
  c.sink.want_grad = false;
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  EXPECT_TRUE(bitwise_equal("dq", c.dq.to_double(), dq0));
  EXPECT_TRUE(bitwise_equal("dk", c.dk.to_double(), dk0));
  EXPECT_TRUE(bitwise_equal("dv", c.dv.to_double(), dv0));
}

// ------------------------------------------------------------------ varlen

void check_varlen(VarlenCase& c) {
  SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " h_q=" + std::to_string(c.h_q) + " h_k=" +
               std::to_string(c.h_k) + " batch=" + std::to_string(c.batch()) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  ASSERT_FALSE(p.sink.empty());
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  const BackwardResults got = backward_results(c);
  ASSERT_EQ(got.dsink.size(), static_cast<std::size_t>(c.h_q));
  expect_backward_matches(p, c.dtype, fwd, got);
}

TEST(CpuSinkVarlen, EmptySequencesSequsedKAndWindows) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {0, 5, 0, 17, 1, 30, 9};
  const std::vector<int> lk = {7, 0, 0, 23, 1, 12, 40};
  for (DType dtype : kAllDtypes) {
    for (int mode = 0; mode < 3; ++mode) {
      VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 4, 2, 8, dtype, 3, 2);
      c.opts.causal = mode != 0;
      if (mode == 2) {
        c.opts.window_left = 6;
        c.set_seqused_k({3, 0, 0, 20, 1, 12, 33});
      }
      c.sink.set(random_sink(rng, 4));
      check_varlen(c);
    }
  }
}

TEST(CpuSinkVarlen, DropoutAndSoftcap) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {13, 1, 29}, lk = {19, 4, 29};
  VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 6, 3, 16, DType::kBFloat16);
  c.opts.dropout_p = 0.2f;
  c.opts.seed = rng();
  c.opts.softcap = 3.0f;
  c.opts.causal = true;
  c.sink.set(random_sink(rng, 6));
  check_varlen(c);
}

// ------------------------------------------------------------------ KV cache

void check_kvcache(KVCacheCase& c) {
  SCOPED_TRACE("b=" + std::to_string(c.cfg.batch) + " s_q=" + std::to_string(c.cfg.s_q) + " h_q=" +
               std::to_string(c.cfg.h_q) + " h_k=" + std::to_string(c.cfg.h_k) + " block_size=" +
               std::to_string(c.cfg.block_size) + " splits=" + std::to_string(c.num_splits) + " " +
               dtype_name(c.cfg.dtype) + " " + describe(c.call_options()));
  ASSERT_FALSE(c.sink.logits.empty());
  run_and_check_kvcache(c);
}

TEST(CpuSinkKVCache, DecodePagedDenseSplitsAndWindows) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    for (int block_size : {0, 16}) {
      for (int s_q : {1, 4}) {
        for (int splits : {1, 3, 0}) {
          KVCacheConfig cfg;
          cfg.batch = 3;
          cfg.s_q = s_q;
          cfg.s_new = s_q == 4 ? 2 : 1;
          cfg.h_q = 8;  // GQA 4: s_q = 1 packs the group's heads into one task
          cfg.h_k = 2;
          cfg.d = 16;
          cfg.dtype = dtype;
          cfg.block_size = block_size;
          cfg.max_cache_len = 300;
          cfg.cache_lens = {uniform_int(rng, 0, 300), 0, 257};
          KVCacheCase c = KVCacheCase::make(rng, cfg);
          c.num_splits = splits;
          c.opts.causal = true;
          if (splits == 3) c.opts.window_left = 128;  // gpt-oss's windowed layers
          c.sink.set(random_sink(rng, 8));
          check_kvcache(c);
        }
      }
    }
  }
}

// A split-KV decode and the unsplit one agree with a sink (the sink joins after the merge).
TEST(CpuSinkKVCache, SplitsAgreeWithUnsplit) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg;
  cfg.batch = 2;
  cfg.s_q = 1;
  cfg.h_q = 4;
  cfg.h_k = 4;
  cfg.d = 32;
  cfg.dtype = DType::kFloat32;
  cfg.cache_lens = {700, 513};
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.sink.set(random_sink(rng, 4));
  const ForwardExpectation expect = ForwardExpectation::of(c.problem(), cfg.dtype);
  const SplitAgreement agreement = SplitAgreement::of(expect);
  c.num_splits = 1;
  c.poison_outputs();
  c.run();
  const ForwardResults one = forward_results(c);
  expect_forward_matches(c.problem(), cfg.dtype, one, &expect);
  for (int splits : {2, 5, 16}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    c.num_splits = splits;
    c.poison_outputs();
    c.run();
    agreement.expect_agrees(cfg.dtype, forward_results(c), one);
  }
}

TEST(CpuSinkKVCache, Fp8Cache) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg;
  cfg.batch = 2;
  cfg.s_q = 1;
  cfg.s_new = 1;
  cfg.h_q = 4;
  cfg.h_k = 1;
  cfg.d = 16;
  cfg.dtype = DType::kBFloat16;
  cfg.block_size = 16;
  cfg.fp8 = true;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.sink.set(random_sink(rng, 4));
  check_kvcache(c);
}

}  // namespace
}  // namespace flashattn::test
