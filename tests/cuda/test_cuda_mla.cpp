// Multi-head latent attention (Options::qv, FlashAttention-3's qv) on CUDA: the sm80
// family's MLA kernel (src/cuda/sm80/mla_kernel.cuh), on every GPU. Each case runs on the
// device (inputs fresh random, out / lse NaN-poisoned) and on the CPU backend, which
// implements qv: KV-cache calls through kvcache_runs.hpp's check_case (the caches after
// the append bitwise equal, the outputs against the fp64 oracle under the suite's tolerance
// rule, lse included), the dense and varlen forward against the oracle the same way.
// Shapes: DeepSeek-V3 decode (d 64 rope, d_v 512 latent, h_k 1 under 1 / 16 / 128 query
// heads), odd cache lengths (0, 1, 77, 1000, 4097), dense caches (cache_batch_idx) and
// paged ones (blocks of 16, 64, 256), with and without appends, causal speculative rows
// (s_q > 1), splits forced (num_splits > 1) and chosen (0); d < 64 and d_v < 512 (zero
// padding). What the kernel does not cover is Unsupported naming the argument, before the
// append. Runs only with a GPU; skips without one.
#include <cuda_runtime.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "cuda/kvcache_runs.hpp"
#include "cuda/sm80/mla_launch.hpp"
#include "flashattn/error.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using ::testing::HasSubstr;

// The MLA kernel's shared memory per block (dynamic, plus 128 bytes of static: the split
// merge's flag): an A100 or H100 / H200, not a 99 KiB GPU or a run under FLASHATTN_SMEM_CAP.
constexpr int kMlaSmemNeed = detail::cuda::sm80::MlaTraits::kSmemBytes + 128;

#define FA_SKIP_UNLESS_MLA_FITS(opts)                                                                        \
  do {                                                                                                       \
    if (smem_limit_of(opts) < kMlaSmemNeed)                                                                  \
      GTEST_SKIP() << "the MLA kernel needs " << kMlaSmemNeed << " bytes of shared memory per block, over " \
                   << smem_limit_of(opts);                                                                   \
  } while (0)

struct MlaKV {
  const char* name;
  DType dtype;
  int batch, h_q, h_k, d, d_v, s_q, s_new;
  int block_size;  // 0: dense through cache_batch_idx over spare rows
  std::vector<int> lens;  // cache_seqlens (keys: + s_new)
  bool causal;
  int splits;  // num_splits (0: the heuristic)
};

void PrintTo(const MlaKV& m, std::ostream* os) { *os << m.name; }

const MlaKV kKVCases[] = {
    // DeepSeek-V3 decode: 128 query heads over one latent head, paged blocks of 64.
    {"decode_h128_paged64", DType::kBFloat16, 3, 128, 1, 64, 512, 1, 1, 64, {999, 76, 4096}, true, 0},
    {"decode_h128_paged64_split7", DType::kFloat16, 2, 128, 1, 64, 512, 1, 1, 64, {4096, 1000}, true, 7},
    // Tensor parallelism: 16 heads; blocks of 16; no append; forced splits over odd lengths.
    {"decode_h16_paged16_split5", DType::kFloat16, 2, 16, 1, 64, 512, 1, 0, 16, {77, 4097}, false, 5},
    {"decode_h16_paged16_auto", DType::kBFloat16, 3, 16, 1, 64, 512, 1, 1, 16, {0, 76, 1000}, true, 0},
    // One query head per KV head (h_ratio 1), dense caches.
    {"decode_h1_dense", DType::kBFloat16, 2, 1, 1, 64, 512, 1, 0, 0, {1, 1000}, false, 1},
    {"decode_h1_dense_split3", DType::kFloat16, 2, 1, 1, 64, 512, 1, 1, 0, {4096, 0}, true, 3},
    // Speculative decoding: s_q 3 causal, appended drafts, blocks of 256.
    {"spec_h128_paged256_causal", DType::kBFloat16, 2, 128, 1, 64, 512, 3, 3, 256, {997, 0}, true, 3},
    {"spec_h16_paged64_causal_auto", DType::kFloat16, 2, 16, 1, 64, 512, 4, 4, 64, {73, 4093}, true, 0},
    // Two KV heads, dense with an append, several chunks of 64 packed rows (s_q 5 x 32).
    {"h64_hk2_dense_append", DType::kFloat16, 2, 64, 2, 64, 512, 5, 5, 0, {2045, 500}, true, 0},
    // Smaller heads (zero padding of the rope and latent parts).
    {"d48_dv256_paged64", DType::kBFloat16, 2, 16, 1, 48, 256, 1, 1, 64, {999, 76}, true, 2},
    {"d32_dv136_dense", DType::kFloat16, 2, 8, 1, 32, 136, 2, 0, 0, {77, 300}, false, 1},
};

