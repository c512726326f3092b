// CUDA learnable sinks (Options::learnable_sink / learnable_sink_grad) on every kernel
// family (Options::kernel_family kSm80 and kSm90; a family the GPU or the build cannot run
// is skipped): the fused forward (sm80, sm90), the KV-cache decode kernel (dense, paged,
// GQA-packed, split-KV: the sink joins after the merge), varlen, and the sm80 backward with
// d sink, all against the fp64 oracle under the suite's tolerance rule, with outputs
// poisoned before every call; a sink of -inf gives the bits of no sink; gpt-oss's shapes
// (alternating full and 128-token causal windows, GQA 8).
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "flashattn/error.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr KernelFamily kFamilies[] = {KernelFamily::kSm80, KernelFamily::kSm90};
const char* family_name(KernelFamily f) { return f == KernelFamily::kSm90 ? "sm90" : "sm80"; }

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

// Device copies of a case's sink (and, for the backward, its gradient output).
struct DeviceSink {
  std::unique_ptr<DeviceCopy> sink, grad;
  void attach(const SinkInputs& s, Options& opts, bool with_grad) {
    opts.learnable_sink = Tensor{};
    opts.learnable_sink_grad = Tensor{};
    if (s.logits.empty()) return;
    sink = std::make_unique<DeviceCopy>(s.tensor);
    opts.learnable_sink = sink->view();
    if (with_grad && s.want_grad) {
      HostTensor poisoned = s.grad;
      poisoned.fill_nan();
      grad = std::make_unique<DeviceCopy>(poisoned);
      opts.learnable_sink_grad = grad->view();
    }
  }
};

// Whether a family can run on this GPU / build: a forced family it cannot run is an
// Unsupported error (checked with a tiny call).
bool family_runs(KernelFamily family) {
  HostTensor q(DType::kFloat16, {1, 1, 1, 64});
  DeviceCopy dq(q), dout(q);
  HostTensor lse(DType::kFloat32, {1, 1, 1});
  DeviceCopy dlse(lse);
  Options o;
  o.kernel_family = family;
  try {
    flashattn::forward(dq.view(), dq.view(), dq.view(), dout.view(), dlse.view(), o);
  } catch (const Unsupported&) {
    return false;
  }
  return cudaDeviceSynchronize() == cudaSuccess;
}

void run_cuda_forward(DenseCase& c, KernelFamily family) {
  c.poison_forward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse);
  Options opts = c.call_options();
  opts.kernel_family = family;
  DeviceSink sink;
  sink.attach(c.sink, opts, false);
  ASSERT_NO_THROW(flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
}

// out / lse already filled (CPU or GPU forward); dq, dk, dv, d sink poisoned and downloaded.
void run_cuda_backward(DenseCase& c, KernelFamily family) {
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout);
  DeviceCopy dq(c.dq), dk(c.dk), dv(c.dv);
  Options opts = c.call_options();
  opts.kernel_family = family;
  DeviceSink sink;
  sink.attach(c.sink, opts, true);
  ASSERT_NO_THROW(flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(),
                                      lse.view(), dq.view(), dk.view(), dv.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
  if (sink.grad) sink.grad->download(c.sink.grad);
}

void check_forward(DenseCase& c, KernelFamily family) {
  SCOPED_TRACE(std::string(family_name(family)) + " " + c.shape.str() + " " + dtype_name(c.dtype) + " " +
               describe(c.call_options()));
  run_cuda_forward(c, family);
  expect_forward_matches(c.problem(), c.dtype, forward_results(c));
}

// The GPU backward of the CPU forward's out / lse (the backward alone), then the GPU
// backward of the GPU forward (end to end).
void check_backward(DenseCase& c, KernelFamily family) {
  SCOPED_TRACE(std::string(family_name(family)) + " " + c.shape.str() + " " + dtype_name(c.dtype) + " " +
               describe(c.call_options()));
  const RefProblem p = c.problem();
  ASSERT_NO_THROW(c.run_forward());
  ForwardResults fwd = forward_results(c);
  run_cuda_backward(c, family);
  BackwardResults got = backward_results(c);
  ASSERT_EQ(got.dsink.size(), static_cast<std::size_t>(c.shape.h_q));
  expect_backward_matches(p, c.dtype, fwd, got);
  run_cuda_forward(c, family);
  fwd = forward_results(c);
  run_cuda_backward(c, family);
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
}

