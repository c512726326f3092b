// CUDA backward (the family the call resolves to: FLASHATTN_KERNEL_FAMILY=auto runs the sm90
// main kernel on Hopper where it applies, sm80 runs the sm80 one) against the fp64 oracle
// under the suite's tolerance rule.
// The forward outputs it differentiates (out, lse) come from the CPU backend on the same
// inputs, so these tests exercise the backward alone: every mask, softcap, ALiBi, dropout
// (same seed as the CPU, so the same kept set), GQA, odd and unequal lengths, every
// head-dim bucket and a non-bucket d, fp16 and bf16, varlen with empty sequences and
// seqused_k, fully masked rows, deterministic mode (bit-identical reruns) and outputs
// poisoned with NaN before every call (checked fully written).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

// Runs the CUDA backward of a dense case whose out / lse are already filled; dq, dk,
// dv are poisoned first and downloaded into c.
void run_cuda_backward(DenseCase& c) {
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout);
  DeviceCopy dq(c.dq), dk(c.dk), dv(c.dv);
  Options opts = c.call_options();
  std::unique_ptr<DeviceCopy> alibi;
  if (!c.alibi.empty()) {
    alibi = std::make_unique<DeviceCopy>(c.alibi_tensor);
    opts.alibi_slopes = alibi->view();
  }
  ASSERT_NO_THROW(flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(),
                                      lse.view(), dq.view(), dk.view(), dv.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
}

void check_dense(DenseCase& c) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  ASSERT_NO_THROW(c.run_forward());  // CPU forward: the out / lse being differentiated
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  run_cuda_backward(c);
  expect_backward_written_and_matching(c, p, c.dtype, fwd);
}

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

struct Feature {
  const char* name;
  int b, s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  int alibi;  // 0 off, 1 [h_q], 2 [b, h_q]
  float dropout;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

class CudaBackwardFeature : public ::testing::TestWithParam<Feature> {};

TEST_P(CudaBackwardFeature, MatchesOracle) {
  FA_REQUIRE_GPU();
  const Feature& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim " << f.d << " not compiled (FLASHATTN_HEAD_DIMS)";
  if (backward_over_cap(f.d)) {  // a 99 KiB part (FLASHATTN_SMEM_CAP): no backward above d = 160
    expect_backward_declined(f.d);
    return;
  }
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    DenseCase c = DenseCase::random(rng, shape_of(f.b, f.s_q, f.s_k, f.h_q, f.h_k, f.d), dtype);
    c.opts.causal = f.causal;
    c.opts.window_left = f.left;
    c.opts.window_right = f.right;
    c.opts.softcap = f.softcap;
    if (f.alibi) c.set_alibi(random_alibi(rng, f.b, f.h_q, f.alibi == 2), f.alibi == 2);
    c.opts.dropout_p = f.dropout;
    c.opts.seed = rng();
    c.opts.offset = rng();
    check_dense(c);
  }
}

