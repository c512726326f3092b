// CPU backend, variable-length packing: empty query and/or key sequences, seqused_k,
// padding rows, masks and score features per sequence, dropout positions within a
// sequence, GQA gradients, and 2000 tiny sequences; all against the oracle.
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

void check_varlen(VarlenCase& c, bool with_backward) {
  SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " h_q=" + std::to_string(c.h_q) + " h_k=" +
               std::to_string(c.h_k) + " d=" + std::to_string(c.d) + " batch=" + std::to_string(c.batch()) +
               " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  if (!with_backward) return;
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
  if (!c.seqused_k.empty()) {
    const std::vector<double> unused = c.dkv_unused_rows();
    for (std::size_t e = 0; e < unused.size(); ++e)
      ASSERT_EQ(unused[e], 0.0) << "dk/dv of a key beyond seqused_k not 0 (element " << e << ")";
  }
}

TEST(CpuVarlen, EmptySequences) {
  FA_SEEDED_RNG(rng);
  // q lengths / k lengths: empty q, empty k, both empty, normal, length 1.
  const std::vector<int> lq = {0, 5, 0, 17, 1, 30, 9};
  const std::vector<int> lk = {7, 0, 0, 23, 1, 12, 9};
  for (DType dtype : kAllDtypes) {
    for (bool causal : {false, true}) {
      VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 4, 2, 8, dtype, 3, 2);
      c.opts.causal = causal;
      check_varlen(c, true);
    }
  }
}

TEST(CpuVarlen, AllSequencesEmpty) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, offsets({0, 0, 3}), offsets({0, 4, 0}), 2, 1, 8, DType::kFloat32);
  check_varlen(c, true);
}

TEST(CpuVarlen, SequsedK) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {6, 19, 1, 0, 12};
  const std::vector<int> lk = {10, 25, 8, 5, 12};
  const std::vector<int> used = {10, 13, 0, 2, 7};
  for (DType dtype : kAllDtypes) {
    for (bool causal : {false, true}) {
      VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 2, 1, 16, dtype);
      c.set_seqused_k(used);
      c.opts.causal = causal;
      check_varlen(c, true);
    }
  }
}

TEST(CpuVarlen, MasksAndScoreFeatures) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 12; ++trial) {
    const int batch = uniform_int(rng, 1, 6);
    const DType dtype = kAllDtypes[uniform_int(rng, 0, 3)];
    const int ratio = 1 << uniform_int(rng, 0, 3);
    const int h_k = uniform_int(rng, 1, 2);
    VarlenCase c = VarlenCase::make(rng, random_cu_seqlens(rng, batch, 40, true),
                                    random_cu_seqlens(rng, batch, 40, true), h_k * ratio, h_k,
                                    uniform_int(rng, 1, 40), dtype, uniform_int(rng, 0, 3), uniform_int(rng, 0, 3));
    c.opts.causal = coin(rng);
    if (coin(rng, 0.4)) c.opts.window_left = uniform_int(rng, 0, 15);
    if (coin(rng, 0.4)) c.opts.window_right = uniform_int(rng, 0, 15);
    if (coin(rng, 0.3)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 8.0));
    if (coin(rng, 0.4)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, batch, c.h_q, per_batch), per_batch);
    }
    if (coin(rng, 0.3)) {
      std::vector<int> used;
      for (int b = 0; b < batch; ++b) used.push_back(uniform_int(rng, 0, c.len_k(b)));
      c.set_seqused_k(used);
    }
    check_varlen(c, true);
  }
}

// Dropout positions are within each sequence and bh = sequence * h_q + head.
TEST(CpuVarlen, DropoutProbsAndGradients) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat64}) {
    VarlenCase c = VarlenCase::make(rng, offsets({21, 0, 34, 9}), offsets({30, 6, 17, 9}), 4, 2, 8, dtype, 2, 0);
    c.opts.dropout_p = 0.35f;
    c.opts.seed = rng();
    c.opts.offset = rng();
    c.opts.causal = true;
    c.want_probs();
    check_varlen(c, true);
    const RefProblem p = c.problem();
    std::int64_t wrong = 0;
    for (int b = 0; b < c.batch(); ++b)
      for (int h = 0; h < c.h_q; ++h)
        for (int i = 0; i < c.len_q(b); ++i)
          for (int j = 0; j < c.used_k(b); ++j) {
            if (!semantics::key_visible(i, j, c.len_q(b), c.used_k(b), p.mask)) continue;
            const bool kept = c.probs.at({h, c.cu_q[b] + i, j}) != 0.0;
            wrong += kept != p.keep(b, h, i, j);
          }
    EXPECT_EQ(wrong, 0) << "varlen probs disagree with the oracle's keep mask";
  }
}

TEST(CpuVarlen, OddLengthsLongSequence) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, offsets({1, 17, 113, 1000}), offsets({1000, 113, 17, 1}), 1, 1, 4,
                                  DType::kFloat32);
  c.opts.causal = true;
  check_varlen(c, true);
}

TEST(CpuVarlen, Batch2000TinySequences) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, random_cu_seqlens(rng, 2000, 3, true), random_cu_seqlens(rng, 2000, 3, true),
                                  2, 1, 4, DType::kFloat32);
  c.opts.causal = true;
  check_varlen(c, true);
}

TEST(CpuVarlen, DeterministicBackwardAcrossThreadCounts) {
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, offsets({40, 3, 77}), offsets({50, 61, 12}), 8, 2, 16, DType::kFloat32);
  c.opts.deterministic = true;
  c.opts.causal = true;
  c.run_forward();
  std::vector<double> dq0, dk0, dv0;
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    c.opts.num_threads = threads;
    c.poison_backward();
    ASSERT_NO_THROW(c.run_backward());
    if (threads == 1) {
      dq0 = c.dq_concat();
      dk0 = c.dk_concat();
      dv0 = c.dv_concat();
      continue;
    }
    EXPECT_TRUE(bitwise_equal("dq", c.dq_concat(), dq0));
    EXPECT_TRUE(bitwise_equal("dk", c.dk_concat(), dk0));
    EXPECT_TRUE(bitwise_equal("dv", c.dv_concat(), dv0));
  }
}

}  // namespace
}  // namespace flashattn::test