KVCacheCase make_kv_case(Rng& rng, const MlaKV& m) {
  KVCacheConfig cfg;
  cfg.dtype = m.dtype;
  cfg.batch = m.batch;
  cfg.h_q = m.h_q;
  cfg.h_k = m.h_k;
  cfg.d = m.d;
  cfg.d_v = m.d_v;
  cfg.qv = true;
  cfg.s_q = m.s_q;
  cfg.s_new = m.s_new;
  cfg.cache_lens = m.lens;
  cfg.max_cache_len = 0;
  for (int l : m.lens) cfg.max_cache_len = std::max(cfg.max_cache_len, l);
  cfg.block_size = m.block_size;
  random_cache_layout(cfg, m.block_size > 0 && m.batch > 1);
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = m.causal;
  c.num_splits = m.splits;
  return c;
}

class CudaMlaKVCache : public ::testing::TestWithParam<MlaKV> {};

TEST_P(CudaMlaKVCache, MatchesCpuAndOracle) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    KVCacheCase c = make_kv_case(rng, GetParam());
    c.opts.kernel_family = family;
    SCOPED_TRACE(family_str(family));
    check_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaMlaKVCache, ::testing::ValuesIn(kKVCases),
                         [](const ::testing::TestParamInfo<MlaKV>& i) { return std::string(i.param.name); });

// Masks and score options of the decode kernel's set: a sliding window, softcap with ALiBi,
// a learnable sink (with and without splits: the merge folds it in).
TEST(CudaMlaKVCacheOptions, WindowSoftcapAlibiSink) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 4; ++it) {
    MlaKV m{"options", it % 2 ? DType::kFloat16 : DType::kBFloat16, 2, 16, 1, 64, 512, 2, 2, 64, {500, 1000},
            true, it < 2 ? 1 : 4};
    KVCacheCase c = make_kv_case(rng, m);
    if (it == 0 || it == 2) c.opts.window_left = 2 * uniform_int(rng, 20, 200) + 1;
    if (it == 1 || it == 3) {
      c.opts.softcap = 5.0f;
      c.set_alibi(random_alibi(rng, m.batch, m.h_q, it == 3), it == 3);
    }
    c.sink.want_grad = false;
    c.sink.set(random_sink(rng, m.h_q));
    SCOPED_TRACE("case " + std::to_string(it));
    check_case(c);
  }
}

// Split counts (1, forced 2 / 7 / 64, the heuristic's 0) agree with the num_splits = 1 run
// within twice the tolerance rule's bound, each also against the oracle and the CPU.
TEST(CudaMlaKVCacheSplits, CountsAgree) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  const KVCacheCase base = make_kv_case(
      rng, {"splits", DType::kBFloat16, 2, 32, 1, 64, 512, 2, 2, 64, {3999, 75}, true, 1});
  const ForwardExpectation expect = ForwardExpectation::of(base.problem(), base.cfg.dtype);
  expect_split_counts_agree(base, expect, base.cfg.dtype, {1, 2, 7, 64, 0}, [](KVCacheCase& c) {
    check_case(c);
    return forward_results(c);
  });
}