// Lengths chosen to straddle the 64-row query tiles (128-row at d <= 64, e.g. 129 and 131
// leave one and three rows in the last) and the 64/128-key tiles.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaBackwardFeature,
    ::testing::Values(Feature{"plain", 2, 131, 197, 2, 2, 64, false, -1, -1, 0, 0, 0},
                      Feature{"one_row", 1, 1, 77, 2, 1, 64, false, -1, -1, 0, 0, 0},
                      Feature{"gqa2", 1, 97, 203, 4, 2, 128, false, -1, -1, 0, 0, 0},
                      Feature{"gqa4_causal", 2, 150, 150, 8, 2, 64, true, -1, -1, 0, 0, 0},
                      Feature{"mqa", 1, 70, 259, 4, 1, 128, false, -1, -1, 0, 0, 0},
                      Feature{"causal", 1, 257, 257, 2, 1, 128, true, -1, -1, 0, 0, 0},
                      Feature{"causal_sq_gt_sk", 1, 300, 90, 2, 1, 64, true, -1, -1, 0, 0, 0},
                      Feature{"causal_sq_lt_sk", 1, 90, 300, 2, 1, 64, true, -1, -1, 0, 0, 0},
                      Feature{"window_left", 1, 230, 230, 2, 2, 64, false, 37, -1, 0, 0, 0},
                      Feature{"window_right", 1, 230, 230, 2, 2, 64, false, -1, 21, 0, 0, 0},
                      Feature{"window_both", 1, 190, 260, 2, 2, 128, false, 45, 13, 0, 0, 0},
                      Feature{"window_zero", 1, 140, 140, 2, 2, 64, false, 0, 0, 0, 0, 0},
                      Feature{"causal_window", 1, 260, 190, 4, 2, 64, true, 70, -1, 0, 0, 0},
                      Feature{"softcap", 1, 121, 187, 2, 1, 64, false, -1, -1, 2.5f, 0, 0},
                      Feature{"alibi", 1, 121, 187, 4, 2, 64, true, -1, -1, 0, 1, 0},
                      Feature{"alibi_batch", 2, 121, 187, 4, 2, 128, false, 60, 60, 0, 2, 0},
                      Feature{"dropout", 1, 137, 211, 2, 1, 64, false, -1, -1, 0, 0, 0.25f},
                      Feature{"dropout_causal_gqa", 1, 137, 130, 4, 2, 128, true, -1, -1, 0, 0, 0.4f},
                      Feature{"everything", 2, 129, 164, 8, 2, 64, true, 51, -1, 4.0f, 2, 0.2f},
                      // Above d = 128 (the sm90 family's split-head-dim consumers, dQ added
                      // from registers): masks, softcap, ALiBi, GQA, a non-bucket head dim,
                      // and lengths past 2048, which ran the sm80 kernel before.
                      Feature{"d256_causal_gqa", 2, 150, 211, 4, 2, 256, true, -1, -1, 0, 0, 0},
                      Feature{"d192_window_softcap", 1, 190, 260, 2, 1, 192, false, 45, 13, 3.0f, 0, 0},
                      Feature{"d256_alibi_batch", 2, 121, 187, 4, 2, 256, false, 60, 60, 0, 2, 0},
                      Feature{"d200_long_causal", 1, 2113, 2177, 2, 1, 200, true, -1, -1, 0, 0, 0},
                      Feature{"d256_long", 1, 2100, 2305, 2, 2, 256, false, -1, -1, 0, 0, 0}),
    [](const ::testing::TestParamInfo<Feature>& i) { return std::string(i.param.name); });

// Every bucket (those larger than the build's largest are skipped) and non-bucket dims,
// which run in the next bucket with predicated loads and stores.
TEST(CudaBackward, HeadDims) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : {32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 224, 248, 256}) {
    if (!detail::cuda::supports_head_dim(d)) continue;
    if (backward_over_cap(d)) {  // a 99 KiB part: no backward above d = 160
      expect_backward_declined(d);
      continue;
    }
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, shape_of(1, 83, 141, 2, 1, d), dtype);
      c.opts.causal = d % 64 == 0;
      check_dense(c);
    }
  }
}

// Rows that see no key (causal with s_q > s_k, a window beyond the keys) get dq = 0 and
// contribute nothing; keys no query sees get dk = dv = 0.
TEST(CudaBackward, FullyMaskedRowsAndUnseenKeys) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 200, 70, 2, 1, 64), DType::kBFloat16);
  c.opts.causal = true;  // rows 0..129 see nothing
  check_dense(c);
  for (std::int64_t i = 0; i < 130; ++i)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t e = 0; e < 64; ++e) ASSERT_EQ(c.dq.at({0, i, h, e}), 0.0) << "row " << i;

  DenseCase w = DenseCase::random(rng, shape_of(1, 100, 300, 2, 2, 64), DType::kFloat16);
  w.opts.window_left = 10;
  w.opts.window_right = 0;  // keys 0..189 are seen by no query
  check_dense(w);
  for (std::int64_t j = 0; j < 180; ++j)
    for (std::int64_t e = 0; e < 64; ++e) {
      ASSERT_EQ(w.dk.at({0, j, 0, e}), 0.0) << "key " << j;
      ASSERT_EQ(w.dv.at({0, j, 1, e}), 0.0) << "key " << j;
    }
}

TEST(CudaBackward, ExtremeLogitsStayFinite) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 90, 150, 2, 1, 64), DType::kBFloat16);
  for (std::int64_t e = 0; e < c.q.numel(); ++e) c.q.set(e, 8.0 * c.q.get(e));
  c.opts.causal = true;
  check_dense(c);
}