struct Feature {
  const char* name;
  int b, s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  float dropout;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

class CudaSinkFeature : public ::testing::TestWithParam<Feature> {};

Feature feature_case(DenseCase& c, const Feature& f, Rng& rng) {
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  c.opts.dropout_p = f.dropout;
  c.opts.seed = rng();
  c.opts.offset = rng();
  c.sink.set(random_sink(rng, f.h_q));
  return f;
}

TEST_P(CudaSinkFeature, ForwardMatchesOracleOnEveryFamily) {
  FA_REQUIRE_GPU();
  const Feature& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim " << f.d << " not in this build";
  for (KernelFamily family : kFamilies) {
    if (!family_runs(family)) continue;
    FA_SEEDED_RNG(rng);
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, shape_of(f.b, f.s_q, f.s_k, f.h_q, f.h_k, f.d), dtype);
      feature_case(c, f, rng);
      check_forward(c, family);
    }
  }
}

TEST_P(CudaSinkFeature, BackwardWithSinkGradientMatchesOracle) {
  FA_REQUIRE_GPU();
  const Feature& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim " << f.d << " not in this build";
  if (backward_over_cap(f.d)) {  // a 99 KiB part: no backward above d = 160
    expect_backward_declined(f.d);
    return;
  }
  for (KernelFamily family : kFamilies) {
    if (!family_runs(family)) continue;
    FA_SEEDED_RNG(rng);
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, shape_of(f.b, f.s_q, f.s_k, f.h_q, f.h_k, f.d), dtype);
      feature_case(c, f, rng);
      check_backward(c, family);
    }
  }
}

// Lengths straddle the query and key tiles; gpt-oss: GQA 8, 128-token causal windows.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaSinkFeature,
    ::testing::Values(Feature{"plain", 2, 131, 197, 2, 2, 64, false, -1, -1, 0, 0},
                      Feature{"one_row", 1, 1, 77, 2, 1, 64, false, -1, -1, 0, 0},
                      Feature{"causal_gqa4", 2, 150, 150, 8, 2, 64, true, -1, -1, 0, 0},
                      Feature{"causal_sq_gt_sk", 1, 300, 90, 2, 1, 64, true, -1, -1, 0, 0},
                      Feature{"gpt_oss_window_128", 1, 517, 517, 16, 2, 64, true, 127, -1, 0, 0},
                      Feature{"gpt_oss_full", 1, 517, 517, 16, 2, 64, true, -1, -1, 0, 0},
                      Feature{"window_both", 1, 190, 260, 2, 2, 128, false, 45, 13, 0, 0},
                      Feature{"softcap", 1, 121, 187, 2, 1, 128, false, -1, -1, 2.5f, 0},
                      Feature{"dropout", 1, 137, 211, 2, 1, 64, true, -1, -1, 0, 0.25f},
                      Feature{"hd256_long_causal", 1, 150, 900, 4, 2, 256, true, -1, -1, 0, 0}),
    [](const ::testing::TestParamInfo<Feature>& i) { return std::string(i.param.name); });

// Rows that see no key: out exactly 0 and lse the sink (to fp32 rounding); sinks far above
// and below the scores; nothing NaN.
TEST(CudaSink, EmptyRowsAndExtremeSinks) {
  FA_REQUIRE_GPU();
  for (KernelFamily family : kFamilies) {
    if (!family_runs(family)) continue;
    FA_SEEDED_RNG(rng);
    DenseCase c = DenseCase::random(rng, shape_of(1, 200, 70, 4, 1, 64), DType::kBFloat16);
    c.opts.causal = true;  // rows 0..129 see nothing
    c.sink.set({-60.0f, 60.0f, 0.0f, 1.5f});
    check_forward(c, family);
    for (std::int64_t i = 0; i < 130; ++i)
      for (std::int64_t h = 0; h < 4; ++h) {
        // lse = (sink * log2(e) + log2(1)) * ln(2) in fp32: a few roundings of |sink|.
        const double sink = c.sink.logits[static_cast<std::size_t>(h)];
        EXPECT_NEAR(c.lse.at({0, h, i}), sink, 2e-6 * (1.0 + std::fabs(sink))) << "row " << i;
        for (std::int64_t e = 0; e < 64; ++e) ASSERT_EQ(c.out.at({0, i, h, e}), 0.0) << "row " << i;
      }
    check_backward(c, family);
  }
}

