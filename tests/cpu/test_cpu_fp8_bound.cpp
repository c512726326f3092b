// The accuracy bound of the CUDA fp8 forward (support/fp8_bound.hpp: P rounded to e4m3
// before the P V product), checked on the host where no GPU is needed: the CPU backend's fp8
// forward (exact but for fp32 and the output rounding) and a host model of the P-quantizing
// kernel (the reference max lagging the row max by up to 8 in log2 units, P rounded to e4m3
// with round-to-nearest, the fp32 P summed, out rounded once) stay within it on random
// problems with every feature of the CUDA test (tests/cuda/test_cuda_fp8.cpp); and it is
// tight enough to fail: the model reaches most of it on a worst case, and P rounded to two
// mantissa bits, or a wrong v descale, goes beyond it.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "flashattn/semantics.hpp"
#include "reference/reference.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/fp8_bound.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

double round_e4m3(double x) { return e4m3_reference(semantics::float_to_e4m3(static_cast<float>(x))); }

// Round to nearest with 2 mantissa bits (one fewer than e4m3): a kernel that rounds P
// too coarsely.
double round_2_bits(double x) {
  if (x == 0) return 0;
  int e = 0;
  const double m = std::frexp(x, &e);  // [0.5, 1)
  return std::ldexp(std::nearbyint(m * 8) / 8, e);
}

// A host model of the P-quantizing kernel over p (its dequantized inputs), from the oracle's
// probabilities (score s_j = lse + log P_j): the reference max is the row's largest visible
// score minus `lag` (natural-log units; < 0: drawn from [0, 8 ln 2]), P' = exp(s_j - m_ref)
// goes through round_p for the P V product, the row sum takes P' unrounded (and the sink),
// out is rounded to out_dtype once, lse = m_ref + log(sum). Results in concat order.
template <class Round>
ForwardResults model_kernel(const RefProblem& p, const std::vector<RefOutput>& ref, DType out_dtype,
                            Rng& rng, Round round_p, double lag = -1, double v_factor = 1.0) {
  ForwardResults r;
  const int dv = p.dv(), ratio = p.h_q / p.h_k;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const RefSeq& s = p.seqs[b];
    std::vector<double> out(std::size_t(s.s_q) * p.h_q * dv, 0.0), lse(std::size_t(p.h_q) * s.s_q);
    for (int h = 0; h < p.h_q; ++h) {
      const int g = h / ratio;
      const double sink = p.sink_logit(h);
      for (int i = 0; i < s.s_q; ++i) {
        const double ref_lse = ref[b].lse[std::size_t(h) * s.s_q + i];
        double& l_out = lse[std::size_t(h) * s.s_q + i];
        if (!std::isfinite(ref_lse)) {
          l_out = ref_lse;
          continue;
        }
        const double* P = &ref[b].probs[(std::size_t(h) * s.s_q + i) * s.s_k];
        double ms = -INFINITY;
        for (int j = 0; j < s.s_k; ++j)
          if (P[j] > 0) ms = std::fmax(ms, ref_lse + std::log(P[j]));
        if (ms == -INFINITY) {  // only the sink: out 0, lse the sink
          l_out = sink;
          continue;
        }
        const double m_ref = ms - (lag >= 0 ? lag : uniform_real(rng, 0.0, 8 * std::log(2.0)));
        double sum = std::isfinite(sink) ? std::exp(sink - m_ref) : 0.0;
        std::vector<double> acc(dv, 0.0);
        for (int j = 0; j < s.s_k; ++j) {
          if (!(P[j] > 0)) continue;
          const double pj = std::exp(ref_lse + std::log(P[j]) - m_ref);
          sum += pj;
          const double qj = round_p(pj);
          for (int c = 0; c < dv; ++c) acc[c] += qj * v_factor * s.v[(std::size_t(j) * p.h_k + g) * dv + c];
        }
        for (int c = 0; c < dv; ++c) out[(std::size_t(i) * p.h_q + h) * dv + c] = round_to(out_dtype, acc[c] / sum);
        l_out = static_cast<float>(m_ref + std::log(sum));
      }
    }
    r.out.insert(r.out.end(), out.begin(), out.end());
    r.lse.insert(r.lse.end(), lse.begin(), lse.end());
  }
  return r;
}

