// Seeded random grids (issue 25, coverage) for the CUDA backward and for varlen: shapes,
// odd lengths (1, < 16, up to 300), GQA ratios, masks, windows, softcap, ALiBi ([h_q] and
// [b, h_q]), dropout, fp16 / bf16, deterministic mode, and for varlen empty sequences,
// padding rows and seqused_k. Each case is checked against the fp64 oracle by the suite's
// tolerance rule (support/checks.hpp), with outputs poisoned before the call and checked
// fully written; the forward grids run on every kernel family of this GPU. The seed is
// printed on failure (FLASHATTN_TEST_SEED reruns it).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

int pick(Rng& rng, const std::vector<int>& v) { return v[std::size_t(uniform_int(rng, 0, int(v.size()) - 1))]; }

// Buckets and dims between them (run in the next bucket up, zero-filled).
std::vector<int> grid_head_dims() { return built_head_dims({32, 40, 64, 72, 96, 128, 136, 160, 192, 224, 256}); }

// Random mask and score features on opts (and ALiBi on the case through set_alibi).
template <class Case>
void random_features(Rng& rng, Case& c, int batch, int h_q) {
  c.opts.causal = coin(rng);
  if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 120);
  if (!c.opts.causal && coin(rng, 0.3)) c.opts.window_right = uniform_int(rng, 0, 120);
  if (coin(rng, 0.25)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 20.0));
  if (coin(rng, 0.25)) {
    const bool per_batch = coin(rng);
    c.set_alibi(random_alibi(rng, batch, h_q, per_batch), per_batch);
  }
  if (coin(rng, 0.3)) {
    c.opts.dropout_p = static_cast<float>(uniform_real(rng, 0.05, 0.6));
    c.opts.seed = rng();
    c.opts.offset = rng();
  }
  c.opts.deterministic = coin(rng, 0.3);
}

TEST(CudaBackward, RandomGrid) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  ShapeLimits limits;
  limits.max_seqlen = 300;
  limits.head_dims = grid_head_dims();
  for (int trial = 0; trial < 32; ++trial) {
    const Shape s = random_shape(rng, limits);
    const DType dtype = coin(rng) ? DType::kFloat16 : DType::kBFloat16;
    DenseCase c = DenseCase::random(rng, s, dtype);
    random_features(rng, c, s.batch, s.h_q);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + s.str() + " " + dtype_name(dtype) + " " +
                 describe(c.call_options()));
    if (backward_over_cap(std::max(s.d, s.dv()))) {  // a 99 KiB part: no backward above d = 160
      expect_backward_declined(std::max(s.d, s.dv()));
      continue;
    }
    ASSERT_NO_THROW(c.run_forward());  // CPU forward: the out / lse being differentiated
    const RefProblem p = c.problem();
    const ForwardResults fwd = forward_results(c);
    cuda_backward(c);
    expect_backward_written_and_matching(c, p, dtype, fwd);
  }
}

// A random varlen pack: 1 .. 5 sequences of 0 .. 300 queries and keys (s_k = s_q for about a
// third), padding rows after the last sequence, seqused_k for about a third.
VarlenCase random_varlen(Rng& rng) {
  const int batch = uniform_int(rng, 1, 5);
  const std::vector<int> cu_q = random_cu_seqlens(rng, batch, 300, true);
  const std::vector<int> cu_k = coin(rng, 0.3) ? cu_q : random_cu_seqlens(rng, batch, 300, true);
  const int ratio = pick(rng, {1, 2, 4, 8});
  const int h_k = uniform_int(rng, 1, std::max(1, 8 / ratio));
  const int d = pick(rng, grid_head_dims());
  const DType dtype = coin(rng) ? DType::kFloat16 : DType::kBFloat16;
  VarlenCase c = VarlenCase::make(rng, cu_q, cu_k, h_k * ratio, h_k, d, dtype, uniform_int(rng, 0, 9),
                                  uniform_int(rng, 0, 9));
  if (coin(rng, 0.35)) {
    std::vector<int> used;
    for (int b = 0; b < batch; ++b) used.push_back(uniform_int(rng, 0, c.len_k(b)));
    c.set_seqused_k(used);
  }
  random_features(rng, c, batch, c.h_q);
  return c;
}

std::string describe_varlen(const VarlenCase& c) {
  std::string s = "cu_q";
  for (int x : c.cu_q) s += " " + std::to_string(x);
  s += ", cu_k";
  for (int x : c.cu_k) s += " " + std::to_string(x);
  if (!c.seqused_k.empty()) {
    s += ", seqused_k";
    for (int x : c.seqused_k) s += " " + std::to_string(x);
  }
  return s + ", h " + std::to_string(c.h_q) + "/" + std::to_string(c.h_k) + " d " + std::to_string(c.d) + " " +
         dtype_name(c.dtype) + " " + describe(c.call_options());
}

TEST(CudaVarlen, RandomGridForwardEveryFamily) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (int trial = 0; trial < 24; ++trial) {
      VarlenCase c = random_varlen(rng);
      SCOPED_TRACE(std::string(family_str(family)) + " trial " + std::to_string(trial) + ": " + describe_varlen(c));
      cuda_varlen_forward(c, family);
      const ForwardResults got = forward_results(c);
      EXPECT_TRUE(fully_written("out", got.out));
      EXPECT_TRUE(fully_written("lse", got.lse));
      expect_forward_matches(c.problem(), c.dtype, got);
    }
  }
}

TEST(CudaVarlen, RandomGridBackward) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 24; ++trial) {
    VarlenCase c = random_varlen(rng);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + describe_varlen(c));
    if (backward_over_cap(c.d)) {  // a 99 KiB part: no backward above d = 160
      expect_backward_declined(c.d);
      continue;
    }
    ASSERT_NO_THROW(c.run_forward());  // CPU forward
    const RefProblem p = c.problem();
    const ForwardResults fwd = forward_results(c);
    cuda_varlen_backward(c);
    expect_backward_written_and_matching(c, p, c.dtype, fwd);
    for (double x : c.dkv_unused_rows()) ASSERT_EQ(x, 0.0) << "dk / dv beyond seqused_k";
  }
}

}  // namespace
}  // namespace flashattn::test
