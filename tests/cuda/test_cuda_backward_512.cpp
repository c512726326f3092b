// CUDA backward at head dims above 256 (issue 22): d and d_v in 264 .. 512 run in the sm80
// family's 512 bucket (bwd_config.cuh, kWide; the sm90 family declines them and the call
// runs sm80), against the fp64 oracle under the suite's tolerance rule, gradients poisoned
// before every call and checked fully written. The forward being differentiated is the CPU
// backend's (the backward alone), except in EndToEnd. Each case runs fp16 and bf16 at the
// device's shared-memory limit (on H100 / H200 the 64-row sm90 tile) and under a 163 KiB cap
// (A100's limit: the 32-row tile, whose query tiles are half a dq workspace tile): d = d_v =
// 512, (512, 256), (320, 512), (264, 392), (192, 512), (512, 64), causal (s_q below and above
// s_k), sliding windows, GQA / MQA, softcap, ALiBi, dropout, learnable sinks with their
// gradient, odd lengths; varlen with empty sequences, seqused_k and seqused_q; deterministic
// mode (bit-identical reruns, windows that start key tiles after key 0, odd 32-row tiles);
// what the bucket declines (block-sparse masks, 99 KiB of shared memory) is an Unsupported
// error naming the argument with nothing written. Skipped where the build has no 512 bucket
// (FLASHATTN_HEAD_DIMS).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_mask.hpp"
#include "cuda/dense_features.hpp"
#include "cuda/device_runs.hpp"
#include "cuda/sm80/family.hpp"
#include "flashattn/error.hpp"
#include "support/block_mask.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using ::testing::HasSubstr;

bool built_512() { return detail::cuda::supports_wide_head_dim(512); }

// A100's opt-in shared memory per block: under this cap every GPU runs the 512 bucket's
// sm80-sized (32-row) tile.
constexpr int kSm80Cap = 163 * 1024;

// The shared-memory caps a case runs under: the device's limit (or FLASHATTN_SMEM_CAP) and,
// where that is above it, A100's.
std::vector<int> caps() {
  std::vector<int> c{0};
  if (env_smem_cap() == 0 || env_smem_cap() > kSm80Cap) c.push_back(kSm80Cap);
  return c;
}
// The dtypes a case runs under a cap: both at the device's limit, bf16 alone under A100's
// (the tiles share their MMA code per dtype; the fp64 oracle is most of a case's time).
std::vector<DType> dtypes(int cap) {
  if (cap == 0) return {DType::kFloat16, DType::kBFloat16};
  return {DType::kBFloat16};
}

std::string cap_str(int cap) { return cap == 0 ? "device smem limit" : "smem_cap " + std::to_string(cap); }

// Device copies of a case's ALiBi slopes and learnable sink (with its poisoned gradient).
struct DeviceExtras {
  std::unique_ptr<DeviceCopy> alibi, sink, sink_grad;
  void attach(const std::vector<float>& slopes, const HostTensor& alibi_t, const SinkInputs& s, Options& o) {
    o.alibi_slopes = Tensor{};
    o.learnable_sink = Tensor{};
    o.learnable_sink_grad = Tensor{};
    if (!slopes.empty()) {
      alibi = std::make_unique<DeviceCopy>(alibi_t);
      o.alibi_slopes = alibi->view();
    }
    if (!s.logits.empty()) {
      sink = std::make_unique<DeviceCopy>(s.tensor);
      o.learnable_sink = sink->view();
      if (s.want_grad) {
        HostTensor poisoned = s.grad;
        poisoned.fill_nan();
        sink_grad = std::make_unique<DeviceCopy>(poisoned);
        o.learnable_sink_grad = sink_grad->view();
      }
    }
  }
  void download(SinkInputs& s) const {
    if (sink_grad) sink_grad->download(s.grad);
  }
};

// The CUDA backward of c's out / lse as they are; dq, dk, dv (and d sink) poisoned first,
// downloaded into c.
void run_backward(DenseCase& c, int smem_cap) {
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  Options o = c.call_options();
  o.smem_cap = smem_cap;
  DeviceExtras x;
  x.attach(c.alibi, c.alibi_tensor, c.sink, o);
  ASSERT_NO_THROW(flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(),
                                      dk.view(), dv.view(), o));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
  x.download(c.sink);
}