struct BoundCase {
  const char* name;
  int batch, s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  bool alibi, sink;
  char omit;
  DType out;
};

void PrintTo(const BoundCase& f, std::ostream* os) { *os << f.name; }

class Fp8PBoundTest : public ::testing::TestWithParam<BoundCase> {};

TEST_P(Fp8PBoundTest, HoldsForTheCpuForwardAndAKernelModel) {
  const BoundCase f = GetParam();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, {f.batch, f.s_q, f.s_k, f.h_q, f.h_k, f.d}, DType::kFloat32);
  const Fp8Inputs q8 = quantize_fp8_random_descales(c, rng, f.omit);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  if (f.alibi) c.set_alibi(random_alibi(rng, f.batch, f.h_q, true), true);
  if (f.sink) c.sink.set(random_sink(rng, f.h_q));
  c.sink.want_grad = false;
  c.out = HostTensor(f.out, {f.batch, f.s_q, f.h_q, f.d});
  c.poison_forward();
  Options opts = c.call_options();
  q8.apply(opts);
  ASSERT_NO_THROW(forward(q8.q.view(), q8.k.view(), q8.v.view(), c.out.view(), c.lse.view(), opts));

  const RefProblem p = c.problem();
  const std::vector<RefOutput> ref = reference_forward(p);
  const Fp8PBound bound = fp8_p_quantized_bound(p, ref, f.out);
  const std::vector<double> ref_out = concat_out(ref), ref_lse = concat_lse(ref);
  double cpu = 0, model = 0, model_lse = 0;
  const ForwardResults got = forward_results(c);
  EXPECT_TRUE(within_fp8_bound("CPU fp8 out", got.out, ref_out, bound.out, &cpu));
  EXPECT_TRUE(within_fp8_bound("CPU fp8 lse", got.lse, ref_lse, bound.lse));
  const ForwardResults m = model_kernel(p, ref, f.out, rng, round_e4m3);
  EXPECT_TRUE(within_fp8_bound("kernel model out", m.out, ref_out, bound.out, &model));
  EXPECT_TRUE(within_fp8_bound("kernel model lse", m.lse, ref_lse, bound.lse, &model_lse));
  std::printf("fp8 bound %s: max |err| / bound: CPU forward %.3f, P-quantizing model %.3f (lse %.3f)\n",
              f.name, cpu, model, model_lse);
  EXPECT_GT(model, cpu) << "the model rounds P: its error should exceed the CPU forward's";
}

constexpr DType kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16;

INSTANTIATE_TEST_SUITE_P(
    Features, Fp8PBoundTest,
    ::testing::Values(
        BoundCase{"plain", 2, 77, 300, 4, 4, 128, false, -1, -1, 0.f, false, false, 0, kBf16},
        BoundCase{"causal_gqa_d256", 1, 300, 300, 4, 2, 256, true, -1, -1, 0.f, false, false, 0, kBf16},
        BoundCase{"causal_sq_gt_sk_mqa", 2, 300, 77, 4, 1, 128, true, -1, -1, 0.f, false, false, 0, kBf16},
        BoundCase{"window", 1, 1000, 1000, 2, 1, 128, false, 100, 17, 0.f, false, false, 0, kBf16},
        BoundCase{"decode", 3, 1, 1000, 8, 2, 128, false, -1, -1, 0.f, false, false, 0, kBf16},
        BoundCase{"softcap_fp16", 1, 77, 1000, 2, 2, 256, false, -1, -1, 30.f, false, false, 0, kFp16},
        BoundCase{"alibi_sink_causal", 2, 300, 300, 4, 2, 128, true, -1, -1, 0.f, true, true, 0, kBf16},
        BoundCase{"omit_k_descale", 2, 77, 300, 4, 2, 128, false, -1, -1, 0.f, false, false, 'k', kBf16},
        BoundCase{"one_key", 2, 1, 1, 2, 1, 128, false, -1, -1, 0.f, false, true, 'v', kBf16}),
    [](const auto& info) { return std::string(info.param.name); });