// A sink of -inf gives exactly the bits of no sink (forward), and d sink = 0.
TEST(CudaSink, MinusInfinityIsNoSink) {
  FA_REQUIRE_GPU();
  for (KernelFamily family : kFamilies) {
    if (!family_runs(family)) continue;
    FA_SEEDED_RNG(rng);
    DenseCase c = DenseCase::random(rng, shape_of(2, 133, 201, 8, 2, 128), DType::kFloat16);
    c.opts.causal = true;
    c.opts.window_left = 60;
    run_cuda_forward(c, family);
    const std::vector<double> out0 = c.out.to_double(), lse0 = c.lse.to_double();
    const float inf = std::numeric_limits<float>::infinity();
    c.sink.set(std::vector<float>(8, -inf));
    run_cuda_forward(c, family);
    EXPECT_TRUE(bitwise_equal("out", c.out.to_double(), out0));
    EXPECT_TRUE(bitwise_equal("lse", c.lse.to_double(), lse0));
    run_cuda_backward(c, family);
    for (double g : c.sink.grad.to_double()) EXPECT_EQ(g, 0.0);
  }
}

// d sink is the same bits on every run (one block per head, a fixed reduction).
TEST(CudaSink, SinkGradientIsReproducible) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(3, 301, 301, 8, 2, 64), DType::kBFloat16);
  c.opts.causal = true;
  c.sink.set(random_sink(rng, 8));
  c.run_forward();
  run_cuda_backward(c, KernelFamily::kAuto);
  const std::vector<double> g0 = c.sink.grad.to_double();
  for (int rep = 0; rep < 3; ++rep) {
    run_cuda_backward(c, KernelFamily::kAuto);
    EXPECT_TRUE(bitwise_equal("dsink", c.sink.grad.to_double(), g0));
  }
  EXPECT_TRUE(all_finite("dsink", g0));
}

// ------------------------------------------------------------------ varlen

void run_cuda_varlen(VarlenCase& c, KernelFamily family, bool backward) {
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout);
  DeviceCopy dq(c.dq), dk(c.dk), dv(c.dv), cu_q(c.cu_q_t), cu_k(c.cu_k_t);
  std::unique_ptr<DeviceCopy> used;
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
  opts.kernel_family = family;
  DeviceSink sink;
  sink.attach(c.sink, opts, backward);
  if (!backward) {
    ASSERT_NO_THROW(flashattn::varlen_forward(args, out.view(), lse.view(), opts));
    FA_CUDA_OK(cudaDeviceSynchronize());
    out.download(c.out);
    lse.download(c.lse);
    return;
  }
  ASSERT_NO_THROW(flashattn::varlen_backward(args, dout.view(), out.view(), lse.view(), dq.view(),
                                             dk.view(), dv.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
  if (sink.grad) sink.grad->download(c.sink.grad);
}

TEST(CudaSink, VarlenForwardAndBackward) {
  FA_REQUIRE_GPU();
  const std::vector<int> lq = {0, 130, 1, 77, 260, 0}, lk = {5, 130, 300, 0, 260, 3};
  std::vector<int> cu_q{0}, cu_k{0};
  for (std::size_t i = 0; i < lq.size(); ++i) {
    cu_q.push_back(cu_q.back() + lq[i]);
    cu_k.push_back(cu_k.back() + lk[i]);
  }
  for (KernelFamily family : kFamilies) {
    if (!family_runs(family)) continue;
    FA_SEEDED_RNG(rng);
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      for (int mode = 0; mode < 2; ++mode) {
        VarlenCase c = VarlenCase::make(rng, cu_q, cu_k, 8, 2, 64, dtype);
        c.opts.causal = true;
        if (mode == 1) c.opts.window_left = 127;
        c.sink.set(random_sink(rng, 8));
        SCOPED_TRACE(std::string(family_name(family)) + " " + dtype_name(dtype) + " " + describe(c.call_options()));
        const RefProblem p = c.problem();
        c.poison_forward();
        run_cuda_varlen(c, family, false);
        const ForwardResults fwd = forward_results(c);
        expect_forward_matches(p, dtype, fwd);
        c.poison_backward();
        run_cuda_varlen(c, family, true);
        expect_backward_matches(p, dtype, fwd, backward_results(c));
      }
    }
  }
}

// ------------------------------------------------------------------ KV cache