// The CPU forward, then the CUDA backward checked against the oracle.
void check_dense(DenseCase& c, int smem_cap) {
  SCOPED_TRACE(cap_str(smem_cap) + " " + c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  run_backward(c, smem_cap);
  const BackwardResults got = expect_backward_written_and_matching(c, p, c.dtype, fwd);
  if (!c.sink.logits.empty()) {
    EXPECT_EQ(got.dsink.size(), static_cast<std::size_t>(c.shape.h_q));
    for (double g : got.dsink) EXPECT_TRUE(std::isfinite(g)) << "d sink not written";
  }
}

// The dense backward of c under o (its inputs and poisoned gradients copied to the device)
// must throw Unsupported with every one of `parts` in its message and write no gradient;
// `ran` is the failure when it does not throw.
void expect_dense_backward_unsupported(DenseCase& c, const Options& o, const std::vector<std::string>& parts,
                                       const char* ran) {
  c.poison_backward();
  const HostTensor dq0 = c.dq, dk0 = c.dk, dv0 = c.dv;
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  try {
    flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                        dv.view(), o);
    ADD_FAILURE() << ran;
  } catch (const Unsupported& e) {
    for (const std::string& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
  EXPECT_TRUE(c.dq.bitwise_equal(dq0) && c.dk.bitwise_equal(dk0) && c.dv.bitwise_equal(dv0))
      << "gradients written by a declined backward";
}

using Dims = DenseFeatures;

class CudaBackward512 : public ::testing::TestWithParam<Dims> {};

TEST_P(CudaBackward512, MatchesOracle) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  const Dims& f = GetParam();
  const int kd = std::max(f.d, f.d_v);
  if (backward_over_cap(kd)) {  // gpu.sh's 99 KiB rerun: no 512 tile there
    expect_backward_declined(kd);
    return;
  }
  FA_SEEDED_RNG(rng);
  for (int cap : caps()) {
    for (DType dtype : dtypes(cap)) {
      DenseCase c = dense_feature_case(rng, f, dtype);
      check_dense(c, cap);
    }
  }
}

// Lengths end inside the 32- and 64-row query tiles and the 32-key tiles; s_k = 700 walks
// many query tiles per key tile; d below the bucket leaves the upper S / dP head-dim part,
// dK / dV warps and dQ column passes with nothing (or part) to do.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaBackward512,
    ::testing::Values(
        Dims{"d512", 2, 131, 197, 2, 2, 512, 512, false, -1, -1, 0, 0, false, 0},
        Dims{"d512_one_row", 2, 1, 77, 2, 1, 512, 512, false, -1, -1, 0, 0, false, 0},
        Dims{"d264", 1, 77, 133, 2, 2, 264, 264, false, -1, -1, 0, 0, false, 0},
        Dims{"d512_dv256_causal_gqa2", 1, 129, 260, 4, 2, 512, 256, true, -1, -1, 0, 0, false, 0},
        Dims{"d320_dv512_window", 1, 190, 230, 2, 2, 320, 512, false, 45, 13, 0, 0, false, 0},
        Dims{"d264_dv392_softcap_mqa", 1, 121, 187, 4, 1, 264, 392, false, -1, -1, 3.0f, 0, false, 0},
        Dims{"d192_dv512_causal_gqa2", 2, 130, 130, 4, 2, 192, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_dv64_alibi", 1, 100, 150, 2, 2, 512, 64, false, -1, -1, 0, 1, false, 0},
        Dims{"d512_causal_sq_gt_sk", 1, 300, 90, 2, 1, 512, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_causal_long_gqa2", 1, 100, 700, 4, 2, 512, 512, true, -1, -1, 0, 0, false, 0},
        Dims{"d512_window_zero", 1, 140, 140, 2, 2, 512, 512, false, 0, 0, 0, 0, false, 0},
        Dims{"d512_causal_window", 1, 260, 190, 4, 2, 512, 512, true, 70, -1, 0, 0, false, 0},
        Dims{"d512_alibi_batch_window", 2, 121, 187, 4, 2, 512, 512, false, 60, 60, 0, 2, false, 0},
        Dims{"d512_softcap_causal", 1, 140, 170, 2, 2, 512, 512, true, -1, -1, 2.5f, 0, false, 0},
        Dims{"d512_dropout", 1, 137, 211, 2, 1, 512, 512, false, -1, -1, 0, 0, false, 0.25f},
        Dims{"d400_dv320_dropout_causal_gqa2", 1, 137, 130, 4, 2, 400, 320, true, -1, -1, 0, 0, false, 0.2f},
        Dims{"d512_sink_causal_gqa2", 1, 150, 150, 4, 2, 512, 512, true, -1, -1, 0, 0, true, 0},
        Dims{"d264_dv512_sink", 1, 70, 99, 2, 1, 264, 512, false, -1, -1, 0, 0, true, 0},
        Dims{"everything", 2, 129, 164, 8, 2, 456, 512, true, 51, -1, 4.0f, 2, true, 0.2f}),
    [](const ::testing::TestParamInfo<Dims>& info) { return std::string(info.param.name); });

// The GPU forward's out / lse differentiated by the GPU backward (the forward's 512 bucket
// and the backward's, end to end), with dropout (the same Philox bits in both) and a sink.
TEST(CudaBackward512More, EndToEnd) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  if (backward_over_cap(512)) GTEST_SKIP() << "no 512 tile within FLASHATTN_SMEM_CAP=" << env_smem_cap();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    DenseCase c = DenseCase::random(rng, Shape{1, 143, 181, 4, 2, 512, 384}, dtype);
    c.opts.causal = true;
    c.opts.dropout_p = 0.15f;
    c.opts.seed = rng();
    c.sink.set(random_sink(rng, 4));
    SCOPED_TRACE(c.shape.str() + " " + dtype_name(dtype) + " " + describe(c.call_options()));
    const RefProblem p = c.problem();
    cuda_forward(c, KernelFamily::kAuto);
    const ForwardResults fwd = forward_results(c);
    expect_forward_matches(p, dtype, fwd);
    run_backward(c, 0);
    expect_backward_written_and_matching(c, p, dtype, fwd);
  }
}

