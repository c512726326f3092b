// CUDA KV-cache calls whose v has its own head dim (d_v != d; DeepSeek-V3's (192, 128),
// issue 22). The decode kernel has one head dim, so these calls run the fused forward: the
// sm90 forward where it takes the call (on an H100 / H200), else the sm80 forward in the
// bucket of max(d, d_v); num_splits is a hint they do not use. Each case runs on every
// kernel family this GPU runs (opts.kernel_family) and on the CPU backend
// (kvcache_runs.hpp: check_case): the caches after the append (K rows of d, V rows of d_v)
// bitwise equal, the outputs (NaN-poisoned before) against the fp64 oracle under the
// suite's tolerance rule. Features: dense and paged caches (blocks of 16, 40 and 3, shared
// prefix blocks), appends, cache_batch_idx over spare rows, causal, sliding windows, GQA /
// MQA, learnable sinks, softcap with ALiBi; s_q 1 (decode-shaped), 37 and 6; odd lengths.
// fp8 caches and draft-tree masks, which only the decode kernel runs, are Unsupported naming
// v_cache, from kvcache_workspace_size and from the call, before the append (caches unchanged).
#include <cuda_runtime.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "cuda/kvcache_runs.hpp"
#include "flashattn/error.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using ::testing::HasSubstr;

struct HeadDims {
  int d, d_v;
};

enum class Feature { kDense, kPaged, kAppend, kBatchIdx, kCausal, kWindow, kGqa, kSinks, kSoftcapAlibi };

const char* feature_name(Feature f) {
  switch (f) {
    case Feature::kDense: return "dense";
    case Feature::kPaged: return "paged";
    case Feature::kAppend: return "append";
    case Feature::kBatchIdx: return "batch_idx";
    case Feature::kCausal: return "causal";
    case Feature::kWindow: return "window";
    case Feature::kGqa: return "gqa";
    case Feature::kSinks: return "sinks";
    case Feature::kSoftcapAlibi: return "softcap_alibi";
  }
  return "?";
}

void PrintTo(const HeadDims& hd, std::ostream* os) { *os << "d " << hd.d << " d_v " << hd.d_v; }
void PrintTo(Feature f, std::ostream* os) { *os << feature_name(f); }

bool built(int d, int d_v) {
  return detail::cuda::supports_head_dim(d) && detail::cuda::supports_head_dim(d_v) &&
         detail::cuda::supports_head_dim(std::max(d, d_v));
}