// A decode step captured into a CUDA graph with a caller workspace sized by
// kvcache_workspace_size (shapes only) replays to the bits of the direct call.
TEST(CudaMlaKVCacheGraph, CaptureReplaysTheDirectCall) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  KVCacheCase c = make_kv_case(
      rng, {"graph", DType::kBFloat16, 2, 128, 1, 64, 512, 1, 1, 64, {4000, 301}, true, 0});
  SCOPED_TRACE(describe_case(c));
  DeviceCase dev(c);
  const std::size_t ws_bytes = kvcache_workspace_size(dev.args, dev.opts);
  void* ws = nullptr;
  if (ws_bytes) FA_CUDA_OK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Options opts = dev.opts;
  opts.stream = s;
  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {ws, ws_bytes}));
  FA_CUDA_OK(cudaStreamSynchronize(s));
  HostTensor out_direct = c.out, lse_direct = c.lse;
  dev.out->download(out_direct);
  dev.lse->download(lse_direct);
  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor out_graph = c.out, lse_graph = c.lse;
  capture_and_replay(dev, opts, ws, ws_bytes, s, out_graph, lse_graph);
  EXPECT_TRUE(out_graph.bitwise_equal(out_direct)) << "out: graph replay vs direct call";
  EXPECT_TRUE(lse_graph.bitwise_equal(lse_direct)) << "lse: graph replay vs direct call";
  c.out = out_graph;
  c.lse = lse_graph;
  expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
  cudaStreamDestroy(s);
  if (ws) cudaFree(ws);
}

// ---------------------------------------------------------------- forward / varlen_forward

void mla_forward(DenseCase& c, KernelFamily family) {
  c.poison_forward();
  DeviceCopy q(c.q), k(c.k), v(c.v), qv(c.qv), out(c.out), lse(c.lse);
  Options opts = c.call_options();
  opts.kernel_family = family;
  opts.qv = qv.view();
  ASSERT_NO_THROW(flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
}

TEST(CudaMlaForward, DenseMatchesOracle) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  // (b, s_q, s_k, h_q, h_k, d, d_v): prefill-like, GQA 16 and 1, odd lengths, s_q > s_k.
  // (Sized for the fp64 oracle's time: at {2, 77, 1000, 16, ...} and {2, 1, 4097, 128, ...}
  // this test took 97 s on the H100 machine, over the per-suite budget of scripts/gpu.sh;
  // 128 heads over 4k keys are the KV-cache cases' decode_h128_paged64.)
  const Shape shapes[] = {{1, 77, 600, 8, 1, 64, 512}, {1, 130, 77, 4, 2, 64, 512},
                          {1, 1, 4097, 32, 1, 64, 512}, {3, 33, 65, 2, 2, 40, 128}};
  for (KernelFamily family : gpu_families()) {
    for (const Shape& sh : shapes) {
      for (bool causal : {false, true}) {
        DenseCase c = DenseCase::random(rng, sh, coin(rng) ? DType::kBFloat16 : DType::kFloat16);
        c.set_qv(rng);
        c.opts.causal = causal;
        SCOPED_TRACE(std::string(family_str(family)) + " " + sh.str() + (causal ? " causal" : ""));
        mla_forward(c, family);
        const ForwardResults got = forward_results(c);
        EXPECT_TRUE(fully_written("out", got.out));
        EXPECT_TRUE(fully_written("lse", got.lse));
        expect_forward_matches(c.problem(), c.dtype, got);
      }
    }
  }
}

