// CPU backend, dense forward: lengths, GQA ratios, head dims, dtypes, every mask,
// softcap, ALiBi, extreme logits, empty sequences, huge batches, determinism; every
// output is poisoned before the call and checked fully written.
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

constexpr DType kAllDtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};

// Poisons, runs the dense forward and checks it against the oracle.
void check_forward(DenseCase& c, double floor_ulps = kDefaultFloorUlps) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  expect_forward_matches(c.problem(), c.dtype, forward_results(c), nullptr, floor_ulps);
}

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

TEST(CpuForward, OddLengths) {
  FA_SEEDED_RNG(rng);
  for (int s : {1, 17, 113}) {
    for (bool causal : {false, true}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, s, s, 2, 1, 16), DType::kFloat32);
      c.opts.causal = causal;
      check_forward(c);
    }
  }
  DenseCase c = DenseCase::random(rng, shape_of(1, 1000, 1000, 1, 1, 8), DType::kFloat16);
  c.opts.causal = true;
  check_forward(c);
}

TEST(CpuForward, UnequalLengthsBothWays) {
  FA_SEEDED_RNG(rng);
  for (auto [s_q, s_k] : {std::pair{17, 113}, std::pair{113, 17}, std::pair{1, 1000}, std::pair{64, 1}}) {
    for (bool causal : {false, true}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, s_q, s_k, 2, 2, 8), DType::kBFloat16);
      c.opts.causal = causal;
      check_forward(c);
    }
  }
}

TEST(CpuForward, EveryGqaRatio) {
  FA_SEEDED_RNG(rng);
  for (auto [h_q, h_k] : {std::pair{4, 4}, std::pair{4, 2}, std::pair{8, 2}, std::pair{8, 1}, std::pair{16, 2},
                          std::pair{3, 1}}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 19, 23, h_q, h_k, 8), DType::kFloat32);
    c.opts.causal = h_q % 2 == 0;
    check_forward(c);
  }
}

TEST(CpuForward, HeadDims) {
  FA_SEEDED_RNG(rng);
  for (int d : {1, 3, 17, 64, 80, 256}) {
    for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
      DenseCase c = DenseCase::random(rng, shape_of(1, 21, 37, 2, 1, d), dtype);
      check_forward(c);
    }
  }
}

TEST(CpuForward, EveryDtype) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 33, 47, 4, 2, 24), dtype);
    c.opts.softmax_scale = 0.3f;
    check_forward(c);
  }
}

// fp32 tensors compute in fp64 (tile.hpp), so each output element is the exact
// attention of the fp32 inputs rounded once to fp32: within half an fp32 ulp of the
// oracle, plus fp64 rounding of the terms it sums. (In fp32 the sequential sums over d
// and the keys gave about 9 half-ulps at d = 32, more than twice a naive fp32 computation.)
TEST(CpuForward, Float32IsTheExactResultRoundedOnce) {
  FA_SEEDED_RNG(rng);
  for (int d : {32, 64, 128}) {
    for (bool causal : {false, true}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, 31, 145, 2, 2, d), DType::kFloat32);
      c.opts.causal = causal;
      if (d == 64) c.opts.softcap = 5.0f;
      SCOPED_TRACE(c.shape.str() + " " + describe(c.call_options()));
      c.poison_forward();
      ASSERT_NO_THROW(c.run_forward());
      const std::vector<double> got = forward_results(c).out;
      const std::vector<RefOutput> ref = reference_forward(c.problem());
      const std::vector<double> want = concat_out(ref);
      std::vector<double> mag;
      for (const RefOutput& r : ref) mag.insert(mag.end(), r.out_mag.begin(), r.out_mag.end());
      ASSERT_EQ(got.size(), want.size());
      ASSERT_EQ(mag.size(), want.size());
      for (std::size_t e = 0; e < got.size(); ++e) {
        ASSERT_LE(std::fabs(got[e] - want[e]), 0x1p-24 * std::fabs(want[e]) + 0x1p-40 * mag[e])
            << "element " << e << ": got " << got[e] << ", oracle " << want[e];
      }
    }
  }
}

struct MaskCase {
  const char* name;
  bool causal;
  int left, right;
};

class CpuForwardMask : public ::testing::TestWithParam<MaskCase> {};

