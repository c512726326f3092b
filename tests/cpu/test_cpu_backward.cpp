// CPU backend, dense backward: every feature against the fp64 oracle (dk/dv summed
// over GQA groups), finite differences of the public forward on tiny fp64 problems,
// zero gradients of empty rows, determinism across thread counts (dense; a bf16 varlen
// pack on the worker pool), caller workspace.
#include <cmath>
#include <string>
#include <utility>
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

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

// Forward then backward on poisoned outputs, both checked against the oracle.
void check_backward(DenseCase& c) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
}

struct Feature {
  const char* name;
  int s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  int alibi;  // 0 off, 1 [h_q], 2 [b, h_q]
  float dropout;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

class CpuBackwardFeature : public ::testing::TestWithParam<Feature> {};

TEST_P(CpuBackwardFeature, MatchesOracleInEveryDtype) {
  const Feature& f = GetParam();
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, f.s_q, f.s_k, f.h_q, f.h_k, f.d), dtype);
    c.opts.causal = f.causal;
    c.opts.window_left = f.left;
    c.opts.window_right = f.right;
    c.opts.softcap = f.softcap;
    if (f.alibi) c.set_alibi(random_alibi(rng, 2, f.h_q, f.alibi == 2), f.alibi == 2);
    c.opts.dropout_p = f.dropout;
    c.opts.seed = rng();
    c.opts.offset = rng();
    check_backward(c);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, CpuBackwardFeature,
    ::testing::Values(Feature{"plain", 23, 31, 2, 2, 16, false, -1, -1, 0, 0, 0},
                      Feature{"gqa2", 17, 29, 4, 2, 16, false, -1, -1, 0, 0, 0},
                      Feature{"gqa4", 17, 29, 8, 2, 8, true, -1, -1, 0, 0, 0},
                      Feature{"gqa8", 19, 19, 8, 1, 8, false, -1, -1, 0, 0, 0},
                      Feature{"mqa", 13, 37, 4, 1, 12, false, -1, -1, 0, 0, 0},
                      Feature{"causal", 33, 33, 2, 1, 16, true, -1, -1, 0, 0, 0},
                      Feature{"causal_sq_gt_sk", 40, 15, 2, 1, 16, true, -1, -1, 0, 0, 0},
                      Feature{"causal_sq_lt_sk", 15, 40, 2, 1, 16, true, -1, -1, 0, 0, 0},
                      Feature{"window_left", 30, 30, 2, 2, 8, false, 6, -1, 0, 0, 0},
                      Feature{"window_right", 30, 30, 2, 2, 8, false, -1, 4, 0, 0, 0},
                      Feature{"window_both", 25, 35, 2, 2, 8, false, 5, 3, 0, 0, 0},
                      Feature{"window_zero", 20, 20, 2, 2, 8, false, 0, 0, 0, 0, 0},
                      Feature{"causal_window", 35, 25, 4, 2, 8, true, 7, -1, 0, 0, 0},
                      Feature{"softcap", 21, 27, 2, 1, 16, false, -1, -1, 2.5f, 0, 0},
                      Feature{"alibi", 21, 27, 4, 2, 16, true, -1, -1, 0, 1, 0},
                      Feature{"alibi_batch", 21, 27, 4, 2, 16, false, 9, 9, 0, 2, 0},
                      Feature{"dropout", 37, 41, 2, 1, 16, false, -1, -1, 0, 0, 0.25f},
                      Feature{"dropout_causal_gqa", 37, 30, 4, 2, 16, true, -1, -1, 0, 0, 0.4f},
                      Feature{"everything", 29, 34, 8, 2, 12, true, 11, -1, 4.0f, 2, 0.2f}),
    [](const ::testing::TestParamInfo<Feature>& i) { return std::string(i.param.name); });

TEST(CpuBackward, HeadDims) {
  FA_SEEDED_RNG(rng);
  for (int d : {1, 3, 17, 64, 80, 256}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      DenseCase c = DenseCase::random(rng, shape_of(1, 19, 26, 2, 1, d), dtype);
      c.opts.causal = true;
      check_backward(c);
    }
  }
}

TEST(CpuBackward, OddLengths) {
  FA_SEEDED_RNG(rng);
  for (int s : {1, 17, 113}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, s, s, 2, 1, 8), DType::kFloat16);
    c.opts.causal = s != 17;
    check_backward(c);
  }
  DenseCase c = DenseCase::random(rng, shape_of(1, 1000, 1000, 1, 1, 4), DType::kFloat32);
  c.opts.causal = true;
  c.opts.window_left = 300;
  check_backward(c);
}