TEST(CudaMlaForward, VarlenMatchesOracle) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (bool causal : {false, true}) {
      VarlenCase c = VarlenCase::make(rng, {0, 1, 78, 78, 111}, {0, 1000, 1077, 1090, 1490}, 16, 1, 64,
                                      DType::kBFloat16, 3, 5, 512);
      c.set_qv(rng);
      c.opts.causal = causal;
      SCOPED_TRACE(std::string(family_str(family)) + (causal ? " causal" : ""));
      c.poison_forward();
      DeviceVarlen d(c);
      DeviceCopy qv(c.qv), out(c.out), lse(c.lse);
      Options opts = c.call_options();
      opts.kernel_family = family;
      opts.qv = qv.view();
      ASSERT_NO_THROW(flashattn::varlen_forward(d.args, out.view(), lse.view(), opts));
      FA_CUDA_OK(cudaDeviceSynchronize());
      out.download(c.out);
      lse.download(c.lse);
      expect_forward_matches(c.problem(), c.dtype, forward_results(c));
    }
  }
}

// ---------------------------------------------------------------- what the MLA kernel does not cover

// Unsupported naming `argument` (and saying `what`) from kvcache_workspace_size and from
// kvcache_forward, before the append (caches unchanged, out not written).
void expect_kv_declined(KVCacheCase& c, const std::string& argument, const std::string& what) {
  SCOPED_TRACE(describe_case(c) + " -> " + argument);
  DeviceCase dev(c);
  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  auto check = [&](const Unsupported& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(what));
  };
  expect_declined(c, dev, check, argument);
}

TEST(CudaMlaErrors, UnsupportedNamesTheArgument) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const MlaKV base{"errors", DType::kBFloat16, 2, 16, 1, 64, 512, 2, 2, 16, {100, 37}, true, 1};
  {  // the rope part past 64 dims
    MlaKV m = base;
    m.d = 128;
    KVCacheCase c = make_kv_case(rng, m);
    expect_kv_declined(c, "q", "got d = 128");
  }
  {  // an fp8 cache
    KVCacheConfig cfg = make_kv_case(rng, base).cfg;
    cfg.fp8 = true;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    expect_kv_declined(c, "k_cache", "got float8_e4m3");
  }
  {  // a draft-tree mask
    KVCacheConfig cfg = make_kv_case(rng, base).cfg;
    cfg.tree = KVCacheConfig::Tree::kLinear;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    expect_kv_declined(c, "tree_mask", "no draft-tree mask");
  }
  {  // a shared-memory cap below the kernel's need (a 99 KiB GPU)
    KVCacheCase c = make_kv_case(rng, base);
    c.opts.smem_cap = 101376;
    expect_kv_declined(c, "opts.qv", "got 101376 bytes");
  }
  {  // dropout in the dense forward
    DenseCase c = DenseCase::random(rng, Shape{1, 5, 40, 4, 1, 64, 512}, DType::kBFloat16);
    c.set_qv(rng);
    c.opts.dropout_p = 0.1f;
    DeviceCopy q(c.q), k(c.k), v(c.v), qv(c.qv), out(c.out), lse(c.lse);
    Options opts = c.call_options();
    opts.qv = qv.view();
    try {
      flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), opts);
      ADD_FAILURE() << "forward with qv and dropout accepted";
    } catch (const Unsupported& e) {
      EXPECT_EQ(e.argument(), "opts.dropout_p") << e.what();
    }
  }
  {  // float32 q (the kernel reads 16-bit tensors)
    DenseCase c = DenseCase::random(rng, Shape{1, 5, 40, 4, 1, 64, 512}, DType::kFloat32);
    c.set_qv(rng);
    DeviceCopy q(c.q), k(c.k), v(c.v), qv(c.qv), out(c.out), lse(c.lse);
    Options opts = c.call_options();
    opts.qv = qv.view();
    try {
      flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), opts);
      ADD_FAILURE() << "forward with qv and float32 q accepted";
    } catch (const Unsupported& e) {
      EXPECT_EQ(e.argument(), "q") << e.what();
      EXPECT_THAT(e.what(), HasSubstr("float32"));
    }
  }
}

}  // namespace
}  // namespace flashattn::test