// One query over 64 keys with equal scores and v = 1: every P' equals exp(lag). At P' just
// below 1 + 2^-4 (the midpoint of e4m3's 1 and 1.125) e4m3 rounding loses 2^-4 / (1 +
// 2^-4) of out: the model reaches most of the bound there; P rounded to two mantissa bits
// at P' just below 1.125 loses twice as much and fails it, as does a v descale off by 2.
TEST(Fp8PBound, IsTightAndCanFail) {
  RefProblem p;
  p.h_q = p.h_k = 1;
  p.d = p.d_v = 1;
  p.scale = 1.0;
  RefSeq s;
  s.s_q = 1;
  s.s_k = 64;
  s.q = {1.0};
  s.k.assign(64, 1.0);
  s.v.assign(64, 1.0);
  p.seqs.push_back(s);
  const std::vector<RefOutput> ref = reference_forward(p);
  const Fp8PBound bound = fp8_p_quantized_bound(p, ref, DType::kBFloat16);
  const std::vector<double> ref_out = concat_out(ref);
  Rng rng(1);
  double frac = 0;
  const ForwardResults worst = model_kernel(p, ref, DType::kBFloat16, rng, round_e4m3, std::log(1.0624));
  EXPECT_TRUE(within_fp8_bound("e4m3 at P' = 1.0624", worst.out, ref_out, bound.out, &frac));
  EXPECT_GT(frac, 0.75) << "the bound should be tight on its worst case";
  const ForwardResults coarse = model_kernel(p, ref, DType::kBFloat16, rng, round_2_bits, std::log(1.124));
  EXPECT_FALSE(within_fp8_bound("2-bit P at P' = 1.124", coarse.out, ref_out, bound.out, &frac));
  EXPECT_GT(frac, 1.3);
  const ForwardResults wrong_v = model_kernel(p, ref, DType::kBFloat16, rng, round_e4m3, 0.0, 2.0);
  EXPECT_FALSE(within_fp8_bound("v descale x2", wrong_v.out, ref_out, bound.out));
}

TEST(Fp8PBound, RowsThatSeeNoKeyMustBeExact) {
  // causal with s_q > s_k: the first rows see nothing: out 0 and lse -inf exactly.
  RefProblem p;
  p.h_q = p.h_k = 1;
  p.d = p.d_v = 2;
  p.scale = 1.0;
  p.mask = semantics::Mask::make(true, -1, -1);
  RefSeq s;
  s.s_q = 3;
  s.s_k = 1;
  s.q = {1, 0, 0, 1, 1, 1};
  s.k = {1, 1};
  s.v = {2, -3};
  p.seqs.push_back(s);
  const std::vector<RefOutput> ref = reference_forward(p);
  const Fp8PBound bound = fp8_p_quantized_bound(p, ref, DType::kBFloat16);
  std::vector<double> out = concat_out(ref), lse = concat_lse(ref);
  ASSERT_EQ(lse[0], -INFINITY);
  EXPECT_TRUE(within_fp8_bound("exact", out, concat_out(ref), bound.out));
  out[0] = 1e-30;  // row 0 sees no key: anything but 0 fails
  EXPECT_FALSE(within_fp8_bound("row 0 not 0", out, concat_out(ref), bound.out));
  lse[0] = -1e30;
  EXPECT_FALSE(within_fp8_bound("lse not -inf", lse, concat_lse(ref), bound.lse));
}

}  // namespace
}  // namespace flashattn::test