void run_cuda_kvcache(KVCacheCase& c, KernelFamily family) {
  DeviceCopy q(c.q), kc(c.k_cache), vc(c.v_cache), lens(c.cache_lens_t), table(c.block_table_t),
      idx(c.batch_idx_t), kn(c.k_new), vn(c.v_new), out(c.out), lse(c.lse);
  KVCacheArgs args = c.args();
  args.q = q.view();
  args.k_cache = kc.view();
  args.v_cache = vc.view();
  args.cache_seqlens = lens.view();
  if (args.block_table.defined()) args.block_table = table.view();
  if (args.cache_batch_idx.defined()) args.cache_batch_idx = idx.view();
  if (args.k_new.defined()) {
    args.k_new = kn.view();
    args.v_new = vn.view();
  }
  Options opts = c.call_options();
  opts.kernel_family = family;
  DeviceSink sink;
  sink.attach(c.sink, opts, false);
  ASSERT_NO_THROW(kvcache_forward(args, out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
  kc.download(c.k_cache);
  vc.download(c.v_cache);
}

// The decode kernel (s_q 1 with GQA packing, s_q 4), dense and paged caches, splits 1, 3
// and the heuristic (the sink joins in the split merge), 128-token windows.
TEST(CudaSink, KVCacheDecodeSplitsPagedWindows) {
  FA_REQUIRE_GPU();
  for (KernelFamily family : kFamilies) {
    if (!family_runs(family)) continue;
    FA_SEEDED_RNG(rng);
    for (int block_size : {0, 16}) {
      for (int s_q : {1, 4}) {
        for (int splits : {1, 3, 0}) {
          KVCacheConfig cfg;
          cfg.batch = 3;
          cfg.s_q = s_q;
          cfg.s_new = 1;
          cfg.h_q = 16;
          cfg.h_k = 2;
          cfg.d = 64;
          cfg.dtype = splits == 3 ? DType::kBFloat16 : DType::kFloat16;
          cfg.block_size = block_size;
          cfg.max_cache_len = 1500;
          cfg.cache_lens = {uniform_int(rng, 0, 1500), 0, 1023};
          KVCacheCase c = KVCacheCase::make(rng, cfg);
          c.num_splits = splits;
          c.opts.causal = true;
          if (s_q == 4) c.opts.window_left = 127;
          c.sink.set(random_sink(rng, cfg.h_q));
          SCOPED_TRACE(std::string(family_name(family)) + " block_size=" + std::to_string(block_size) +
                       " s_q=" + std::to_string(s_q) + " splits=" + std::to_string(splits));
          c.poison_outputs();
          run_cuda_kvcache(c, family);
          expect_forward_matches(c.problem(), cfg.dtype, forward_results(c));
          EXPECT_TRUE(c.k_cache.bitwise_equal(c.k_cache_expected));
        }
      }
    }
  }
}

// The fp8 cache goes through the decode kernel's fp8 path.
TEST(CudaSink, KVCacheFp8) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg;
  cfg.batch = 2;
  cfg.s_q = 1;
  cfg.h_q = 8;
  cfg.h_k = 1;
  cfg.d = 64;
  cfg.dtype = DType::kBFloat16;
  cfg.block_size = 16;
  cfg.fp8 = true;
  cfg.max_cache_len = 700;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.sink.set(random_sink(rng, 8));
  c.poison_outputs();
  DeviceCopy q(c.q), kc(c.k_cache), vc(c.v_cache), lens(c.cache_lens_t), table(c.block_table_t),
      out(c.out), lse(c.lse), ks(c.k_scale), vs(c.v_scale);
  KVCacheArgs args = c.args();
  args.q = q.view();
  args.k_cache = kc.view();
  args.v_cache = vc.view();
  args.cache_seqlens = lens.view();
  args.block_table = table.view();
  args.k_scale = ks.view();
  args.v_scale = vs.view();
  Options opts = c.call_options();
  DeviceSink sink;
  sink.attach(c.sink, opts, false);
  ASSERT_NO_THROW(kvcache_forward(args, out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
  expect_forward_matches(c.problem(), cfg.dtype, forward_results(c));
}

// A sink on the host with q on the device: a clear error naming the argument.
TEST(CudaSink, HostSinkIsRejected) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 8, 8, 2, 1, 64), DType::kFloat16);
  c.sink.set({0.0f, 1.0f});
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse);
  Options opts = c.call_options();  // learnable_sink: the host tensor
  try {
    flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), opts);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "opts.learnable_sink");
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flashattn::test