// Deterministic mode: two runs give the same bits, under both tiles. s_q = 141 leaves the
// last 32-row query tile of 13 rows (the second half of its dq workspace tile absent); left
// windows start key tiles' query ranges at odd 32-row tiles (the half-tile ordering), GQA
// adds several heads per key tile, dropout the general score path.
TEST(CudaBackward512More, DeterministicRunsAreBitIdentical) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  if (backward_over_cap(512)) GTEST_SKIP() << "no 512 tile within FLASHATTN_SMEM_CAP=" << env_smem_cap();
  FA_SEEDED_RNG(rng);
  for (int cap : caps()) {
    for (int variant = 0; variant < 3; ++variant) {
      const int s_q = variant == 2 ? 141 : 205;
      const int d_v = variant == 1 ? 320 : 512;
      DenseCase c = DenseCase::random(rng, Shape{1, s_q, 333, 4, 2, 512, d_v}, DType::kBFloat16);
      c.opts.causal = variant == 1;
      if (variant == 2) c.opts.window_left = 150;
      if (variant == 0) c.opts.window_left = 97;
      c.opts.deterministic = true;
      c.opts.dropout_p = variant == 1 ? 0.0f : 0.1f;
      c.opts.seed = rng();
      check_dense(c, cap);
      const HostTensor dq1 = c.dq, dk1 = c.dk, dv1 = c.dv;
      for (int rerun = 0; rerun < 2; ++rerun) {
        run_backward(c, cap);
        EXPECT_TRUE(c.dq.bitwise_equal(dq1)) << "dq differs between deterministic runs, " << cap_str(cap);
        EXPECT_TRUE(c.dk.bitwise_equal(dk1)) << "dk differs between deterministic runs, " << cap_str(cap);
        EXPECT_TRUE(c.dv.bitwise_equal(dv1)) << "dv differs between deterministic runs, " << cap_str(cap);
      }
    }
  }
}

// ------------------------------------------------------------------ varlen

void run_varlen_backward(VarlenCase& c, int smem_cap) {
  c.poison_backward();
  DeviceVarlen d(c);
  DeviceCopy out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  Options o = c.call_options();
  o.smem_cap = smem_cap;
  DeviceExtras x;
  x.attach(c.alibi, c.alibi_tensor, SinkInputs{}, o);
  ASSERT_NO_THROW(flashattn::varlen_backward(d.args, dout.view(), out.view(), lse.view(), dq.view(), dk.view(),
                                             dv.view(), o));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
}