// Case `it` (0, 1, 2) of a feature: s_q 1 / 37 / 6, fp16 / bf16 / bf16, num_splits 1 / 3 / 0
// (a hint the fused forward does not use), three sequences with odd cache lengths (one
// empty where nothing is appended).
KVCacheCase make_case(Rng& rng, HeadDims hd, Feature f, int it) {
  KVCacheConfig cfg;
  cfg.dtype = it == 0 ? DType::kFloat16 : DType::kBFloat16;
  cfg.batch = 3;
  cfg.h_q = cfg.h_k = 2;
  cfg.d = hd.d;
  cfg.d_v = hd.d_v;
  cfg.s_q = it == 0 ? 1 : it == 1 ? 37 : 6;
  cfg.max_cache_len = 300;
  cfg.cache_lens = {2 * uniform_int(rng, 0, 149) + 1, uniform_int(rng, 0, 3) == 0 ? 0 : 2 * uniform_int(rng, 0, 20) + 1,
                    2 * uniform_int(rng, 64, 140) + 1};
  const int blocks[3] = {16, 40, 3};  // whole sm90 chunks, a gcd of 8 / 40 rows, cp.async (sm80)
  bool causal = false;
  switch (f) {
    case Feature::kDense:
      break;
    case Feature::kPaged:
      cfg.block_size = blocks[it];
      if (it == 1) cfg.cache_lens[1] = 2 * uniform_int(rng, 45, 120) + 1;
      random_cache_layout(cfg, it == 1);  // sequence 1 shares sequence 0's prefix blocks
      break;
    case Feature::kAppend:
      cfg.s_new = it == 0 ? 1 : it == 1 ? cfg.s_q : 3;
      cfg.block_size = it == 0 ? 0 : blocks[it - 1];
      break;
    case Feature::kBatchIdx:
      cfg.s_new = it == 1 ? cfg.s_q : 1;
      random_cache_layout(cfg, false);  // dense: batch + 2 cache rows, longer than needed
      break;
    case Feature::kCausal:
      cfg.s_new = cfg.s_q;
      cfg.block_size = it == 1 ? 16 : 0;
      causal = true;
      break;
    case Feature::kWindow:
      cfg.s_new = it == 2 ? 2 : 0;
      cfg.block_size = it == 2 ? 40 : 0;
      break;
    case Feature::kGqa:
      cfg.h_k = it == 2 ? 1 : 2;
      cfg.h_q = cfg.h_k * (it == 0 ? 8 : it == 1 ? 4 : 12);
      cfg.s_new = 1;
      cfg.block_size = it == 1 ? 16 : 0;
      causal = it != 0;
      break;
    case Feature::kSinks:
      cfg.h_q = 8;
      cfg.s_new = 1;
      cfg.block_size = it == 2 ? 16 : 0;
      causal = true;
      break;
    case Feature::kSoftcapAlibi:
      cfg.s_new = it == 1 ? 1 : 0;
      cfg.block_size = it == 1 ? 16 : 0;
      causal = it == 1;
      break;
  }
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = causal;
  if (f == Feature::kWindow) {
    c.opts.window_left = it == 0 ? 33 : 2 * uniform_int(rng, 0, 60) + 1;
    c.opts.window_right = it == 0 ? -1 : it == 1 ? 0 : 5;
  }
  if (f == Feature::kSinks) {
    c.sink.want_grad = false;  // a forward
    c.sink.set(random_sink(rng, cfg.h_q));
    if (it == 1) c.opts.window_left = 101;
  }
  if (f == Feature::kSoftcapAlibi) {
    c.opts.softcap = 5.0f;
    c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, it == 2), it == 2);
  }
  c.num_splits = it == 0 ? 1 : it == 1 ? 3 : 0;
  return c;
}

class CudaKVCacheHeadDimV : public ::testing::TestWithParam<std::tuple<HeadDims, Feature>> {};

TEST_P(CudaKVCacheHeadDimV, MatchesCpuAndOracle) {
  FA_REQUIRE_GPU();
  const auto [hd, feature] = GetParam();
  if (!built(hd.d, hd.d_v)) GTEST_SKIP() << "head dims " << hd.d << ", " << hd.d_v << " not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (int it = 0; it < 3; ++it) {
      KVCacheCase c = make_case(rng, hd, feature, it);
      c.opts.kernel_family = family;
      ASSERT_EQ(c.v_cache.size(3), hd.d_v);
      SCOPED_TRACE(std::string(family_str(family)) + " case " + std::to_string(it));
      check_case(c);
    }
  }
}

const HeadDims kHeadDims[] = {{192, 128}, {128, 64}, {64, 128}, {256, 128}, {96, 160}};
const Feature kFeatures[] = {Feature::kDense,  Feature::kPaged,  Feature::kAppend,
                             Feature::kBatchIdx, Feature::kCausal, Feature::kWindow,
                             Feature::kGqa,    Feature::kSinks,  Feature::kSoftcapAlibi};

INSTANTIATE_TEST_SUITE_P(Cuda, CudaKVCacheHeadDimV,
                         ::testing::Combine(::testing::ValuesIn(kHeadDims), ::testing::ValuesIn(kFeatures)),
                         [](const ::testing::TestParamInfo<std::tuple<HeadDims, Feature>>& i) {
                           const HeadDims hd = std::get<0>(i.param);
                           return "d" + std::to_string(hd.d) + "_dv" + std::to_string(hd.d_v) + "_" +
                                  feature_name(std::get<1>(i.param));
                         });