// Deterministic mode: two runs give the same bits (dq is ordered across key tiles).
// s_q = 141 leaves 13 rows in the last 128-row query tile of the d <= 64 buckets, whose
// second 64-row dq workspace tile does not exist; a window exercises the ordering of key
// tiles that start after key 0.
TEST(CudaBackward, DeterministicRunsAreBitIdentical) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int variant = 0; variant < 3; ++variant) {
    const bool causal = variant == 1;
    const int s_q = variant == 2 ? 141 : 333;
    DenseCase c = DenseCase::random(rng, shape_of(2, s_q, 517, 4, 2, 64), DType::kBFloat16);
    if (variant == 2) c.opts.window_left = 150;
    c.opts.causal = causal;
    c.opts.deterministic = true;
    c.opts.dropout_p = 0.1f;
    c.opts.seed = rng();
    check_dense(c);
    const HostTensor dq1 = c.dq, dk1 = c.dk, dv1 = c.dv;
    run_cuda_backward(c);
    EXPECT_TRUE(c.dq.bitwise_equal(dq1)) << "dq differs between deterministic runs";
    EXPECT_TRUE(c.dk.bitwise_equal(dk1)) << "dk differs between deterministic runs";
    EXPECT_TRUE(c.dv.bitwise_equal(dv1)) << "dv differs between deterministic runs";
  }
}

// Deterministic mode without dropout (the sm90 backward's writer warp orders its bulk dQ
// additions by the per-tile counters): both head-dim tiles, GQA, causal, a left window
// (key tiles that start after key 0), softcap, and a last query tile of one row.
TEST(CudaBackward, DeterministicWithoutDropoutIsBitIdentical) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : {64, 128}) {
    if (!detail::cuda::supports_head_dim(d)) continue;
    for (int variant = 0; variant < 3; ++variant) {
      const int s_q = variant == 2 ? 129 : 385;
      DenseCase c = DenseCase::random(rng, shape_of(2, s_q, 611, 6, 2, d), DType::kBFloat16);
      c.opts.causal = variant == 1;
      if (variant == 2) {
        c.opts.window_left = 200;
        c.opts.softcap = 3.0f;
      }
      c.opts.deterministic = true;
      check_dense(c);
      const HostTensor dq1 = c.dq, dk1 = c.dk, dv1 = c.dv;
      for (int rerun = 0; rerun < 2; ++rerun) {
        run_cuda_backward(c);
        EXPECT_TRUE(c.dq.bitwise_equal(dq1)) << "dq differs between deterministic runs, d " << d;
        EXPECT_TRUE(c.dk.bitwise_equal(dk1)) << "dk differs between deterministic runs, d " << d;
        EXPECT_TRUE(c.dv.bitwise_equal(dv1)) << "dv differs between deterministic runs, d " << d;
      }
    }
  }
}

// ------------------------------------------------------------------ varlen

void run_cuda_varlen_backward(VarlenCase& c) {
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout);
  DeviceCopy dq(c.dq), dk(c.dk), dv(c.dv);
  DeviceCopy cu_q(c.cu_q_t), cu_k(c.cu_k_t);
  std::unique_ptr<DeviceCopy> used, alibi;
  VarlenArgs args = c.args();
  args.q = q.view();
  args.k = k.view();
  args.v = v.view();
  args.cu_seqlens_q = cu_q.view();
  args.cu_seqlens_k = cu_k.view();
  if (!c.seqused_k.empty()) {
    used = std::make_unique<DeviceCopy>(c.seqused_t);
    args.seqused_k = used->view();
  }
  Options opts = c.call_options();
  if (!c.alibi.empty()) {
    alibi = std::make_unique<DeviceCopy>(c.alibi_tensor);
    opts.alibi_slopes = alibi->view();
  }
  ASSERT_NO_THROW(flashattn::varlen_backward(args, dout.view(), out.view(), lse.view(), dq.view(),
                                             dk.view(), dv.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
}

TEST(CudaBackward, VarlenWithEmptySequencesAndSequsedK) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (bool causal : {false, true}) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      // Lengths 70, 0, 133, 1, 200 (queries) and 90, 40, 0, 150, 201 (keys).
      VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 203, 204, 404}, {0, 90, 130, 130, 280, 481},
                                      4, 2, 64, dtype, 5, 7);
      if (causal) c.set_seqused_k({77, 40, 0, 150, 190});
      c.opts.causal = causal;
      c.opts.dropout_p = causal ? 0.15f : 0.0f;
      c.opts.seed = rng();
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + describe(c.call_options()));
      ASSERT_NO_THROW(c.run_forward());
      const RefProblem p = c.problem();
      const ForwardResults fwd = forward_results(c);
      run_cuda_varlen_backward(c);
      expect_backward_written_and_matching(c, p, dtype, fwd);
      for (double x : c.dkv_unused_rows()) ASSERT_EQ(x, 0.0) << "dk/dv beyond seqused_k";
    }
  }
}