// Every mask at s_q < s_k, s_q == s_k and s_q > s_k, in every dtype.
TEST_P(CpuForwardMask, MatchesOracle) {
  const MaskCase& m = GetParam();
  FA_SEEDED_RNG(rng);
  for (auto [s_q, s_k] : {std::pair{13, 40}, std::pair{29, 29}, std::pair{40, 13}}) {
    for (DType dtype : kAllDtypes) {
      DenseCase c = DenseCase::random(rng, shape_of(2, s_q, s_k, 2, 1, 12), dtype);
      c.opts.causal = m.causal;
      c.opts.window_left = m.left;
      c.opts.window_right = m.right;
      check_forward(c);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuForwardMask,
                         ::testing::Values(MaskCase{"none", false, -1, -1}, MaskCase{"causal", true, -1, -1},
                                           MaskCase{"left_only", false, 5, -1},
                                           MaskCase{"right_only", false, -1, 3},
                                           MaskCase{"both", false, 4, 2}, MaskCase{"zero_width", false, 0, 0},
                                           MaskCase{"causal_window", true, 6, -1},
                                           MaskCase{"causal_zero_left", true, 0, -1}),
                         [](const ::testing::TestParamInfo<MaskCase>& i) { return std::string(i.param.name); });

// Causal with s_q > s_k: the first s_q - s_k rows see nothing: out exactly 0, lse -inf.
TEST(CpuForward, FullyMaskedRowsAreZero) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 50, 20, 4, 2, 16), dtype);
    c.opts.causal = true;
    check_forward(c);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 4; ++h)
        for (int i = 0; i < 30; ++i) {
          ASSERT_EQ(c.lse.at({b, h, i}), -INFINITY) << b << " " << h << " " << i;
          for (int e = 0; e < 16; ++e) ASSERT_EQ(c.out.at({b, i, h, e}), 0.0);
        }
  }
}

TEST(CpuForward, Softcap) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 31, 45, 4, 2, 16), dtype, 3.0);
    c.opts.softcap = 5.0f;
    c.opts.causal = true;
    check_forward(c);
  }
}

TEST(CpuForward, Alibi) {
  FA_SEEDED_RNG(rng);
  for (bool per_batch : {false, true}) {
    for (DType dtype : kAllDtypes) {
      DenseCase c = DenseCase::random(rng, shape_of(3, 27, 41, 4, 1, 16), dtype);
      c.set_alibi(random_alibi(rng, 3, 4, per_batch), per_batch);
      c.opts.window_left = 20;
      check_forward(c);
    }
  }
}

TEST(CpuForward, SoftcapAlibiAndWindowTogether) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 37, 29, 8, 2, 20), DType::kFloat16, 2.0);
  c.opts.softcap = 3.0f;
  c.opts.causal = true;
  c.opts.window_left = 9;
  c.set_alibi(random_alibi(rng, 2, 8, true), true);
  check_forward(c);
}

// q.k around +-1e4 before the softmax scale: no NaN or inf, and the oracle's answer.
TEST(CpuForward, ExtremeLogits) {
  FA_SEEDED_RNG(rng);
  constexpr int kD = 16;
  for (DType dtype : kAllDtypes) {
    for (double sign : {1.0, -1.0}) {
      DenseCase c = DenseCase::random(rng, shape_of(1, 24, 40, 2, 1, kD), dtype);
      // Every q and k near +-25 * u (|u| = 1 direction per head): q.k ~ +-1e4 * sign,
      // with O(100) spread between keys.
      for (std::int64_t e = 0; e < c.q.numel(); ++e) c.q.set(e, 25.0 + c.q.get(e));
      for (std::int64_t e = 0; e < c.k.numel(); ++e) c.k.set(e, sign * (25.0 + c.k.get(e)));
      c.opts.causal = sign < 0;
      // Logits of magnitude L = scale * |q.k| ~ 2500: a rounding of one ulp in a logit
      // moves the probabilities by ~L ulp, so the floor is scaled by L.
      double max_logit = 0;
      const RefProblem p = c.problem();
      for (const RefSeq& s : p.seqs)
        for (int i = 0; i < s.s_q * p.h_q; ++i)
          for (int j = 0; j < s.s_k * p.h_k; ++j) {
            double dot = 0;
            for (int e = 0; e < kD; ++e) dot += std::fabs(s.q[i * kD + e] * s.k[j * kD + e]);
            max_logit = std::max(max_logit, p.scale * dot);
          }
      check_forward(c, kDefaultFloorUlps * max_logit);
      EXPECT_TRUE(all_finite("out", c.out.to_double()));
      const std::vector<double> lse = c.lse.to_double();
      EXPECT_TRUE(all_finite("lse", lse));
    }
  }
}

TEST(CpuForward, SeqlenZeroAndOne) {
  FA_SEEDED_RNG(rng);
  // No keys: every row is empty.
  DenseCase no_keys = DenseCase::random(rng, shape_of(2, 5, 0, 2, 1, 8), DType::kFloat32);
  check_forward(no_keys);
  for (std::int64_t e = 0; e < no_keys.lse.numel(); ++e) EXPECT_EQ(no_keys.lse.get(e), -INFINITY);
  // No queries: nothing to compute, nothing to fail.
  DenseCase no_queries = DenseCase::random(rng, shape_of(2, 0, 5, 2, 1, 8), DType::kFloat32);
  EXPECT_NO_THROW(no_queries.run_forward());
  // One query, one key: out = v, lse = scale * q.k.
  DenseCase one = DenseCase::random(rng, shape_of(1, 1, 1, 1, 1, 8), DType::kFloat64);
  check_forward(one);
  for (int e = 0; e < 8; ++e) EXPECT_EQ(one.out.get(e), one.v.get(e));
}

