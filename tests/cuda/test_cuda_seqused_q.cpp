// CUDA varlen seqused_q (issue 22) on every kernel family this GPU runs: of sequence b's
// query slots only the first seqused_q[b] are computed, with s_q = seqused_q[b] in the
// visibility rule; the rows past them get out 0, lse -inf and dq 0, and are not read (their
// q and dout hold NaN here, so a kernel that multiplies them by a masked 0 shows it).
// Forward and backward against the fp64 oracle under the suite's tolerance rule, outputs
// poisoned, fp16 and bf16, plain / causal / causal + window + seqused_k / softcap + GQA,
// lengths that end inside a tile, empty sequences and sequences with no used rows.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

std::size_t count_not(const std::vector<double>& xs, double want) {
  std::size_t n = 0;
  for (double x : xs) n += !(x == want);
  return n;
}

TEST(CudaSequsedQ, ForwardAndBackwardMatchOracle) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  // Query lengths 70, 0, 133, 1, 200, 64 against keys 90, 40, 0, 150, 201, 64.
  const std::vector<int> lq = {70, 0, 133, 1, 200, 64}, lk = {90, 40, 0, 150, 201, 64};
  for (KernelFamily family : gpu_families()) {
    for (int d : built_head_dims({64, 128})) {
      for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
        for (int mode = 0; mode < 4; ++mode) {
          const int h_k = mode == 3 ? 1 : 2;
          VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 4, h_k, d, dtype, 5, 7);
          // Used: part of a tile, none, a whole tile's worth, all, a row past a tile edge.
          c.set_seqused_q({uniform_int(rng, 1, 69), 0, 129, 0, uniform_int(rng, 65, 199), 64});
          c.opts.causal = mode >= 1;
          if (mode == 2) {
            c.opts.window_left = 37;
            c.set_seqused_k({77, 40, 0, 150, 190, 33});
          }
          if (mode == 3) c.opts.softcap = 4.0f;
          SCOPED_TRACE(std::string(family_str(family)) + " d=" + std::to_string(d) + " " +
                       dtype_name(dtype) + " h_k=" + std::to_string(h_k) + " " + describe(c.call_options()));
          c.poison_unused_q_rows();
          cuda_varlen_forward(c, family);
          const RefProblem p = c.problem();
          const ForwardResults fwd = forward_results(c);
          expect_forward_matches(p, dtype, fwd);
          EXPECT_EQ(count_not(c.q_unused_rows(c.out), 0.0), 0u) << "out of rows past seqused_q not 0";
          EXPECT_EQ(count_not(c.lse_unused_rows(), -INFINITY), 0u) << "lse of rows past seqused_q not -inf";
          cuda_varlen_backward(c, family);
          expect_backward_written_and_matching(c, p, dtype, fwd, false);
          EXPECT_EQ(count_not(c.q_unused_rows(c.dq), 0.0), 0u) << "dq of rows past seqused_q not 0";
          if (!c.seqused_k.empty()) EXPECT_EQ(count_not(c.dkv_unused_rows(), 0.0), 0u) << "dk / dv beyond seqused_k";
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashattn::test