// Empty sequences (queries and keys), seqused_k, causal, GQA, dropout at (320, 512) and 512;
// seqused_q at 512 (the rows past it: dq 0, their q / dout NaN and never read).
TEST(CudaBackward512More, VarlenEmptySequencesSequsedKAndQ) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  if (backward_over_cap(512)) GTEST_SKIP() << "no 512 tile within FLASHATTN_SMEM_CAP=" << env_smem_cap();
  FA_SEEDED_RNG(rng);
  for (int cap : caps()) {
    for (DType dtype : dtypes(cap)) {
      for (int variant = 0; variant < 2; ++variant) {
        // Lengths 70, 0, 133, 1, 200 (queries) and 90, 40, 0, 150, 201 (keys).
        VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 203, 204, 404}, {0, 90, 130, 130, 280, 481}, 4, 2,
                                        variant == 0 ? 320 : 512, dtype, 5, 7, 512);
        c.set_seqused_k({77, 40, 0, 150, 190});
        c.opts.causal = variant == 0;
        c.opts.dropout_p = variant == 1 ? 0.2f : 0.0f;
        c.opts.seed = rng();
        SCOPED_TRACE(cap_str(cap) + " " + dtype_name(dtype) + " d " + std::to_string(c.d) + " " +
                     describe(c.call_options()));
        ASSERT_NO_THROW(c.run_forward());
        const RefProblem p = c.problem();
        const ForwardResults fwd = forward_results(c);
        run_varlen_backward(c, cap);
        expect_backward_written_and_matching(c, p, dtype, fwd);
        for (double x : c.dkv_unused_rows()) ASSERT_EQ(x, 0.0) << "dk/dv beyond seqused_k";
      }
      {
        const std::vector<int> lq = {70, 0, 133, 1, 200}, lk = {90, 40, 0, 150, 201};
        VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 2, 1, 512, dtype, 5, 7);
        c.set_seqused_q({uniform_int(rng, 1, 69), 0, 129, 0, uniform_int(rng, 65, 199)});
        c.opts.softcap = 4.0f;
        SCOPED_TRACE(cap_str(cap) + " seqused_q 512 " + dtype_name(dtype));
        c.poison_unused_q_rows();
        ASSERT_NO_THROW(c.run_forward());
        const RefProblem p = c.problem();
        const ForwardResults fwd = forward_results(c);
        run_varlen_backward(c, cap);
        expect_backward_written_and_matching(c, p, dtype, fwd, false);
        for (double x : c.q_unused_rows(c.dq)) ASSERT_EQ(x, 0.0) << "dq of a row past seqused_q";
      }
    }
  }
}

// ------------------------------------------------------------------ declined

// Block-sparse masks: the 512 bucket has no such kernel (as the forward's): Unsupported
// naming opts.block_sparse, nothing written.
TEST(CudaBackward512Declined, BlockSparseMask) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  // Under a 99 KiB cap (FLASHATTN_SMEM_CAP) the shared-memory check declines first, naming q
  // (the declines' own test checks that error).
  if (backward_over_cap(512)) GTEST_SKIP() << "the 512 backward's shared memory exceeds the cap";
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 200, 260, 2, 1, 512}, DType::kBFloat16);
  ASSERT_NO_THROW(c.run_forward());
  const HostBlockMask m = random_mask(rng, 1, 2, 200, 260, 128, 128, false, false, 0.5, true);
  DeviceMask dm;
  Options o = c.call_options();
  dm.apply(m, o);
  expect_dense_backward_unsupported(
      c, o, {"argument 'opts.block_sparse'", "head dims above 256", "d = 512, d_v = 512"},
      "a block-sparse backward accepted at d = 512");
}

// 99 KiB of shared memory per block (sm86 / sm89; opts.smem_cap here): no 512 tile, an
// Unsupported naming q and the bytes the 32-row tile needs, nothing written (dense and
// varlen, d or d_v above 256).
TEST(CudaBackward512Declined, SmallSharedMemory) {
  FA_REQUIRE_GPU();
  if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";
  const int need = detail::cuda::sm80::bwd_smem_need(512);
  EXPECT_GT(need, 101376);
  EXPECT_LE(need, kSm80Cap);
  FA_SEEDED_RNG(rng);
  struct Pair {
    int d, d_v;
  };
  for (const Pair& pr : {Pair{512, 512}, Pair{320, 128}, Pair{128, 264}}) {
    DenseCase c = DenseCase::random(rng, Shape{1, 40, 50, 2, 1, pr.d, pr.d_v}, DType::kBFloat16);
    ASSERT_NO_THROW(c.run_forward());
    Options o = c.call_options();
    o.smem_cap = 101376;
    SCOPED_TRACE("d " + std::to_string(pr.d) + ", d_v " + std::to_string(pr.d_v));
    expect_dense_backward_unsupported(
        c, o,
        {"argument 'q'",
         "at least " + std::to_string(need) + " bytes of shared memory per block for the backward at head dim " +
             std::to_string(std::max(pr.d, pr.d_v)),
         "got 101376 bytes"},
        "the 512 backward ran within 99 KiB of shared memory");
  }
  VarlenCase c = VarlenCase::make(rng, {0, 30, 75}, {0, 40, 90}, 2, 1, 512, DType::kFloat16);
  ASSERT_NO_THROW(c.run_forward());
  DeviceVarlen d(c);
  DeviceCopy out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  Options o = c.call_options();
  o.smem_cap = 101376;
  try {
    flashattn::varlen_backward(d.args, dout.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view(), o);
    ADD_FAILURE() << "the 512 varlen backward ran within 99 KiB of shared memory";
  } catch (const Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q'"));
    EXPECT_THAT(e.what(), HasSubstr("for the backward at head dim 512"));
  }
}

}  // namespace
}  // namespace flashattn::test