TEST(CpuBackward, SeqlenZeroAndOne) {
  FA_SEEDED_RNG(rng);
  DenseCase no_keys = DenseCase::random(rng, shape_of(2, 4, 0, 2, 1, 8), DType::kFloat32);
  check_backward(no_keys);
  DenseCase no_queries = DenseCase::random(rng, shape_of(2, 0, 4, 2, 1, 8), DType::kFloat32);
  no_queries.poison_forward();
  ASSERT_NO_THROW(no_queries.run_forward());
  no_queries.poison_backward();
  ASSERT_NO_THROW(no_queries.run_backward());
  for (const HostTensor* g : {&no_queries.dk, &no_queries.dv})
    for (std::int64_t e = 0; e < g->numel(); ++e) ASSERT_EQ(g->get(e), 0.0) << "dk/dv with no queries";
  DenseCase one = DenseCase::random(rng, shape_of(1, 1, 1, 1, 1, 8), DType::kFloat64);
  check_backward(one);
}

TEST(CpuBackward, BatchOf2000TinySequences) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2000, 3, 2, 2, 1, 4), DType::kFloat32);
  c.opts.causal = true;
  check_backward(c);
}

// Rows that see nothing have zero gradients; nothing is NaN even with extreme logits.
TEST(CpuBackward, FullyMaskedRowsAndExtremeLogits) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(1, 30, 12, 2, 1, 16), dtype);
    for (std::int64_t e = 0; e < c.q.numel(); ++e) c.q.set(e, 25.0 + c.q.get(e));
    for (std::int64_t e = 0; e < c.k.numel(); ++e) c.k.set(e, -25.0 - c.k.get(e));
    c.opts.causal = true;
    c.poison_forward();
    ASSERT_NO_THROW(c.run_forward());
    c.poison_backward();
    ASSERT_NO_THROW(c.run_backward());
    EXPECT_TRUE(all_finite("out", c.out.to_double()));
    EXPECT_TRUE(all_finite("dq", c.dq.to_double()));
    EXPECT_TRUE(all_finite("dk", c.dk.to_double()));
    EXPECT_TRUE(all_finite("dv", c.dv.to_double()));
    for (int i = 0; i < 18; ++i)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 16; ++e) ASSERT_EQ(c.dq.at({0, i, h, e}), 0.0) << "row " << i;
  }
}

// Central finite differences of the public forward (fp64) against the public backward.
struct FdCase {
  const char* name;
  int s_q, s_k, h_q, h_k, d;
  bool causal;
  int left;
  float softcap;
  bool alibi;
  float dropout;
};

void PrintTo(const FdCase& f, std::ostream* os) { *os << f.name; }

class CpuBackwardFiniteDifferences : public ::testing::TestWithParam<FdCase> {};

TEST_P(CpuBackwardFiniteDifferences, Fp64) {
  const FdCase& f = GetParam();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, f.s_q, f.s_k, f.h_q, f.h_k, f.d), DType::kFloat64);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.softcap = f.softcap;
  c.opts.softmax_scale = 0.4f;
  if (f.alibi) c.set_alibi(random_alibi(rng, 2, f.h_q, true), true);
  c.opts.dropout_p = f.dropout;
  c.opts.seed = rng();
  SCOPED_TRACE(describe(c.call_options()));
  expect_gradients_match_central_differences(c);
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuBackwardFiniteDifferences,
                         ::testing::Values(FdCase{"plain", 4, 5, 2, 2, 3, false, -1, 0, false, 0},
                                           FdCase{"gqa", 5, 4, 4, 1, 3, false, -1, 0, false, 0},
                                           FdCase{"causal_window", 6, 4, 2, 1, 3, true, 2, 0, false, 0},
                                           FdCase{"softcap", 4, 6, 2, 1, 5, false, -1, 1.5f, false, 0},
                                           FdCase{"alibi", 4, 6, 2, 2, 3, true, -1, 0, true, 0},
                                           FdCase{"dropout", 9, 10, 2, 1, 3, false, -1, 0, false, 0.3f},
                                           FdCase{"everything", 9, 7, 4, 2, 3, true, 4, 2.0f, true, 0.25f}),
                         [](const ::testing::TestParamInfo<FdCase>& i) { return std::string(i.param.name); });