// Caller workspace of exactly backward_workspace_size bytes is enough.
TEST(CudaBackward, CallerWorkspaceOfReportedSize) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(2, 77, 99, 4, 1, 128), DType::kBFloat16);
  c.opts.causal = true;
  c.opts.deterministic = true;
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout);
  DeviceCopy dq(c.dq), dk(c.dk), dv(c.dv);
  const std::size_t bytes = flashattn::backward_workspace_size(q.view(), k.view(), v.view(), c.opts);
  ASSERT_GT(bytes, 0u);
  void* ws = nullptr;
  FA_CUDA_OK(cudaMalloc(&ws, bytes));
  FA_CUDA_OK(cudaMemset(ws, 0xff, bytes));  // the backward must initialise what it reads
  ASSERT_NO_THROW(flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(),
                                      lse.view(), dq.view(), dk.view(), dv.view(), c.opts,
                                      Workspace{ws, bytes}));
  FA_CUDA_OK(cudaDeviceSynchronize());
  cudaFree(ws);
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
}


// dk and dv as views with padded rows and heads and a base 16 bytes into their buffers (the
// sm90 epilogue's TMA stores take the views' own strides): the same bits as the contiguous
// call, and the padding and the bytes before the base untouched. Key lengths leave a last
// 64-key slab partly past the keys (stored from registers) and whole slabs (staged).
TEST(CudaBackward, PaddedGradientLayoutsMatchContiguous) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : {64, 128}) {
    if (!detail::cuda::supports_head_dim(d)) continue;
    for (bool causal : {false, true}) {
      const int b = 2, s_k = 211, h_k = 2;
      DenseCase c = DenseCase::random(rng, shape_of(b, 150, s_k, 4, h_k, d), DType::kBFloat16);
      c.opts.causal = causal;
      check_dense(c);  // the contiguous call, against the oracle
      DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq);
      const std::int64_t pad_d = d + 8, pad_h = h_k + 1, base = 8;  // elements
      const std::int64_t row = pad_h * pad_d, batch = std::int64_t(s_k) * row + 16;
      const std::size_t elems = std::size_t(base + b * batch);
      std::uint16_t* buf[2] = {nullptr, nullptr};
      for (auto*& p : buf) {
        FA_CUDA_OK(cudaMalloc(&p, elems * 2));
        FA_CUDA_OK(cudaMemset(p, 0x7b, elems * 2));
      }
      const Device dev = Device::cuda(0);
      const Tensor dk = Tensor::strided(buf[0] + base, DType::kBFloat16, {b, s_k, h_k, d}, {batch, row, pad_d, 1}, dev);
      const Tensor dv = Tensor::strided(buf[1] + base, DType::kBFloat16, {b, s_k, h_k, d}, {batch, row, pad_d, 1}, dev);
      ASSERT_NO_THROW(flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(),
                                          dk, dv, c.opts));
      FA_CUDA_OK(cudaDeviceSynchronize());
      const HostTensor* want[2] = {&c.dk, &c.dv};
      for (int t = 0; t < 2; ++t) {
        std::vector<std::uint16_t> got(elems);
        FA_CUDA_OK(cudaMemcpy(got.data(), buf[t], elems * 2, cudaMemcpyDeviceToHost));
        cudaFree(buf[t]);
        const auto* ref = static_cast<const std::uint16_t*>(want[t]->data());
        std::vector<bool> inside(elems, false);
        for (int bb = 0; bb < b; ++bb)
          for (int j = 0; j < s_k; ++j)
            for (int g = 0; g < h_k; ++g)
              for (int e = 0; e < d; ++e) {
                const std::size_t at = std::size_t(base + bb * batch + j * row + g * pad_d + e);
                inside[at] = true;
                ASSERT_EQ(got[at], ref[((std::size_t(bb) * s_k + j) * h_k + g) * d + e])
                    << (t ? "dv" : "dk") << " d " << d << " causal " << causal << " at (" << bb << ", " << j << ", "
                    << g << ", " << e << ")";
              }
        for (std::size_t i = 0; i < elems; ++i) {
          if (!inside[i]) ASSERT_EQ(got[i], 0x7b7b) << (t ? "dv" : "dk") << " padding element " << i << " written";
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashattn::test