TEST(CpuForward, BatchOfOne) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 70, 70, 2, 2, 32), DType::kBFloat16);
  check_forward(c);
}

TEST(CpuForward, BatchOf2000TinySequences) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2000, 2, 3, 2, 1, 4), DType::kFloat32);
  c.opts.causal = true;
  check_forward(c);
}

TEST(CpuForward, ThreadCountsAgree) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 77, 91, 4, 2, 16), DType::kFloat32);
  c.opts.causal = true;
  for (int threads : {1, 2, 3}) {
    c.opts.num_threads = threads;
    check_forward(c);
  }
}

TEST(CpuForward, BitIdenticalAcrossRuns) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 65, 130, 4, 1, 24), DType::kFloat16);
  c.opts.window_left = 40;
  c.opts.softcap = 4.0f;
  c.poison_forward();
  c.run_forward();
  const std::vector<double> out0 = c.out.to_double(), lse0 = c.lse.to_double();
  for (int run = 0; run < 3; ++run) {
    c.poison_forward();
    c.run_forward();
    EXPECT_TRUE(bitwise_equal("out", c.out.to_double(), out0));
    EXPECT_TRUE(bitwise_equal("lse", c.lse.to_double(), lse0));
  }
}

// q, k, v as slices of one packed qkv buffer [b, s, 3 * h, d]; out written into a
// buffer with padded rows, whose padding must stay untouched.
TEST(CpuForward, StridedPackedQkvAndPaddedOut) {
  FA_SEEDED_RNG(rng);
  constexpr int kB = 2, kS = 29, kH = 4, kD = 16, kPad = 8;
  DenseCase c = DenseCase::random(rng, shape_of(kB, kS, kS, kH, kH, kD), DType::kFloat16);
  c.opts.causal = true;
  HostTensor qkv(DType::kFloat16, {kB, kS, 3 * kH, kD});
  for (int b = 0; b < kB; ++b)
    for (int s = 0; s < kS; ++s)
      for (int h = 0; h < kH; ++h)
        for (int e = 0; e < kD; ++e) {
          qkv.set(qkv.index({b, s, h, e}), c.q.at({b, s, h, e}));
          qkv.set(qkv.index({b, s, kH + h, e}), c.k.at({b, s, h, e}));
          qkv.set(qkv.index({b, s, 2 * kH + h, e}), c.v.at({b, s, h, e}));
        }
  const std::int64_t row = 3 * kH * kD;
  auto slice = [&](int part) {
    return Tensor::strided(static_cast<std::uint16_t*>(qkv.data()) + part * kH * kD, DType::kFloat16,
                           {kB, kS, kH, kD}, {kS * row, row, kD, 1});
  };
  HostTensor out_buf(DType::kFloat16, {kB, kS, kH * kD + kPad});
  out_buf.fill_nan();
  const Tensor out = Tensor::strided(out_buf.data(), DType::kFloat16, {kB, kS, kH, kD},
                                     {kS * (kH * kD + kPad), kH * kD + kPad, kD, 1});
  c.lse.fill_nan();
  ASSERT_NO_THROW(forward(slice(0), slice(1), slice(2), out, c.lse.view(), c.call_options()));
  std::int64_t padding_written = 0;
  for (int b = 0; b < kB; ++b)
    for (int s = 0; s < kS; ++s) {
      for (int e = 0; e < kH * kD; ++e) c.out.set(c.out.index({b, s, e / kD, e % kD}), out_buf.at({b, s, e}));
      for (int e = kH * kD; e < kH * kD + kPad; ++e) padding_written += !std::isnan(out_buf.at({b, s, e}));
    }
  EXPECT_EQ(padding_written, 0) << "out row padding was written";
  expect_forward_matches(c.problem(), c.dtype, forward_results(c));
}

// Random shapes and features, all dtypes.
TEST(CpuForward, RandomShapesAndFeatures) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 24; ++trial) {
    const Shape shape = random_shape(rng);
    const DType dtype = kAllDtypes[uniform_int(rng, 0, 3)];
    DenseCase c = DenseCase::random(rng, shape, dtype);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 20);
    if (coin(rng, 0.3)) c.opts.window_right = uniform_int(rng, 0, 20);
    if (coin(rng, 0.3)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 10.0));
    if (coin(rng, 0.3)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, shape.batch, shape.h_q, per_batch), per_batch);
    }
    if (coin(rng, 0.5)) c.opts.softmax_scale = static_cast<float>(uniform_real(rng, 0.05, 0.5));
    check_forward(c);
  }
}

}  // namespace
}  // namespace flashattn::test