// deterministic = true: bit-identical gradients for 1, 2 and 3 threads and across runs.
TEST(CpuBackward, DeterministicAcrossThreadCounts) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 113, 97, 8, 2, 16), dtype);
    c.opts.causal = true;
    c.opts.dropout_p = 0.1f;
    c.opts.seed = rng();
    c.opts.deterministic = true;
    c.run_forward();
    std::vector<double> dq0, dk0, dv0;
    for (int threads : {1, 2, 3, 1, 2, 3}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      c.opts.num_threads = threads;
      c.poison_backward();
      ASSERT_NO_THROW(c.run_backward());
      if (dq0.empty()) {
        dq0 = c.dq.to_double();
        dk0 = c.dk.to_double();
        dv0 = c.dv.to_double();
        expect_backward_matches(c.problem(), dtype, forward_results(c), backward_results(c));
        continue;
      }
      EXPECT_TRUE(bitwise_equal("dq", c.dq.to_double(), dq0));
      EXPECT_TRUE(bitwise_equal("dk", c.dk.to_double(), dk0));
      EXPECT_TRUE(bitwise_equal("dv", c.dv.to_double(), dv0));
    }
  }
}

// The worker pool (cpu/pool.hpp) runs the backward's key and query tasks from one queue:
// bit-identical gradients for 1 .. 8 threads and the default (0), on a bf16 varlen pack
// (the avx512bf16 path where the CPU has it) with GQA, seqused_q, an empty sequence and
// odd lengths; and on a problem of one key task and one query task, fewer than the threads.
TEST(CpuBackward, VarlenIdenticalAcrossThreadCountsOnTheWorkerPool) {
  FA_SEEDED_RNG(rng);
  auto offsets = [](const std::vector<int>& lengths) {
    std::vector<int> cu{0};
    for (int l : lengths) cu.push_back(cu.back() + l);
    return cu;
  };
  for (bool tiny : {false, true}) {
    SCOPED_TRACE(tiny ? "tiny" : "pack");
    VarlenCase c = tiny ? VarlenCase::make(rng, {0, 5}, {0, 7}, 1, 1, 24, DType::kBFloat16)
                        : VarlenCase::make(rng, offsets({70, 0, 131, 13}),
                                           offsets({45, 9, 200, 66}), 6, 2, 40, DType::kBFloat16, 3, 2);
    if (!tiny) c.set_seqused_q({61, 0, 131, 5});
    c.opts.causal = !tiny;
    c.run_forward();
    std::vector<double> dq0, dk0, dv0;
    for (int threads : {1, 2, 3, 8, 0, 2, 1}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      c.opts.num_threads = threads;
      c.poison_backward();
      ASSERT_NO_THROW(c.run_backward());
      std::vector<double> dq = c.dq_concat(), dk = c.dk_concat(), dv = c.dv_concat();
      const std::vector<double> dq_unused = c.q_unused_rows(c.dq), dkv_unused = c.dkv_unused_rows();
      EXPECT_TRUE(bitwise_equal("dq rows past seqused_q", dq_unused,
                                std::vector<double>(dq_unused.size(), 0.0)));
      EXPECT_TRUE(bitwise_equal("dk / dv rows past seqused_k", dkv_unused,
                                std::vector<double>(dkv_unused.size(), 0.0)));
      if (dq0.empty()) {
        expect_backward_matches(c.problem(), c.dtype, forward_results(c), backward_results(c));
        dq0 = std::move(dq);
        dk0 = std::move(dk);
        dv0 = std::move(dv);
        continue;
      }
      EXPECT_TRUE(bitwise_equal("dq", dq, dq0));
      EXPECT_TRUE(bitwise_equal("dk", dk, dk0));
      EXPECT_TRUE(bitwise_equal("dv", dv, dv0));
    }
  }
}

// A caller workspace of backward_workspace_size bytes gives the same gradients.
TEST(CpuBackward, CallerWorkspace) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 45, 60, 4, 1, 16), DType::kBFloat16);
  c.opts.deterministic = true;
  c.opts.window_left = 10;
  c.opts.window_right = 10;
  c.run_forward();
  c.poison_backward();
  c.run_backward();
  const std::vector<double> dq0 = c.dq.to_double(), dk0 = c.dk.to_double(), dv0 = c.dv.to_double();
  const Options o = c.call_options();
  const std::size_t bytes = backward_workspace_size(c.q.view(), c.k.view(), c.v.view(), o);
  std::vector<std::uint64_t> ws(bytes / 8 + 1);
  c.poison_backward();
  backward(c.dout.view(), c.q.view(), c.k.view(), c.v.view(), c.out.view(), c.lse.view(), c.dq.view(),
           c.dk.view(), c.dv.view(), o, Workspace{ws.data(), bytes});
  EXPECT_TRUE(bitwise_equal("dq", c.dq.to_double(), dq0));
  EXPECT_TRUE(bitwise_equal("dk", c.dk.to_double(), dk0));
  EXPECT_TRUE(bitwise_equal("dv", c.dv.to_double(), dv0));
}

}  // namespace
}  // namespace flashattn::test