// A decode step (s_q 1, one appended token, GQA, paged) captured into a CUDA graph with a
// caller workspace (the index contents then are checked on the device) replays to the bits
// of the direct call, on every family.
TEST(CudaKVCacheHeadDimVGraph, CaptureReplaysTheDirectCall) {
  FA_REQUIRE_GPU();
  if (!built(192, 128)) GTEST_SKIP() << "head dims 192, 128 not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    KVCacheConfig cfg;
    cfg.dtype = DType::kBFloat16;
    cfg.batch = 3;
    cfg.h_q = 16;
    cfg.h_k = 2;
    cfg.s_q = 1;
    cfg.s_new = 1;
    cfg.d = 192;
    cfg.d_v = 128;
    cfg.cache_lens = {977, 0, 301};
    cfg.block_size = 16;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    c.opts.kernel_family = family;
    c.num_splits = 0;
    SCOPED_TRACE(std::string(family_str(family)) + " " + describe_case(c));
    ReplayedCache v;
    expect_replay_gives_direct_bits(c, ReplayCache::kV, &v);
    EXPECT_TRUE(v.graph.bitwise_equal(c.v_cache_expected)) << "v_cache after the append";
    expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
  }
}

// ---------------------------------------------------------------- what the decode kernel alone runs

// An fp8 cache or a draft-tree mask with d_v != d: Unsupported naming v_cache (expected
// d_v == d, got d_v), from kvcache_workspace_size and from kvcache_forward, before the
// call appends (caches unchanged, out not written).
void expect_declined_before_the_append(KVCacheCase& c, const std::string& what) {
  SCOPED_TRACE(describe_case(c));
  auto expect_message = [&](const Unsupported& e) {
    EXPECT_EQ(e.argument(), "v_cache");
    EXPECT_THAT(e.what(), HasSubstr("expected head dim d_v == d = " + std::to_string(c.cfg.d) + " with "));
    EXPECT_THAT(e.what(), HasSubstr(what));
    EXPECT_THAT(e.what(), HasSubstr("got d_v = " + std::to_string(c.cfg.dv())));
  };
  expect_declined(c, expect_message, what + " with d_v != d");
}

TEST(CudaKVCacheHeadDimVErrors, Fp8CacheIsUnsupportedBeforeTheAppend) {
  FA_REQUIRE_GPU();
  if (!built(192, 128)) GTEST_SKIP() << "head dims 192, 128 not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (bool per_block : {false, true}) {
      KVCacheConfig cfg;
      cfg.dtype = DType::kBFloat16;
      cfg.fp8 = true;
      cfg.per_block_scales = per_block;
      cfg.batch = 2;
      cfg.h_q = 8;
      cfg.h_k = 2;
      cfg.s_q = 1;
      cfg.s_new = 1;
      cfg.d = 192;
      cfg.d_v = 128;
      cfg.max_cache_len = 200;
      cfg.block_size = per_block ? 16 : 0;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.opts.kernel_family = family;
      expect_declined_before_the_append(c, "a float8_e4m3 cache");
    }
  }
}

TEST(CudaKVCacheHeadDimVErrors, TreeMaskIsUnsupportedBeforeTheAppend) {
  FA_REQUIRE_GPU();
  if (!built(128, 64)) GTEST_SKIP() << "head dims 128, 64 not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (bool fp8 : {false, true}) {
      KVCacheConfig cfg;
      cfg.dtype = DType::kFloat16;
      cfg.fp8 = fp8;
      cfg.batch = 2;
      cfg.h_q = 4;
      cfg.h_k = 2;
      cfg.s_q = 5;
      cfg.s_new = cfg.s_q;  // the drafts are appended by the call
      cfg.d = 128;
      cfg.d_v = 64;
      cfg.max_cache_len = 150;
      cfg.block_size = fp8 ? 0 : 16;
      cfg.tree = KVCacheConfig::Tree::kRandom;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.opts.kernel_family = family;
      expect_declined_before_the_append(c, fp8 ? "a float8_e4m3 cache and a draft-tree mask (tree_mask)"
                                               : "a draft-tree mask (tree_mask)");
    }
  }
}

}  // namespace
}  // namespace flashattn::test
