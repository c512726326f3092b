// The CPU backward's two schedules (src/cpu/schedule.hpp): key groups (P and dS once a tile,
// five products) and two passes (seven products) give bit-identical gradients on every
// instruction-set path, dtype and feature, for any thread count; the gradients of the key
// groups (on poisoned outputs) match the fp64 oracle.
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/isa.hpp"
#include "cpu/schedule.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using detail::cpu::BwdSchedule;
using detail::cpu::Isa;

struct ScheduleScope {
  explicit ScheduleScope(BwdSchedule s) { detail::cpu::set_backward_schedule_override(s); }
  ~ScheduleScope() { detail::cpu::set_backward_schedule_override(std::nullopt); }
  ScheduleScope(const ScheduleScope&) = delete;
  ScheduleScope& operator=(const ScheduleScope&) = delete;
};

struct IsaScope {
  explicit IsaScope(Isa isa) { detail::cpu::set_isa_override(isa); }
  ~IsaScope() { detail::cpu::set_isa_override(std::nullopt); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512Bf16})
    if (detail::cpu::isa_supported(isa)) out.push_back(isa);
  return out;
}

struct Grads {
  std::vector<double> dq, dk, dv, dsink;
};

// Runs the backward of c under a schedule and thread count, on poisoned outputs.
template <class Case>
Grads run(Case& c, BwdSchedule schedule, int threads) {
  ScheduleScope scope(schedule);
  c.opts.num_threads = threads;
  c.poison_backward();
  c.sink.poison_grad();
  c.run_backward();
  if constexpr (std::is_same_v<Case, DenseCase>)
    return {c.dq.to_double(), c.dk.to_double(), c.dv.to_double(), c.sink.grad_values()};
  else
    return {c.dq_concat(), c.dk_concat(), c.dv_concat(), c.sink.grad_values()};
}

void expect_same(const Grads& a, const Grads& b) {
  EXPECT_TRUE(bitwise_equal("dq", a.dq, b.dq));
  EXPECT_TRUE(bitwise_equal("dk", a.dk, b.dk));
  EXPECT_TRUE(bitwise_equal("dv", a.dv, b.dv));
  EXPECT_TRUE(bitwise_equal("dsink", a.dsink, b.dsink));
}

// Key groups checked against the oracle, then both schedules on 1, 2 and 3 threads against it bitwise.
template <class Case>
void check_schedules(Case& c) {
  c.run_forward();
  const Grads ref = run(c, BwdSchedule::kKeyGroups, 1);
  expect_backward_matches(c.problem(), c.dtype, forward_results(c), backward_results(c));
  for (BwdSchedule s : {BwdSchedule::kTwoPasses, BwdSchedule::kKeyGroups})
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(std::string(s == BwdSchedule::kKeyGroups ? "key groups" : "two passes") +
                   ", threads " + std::to_string(threads));
      expect_same(run(c, s, threads), ref);
    }
}

struct Feature {
  const char* name;
  int b, s_q, s_k, h_q, h_k, d, d_v;
  bool causal;
  int left, right;
  float softcap;
  bool alibi;
  float dropout;
  bool sink;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

class CpuBwdSchedule : public ::testing::TestWithParam<Feature> {};

TEST_P(CpuBwdSchedule, BitIdenticalOnEveryPathAndDtype) {
  const Feature& f = GetParam();
  FA_SEEDED_RNG(rng);
  for (Isa isa : supported_isas()) {
    IsaScope isa_scope(isa);
    for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
      DenseCase c = DenseCase::random(rng, Shape{f.b, f.s_q, f.s_k, f.h_q, f.h_k, f.d, f.d_v}, dtype);
      c.opts.causal = f.causal;
      c.opts.window_left = f.left;
      c.opts.window_right = f.right;
      c.opts.softcap = f.softcap;
      if (f.alibi) c.set_alibi(random_alibi(rng, f.b, f.h_q, false), false);
      c.opts.dropout_p = f.dropout;
      c.opts.seed = rng();
      if (f.sink) c.sink.set(random_sink(rng, f.h_q));
      SCOPED_TRACE(std::string(detail::cpu::isa_name(isa)) + " " + c.shape.str() + " " +
                   dtype_name(dtype) + " " + describe(c.call_options()));
      check_schedules(c);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, CpuBwdSchedule,
    // Several key and query blocks (64), odd lengths and head dims.
    ::testing::Values(Feature{"plain", 2, 150, 131, 2, 2, 40, 0, false, -1, -1, 0, false, 0, false},
                      Feature{"gqa_causal", 1, 141, 150, 4, 1, 24, 0, true, -1, -1, 0, false, 0, false},
                      Feature{"causal_sq_gt_sk", 2, 160, 70, 2, 1, 17, 0, true, -1, -1, 0, false, 0, false},
                      Feature{"window_dv", 1, 129, 193, 2, 2, 32, 48, false, 40, 9, 0, false, 0, false},
                      Feature{"everything", 2, 97, 130, 6, 2, 33, 0, true, 70, -1, 3.0f, true, 0.2f, true}),
    [](const ::testing::TestParamInfo<Feature>& i) { return std::string(i.param.name); });

// A varlen pack with GQA, seqused_q, an empty sequence and sequences of several blocks.
TEST(CpuBwdScheduleVarlen, BitIdentical) {
  FA_SEEDED_RNG(rng);
  for (Isa isa : supported_isas()) {
    IsaScope isa_scope(isa);
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      SCOPED_TRACE(std::string(detail::cpu::isa_name(isa)) + " " + dtype_name(dtype));
      VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 271, 284}, {0, 45, 54, 254, 320}, 6, 2, 40, dtype, 3, 2);
      c.set_seqused_q({61, 0, 131, 5});
      c.opts.causal = true;
      check_schedules(c);
    }
  }
}

}  // namespace
}  // namespace flashattn::test
