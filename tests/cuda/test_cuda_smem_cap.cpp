// CUDA KV-cache calls on GPUs with 99 KiB of shared memory per block (sm86 / sm89),
// emulated here with opts.smem_cap = 101376 and the sm80 family forced (issue 18). The
// decode kernel runs its small configuration (fewer stages) where its default does not
// fit (16-bit caches at d 64..128, fp8 caches above 128); 16-bit caches at d 160 .. 256 fit
// in no decode configuration and take the fused forward, except with a draft-tree mask, which
// only the decode kernel runs: an Unsupported error naming tree_mask, the bytes needed
// and the cap, raised before the call appends to the caches. Every case runs on the
// device and on the CPU backend against the fp64 oracle under the suite's tolerance rule
// (check_case, kvcache_runs.hpp), outputs NaN-poisoned: random dense and paged layouts,
// appends, splits (explicit, beyond the key tiles, and the heuristic), GQA, fp8 caches
// with per-head and per-block scales, sinks, masks, every head dim up to the largest
// bucket, odd ones too. The small configuration gives the default's bits (the same
// kernel but for its stage count), and the workspace a capped call reports is the one
// it needs, also under CUDA graph capture. FitsQuery needs no GPU. The 512 bucket within
// 99 KiB: test_cuda_kvcache_512.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/kvcache_runs.hpp"
#include "flashattn/error.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using ::testing::HasSubstr;

// The head-dim buckets the CUDA backend has (FLASHATTN_CUDA_BUCKETS up to 256); a d that
// this build has no bucket for runs in the next larger one, so every d up to the largest
// compiled bucket runs.
const int kBuckets[] = {32, 64, 96, 128, 160, 192, 224, 256};

// ---------------------------------------------------------------- the query (no GPU)

// decode_fits / kvcache_fits (core/backend.hpp) at 99 KiB: fp8 caches at every head dim,
// 16-bit ones up to 128, beyond which the fused forward serves calls without a tree mask
// up to 256, and again in the 512 bucket (d 264 .. 512: 16-key tiles); with the H100's or
// the A100's shared memory everything fits; head dims the build does not run fit nowhere.
TEST(CudaSmemCap, FitsQuery) {
  if (!detail::cuda::built()) GTEST_SKIP() << "no CUDA backend in this build";
  int checked = 0;
  for (int d = 8; d <= 520; d += 8) {
    if (!detail::cuda::supports_wide_head_dim(d)) {
      EXPECT_FALSE(detail::cuda::decode_fits(d, false, 0)) << d;
      EXPECT_FALSE(detail::cuda::decode_fits(d, true, 0)) << d;
      EXPECT_FALSE(detail::cuda::kvcache_fits(d, false, false, 0)) << d;
      continue;
    }
    SCOPED_TRACE("d " + std::to_string(d));
    ++checked;
    EXPECT_EQ(detail::cuda::decode_fits(d, false, kCap99KiB), d <= 128 || d > 256);
    EXPECT_TRUE(detail::cuda::kvcache_fits(d, false, false, kCap99KiB));
    EXPECT_EQ(detail::cuda::kvcache_fits(d, false, true, kCap99KiB), d <= 128 || d > 256);
    if (d % 16 == 0) {
      EXPECT_TRUE(detail::cuda::decode_fits(d, true, kCap99KiB));
      EXPECT_TRUE(detail::cuda::kvcache_fits(d, true, true, kCap99KiB));
    }
    for (int limit : {0, 163 * 1024, 227 * 1024}) {  // none, A100, H100 / H200
      for (bool fp8 : {false, true}) {
        EXPECT_TRUE(detail::cuda::decode_fits(d, fp8, limit)) << limit;
        EXPECT_TRUE(detail::cuda::kvcache_fits(d, fp8, true, limit)) << limit;
      }
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_FALSE(detail::cuda::decode_fits(0, false, 0));
  EXPECT_FALSE(detail::cuda::decode_fits(520, true, 0));
}

// ---------------------------------------------------------------- random cases per head dim

class CudaSmemCapKVCache : public ::testing::TestWithParam<int> {};

TEST_P(CudaSmemCapKVCache, MatchesOracle) {
  FA_REQUIRE_GPU();
  const int bucket = GetParam();
  if (!detail::cuda::supports_head_dim(bucket)) GTEST_SKIP() << "head dim " << bucket << " above this build's buckets";
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 8; ++it) {
    KVCacheConfig cfg;
    cfg.dtype = it % 2 ? DType::kBFloat16 : DType::kFloat16;
    cfg.fp8 = it % 4 == 2 || it == 7;
    cfg.per_block_scales = cfg.fp8 && it == 7;
    // The bucket's own head dim, or an odd one below it (fp8 rows: 16-byte multiples).
    cfg.d = it % 3 == 1 ? bucket - (cfg.fp8 ? 16 : 8 * uniform_int(rng, 1, 3)) : bucket;
    cfg.d = std::max(cfg.d, cfg.fp8 ? 32 : 8);
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.h_k = pick(rng, {1, 2});
    cfg.h_q = cfg.h_k * pick(rng, {1, 4, 8});
    // 1..8 packed rows (the transposed kernel), more (16-row form), and past 128 (the fused
    // forward for 16-bit caches without splits).
    cfg.s_q = pick(rng, {1, 1, 3, 13, 33});
    cfg.s_new = pick(rng, {0, 1, cfg.s_q});
    cfg.max_cache_len = pick(rng, {0, 37, 300, 1100});
    cfg.block_size = it % 3 == 0 ? 0 : pick(rng, {1, 3, 16, 64, 256});
    check_random_case_at_99k(rng, cfg, it);
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaSmemCapKVCache, ::testing::ValuesIn(kBuckets),
                         [](const ::testing::TestParamInfo<int>& i) { return "d" + std::to_string(i.param); });

// ---------------------------------------------------------------- draft trees

// Tree masks run on the decode kernel alone: at 99 KiB with 16-bit caches up to d = 128
// and fp8 caches at every head dim; a 16-bit cache at d >= 160 is Unsupported naming
// tree_mask with the bytes needed and the cap, from kvcache_workspace_size and from the
// call, before the call appends to the caches (nothing written).
TEST(CudaSmemCap, TreeMasks) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  int large = 0;
  for (int d : kBuckets) {
    if (!detail::cuda::supports_head_dim(d)) continue;
    for (bool fp8 : {false, true}) {
      KVCacheConfig cfg;
      cfg.dtype = fp8 || d % 64 == 0 ? DType::kBFloat16 : DType::kFloat16;
      cfg.fp8 = fp8;
      cfg.batch = 2;
      cfg.h_k = 2;
      cfg.h_q = cfg.h_k * pick(rng, {1, 4});
      cfg.s_q = pick(rng, {4, 33});
      cfg.s_new = cfg.s_q;  // the drafts are appended by the call
      cfg.d = d;
      cfg.max_cache_len = 400;
      cfg.block_size = fp8 ? 16 : 0;
      cfg.tree = KVCacheConfig::Tree::kRandom;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.num_splits = pick(rng, {1, 0, 3});
      cap_99k(c.opts);
      if (fp8 || d <= 128) {
        check_case(c);
        continue;
      }
      ++large;
      SCOPED_TRACE(describe_case(c));
      auto expect_message = [&](const Unsupported& e) {
        EXPECT_EQ(e.argument(), "tree_mask");
        EXPECT_THAT(e.what(), HasSubstr("bytes of shared memory per block for the decode kernel of head dim " +
                                        std::to_string(d)));
        EXPECT_THAT(e.what(), HasSubstr("got 101376 bytes"));
      };
      expect_declined(c, expect_message, "a tree mask at d = " + std::to_string(d) + " within 99 KiB");
    }
  }
  if (large == 0) GTEST_LOG_(INFO) << "no head dim above 128 in this build: the Unsupported case not run";
}

// ---------------------------------------------------------------- same bits as the default

// Where the small configuration is a kernel of its own (16-bit caches at d 64..128 with
// more than 8 packed rows; fp8 caches above 128) it computes the default's bits: the
// capped call and one with the device's whole shared memory give the same out and lse
// for a fixed split count (the heuristic's counts may differ), dense (TMA on sm90) and
// paged with blocks of 1 (cp.async).
TEST(CudaSmemCap, SmallDecodeGivesTheDefaultsBits) {
  FA_REQUIRE_GPU();
  int optin = 0;  // a 99 KiB GPU runs the small configuration twice
  FA_CUDA_OK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  FA_SEEDED_RNG(rng);
  struct Row {
    int d;
    bool fp8;
    int h_ratio, s_q;
  };
  int ran = 0;
  for (const Row r : {Row{64, false, 4, 4}, Row{128, false, 8, 3}, Row{96, false, 1, 20}, Row{192, true, 4, 1},
                      Row{256, true, 8, 2}, Row{160, true, 1, 1}}) {
    if (!detail::cuda::supports_head_dim(r.d)) continue;
    for (int block_size : {0, 1}) {
      for (int splits : {1, 3}) {
        KVCacheConfig cfg;
        cfg.dtype = r.d % 64 == 0 ? DType::kBFloat16 : DType::kFloat16;
        cfg.fp8 = r.fp8;
        cfg.batch = 2;
        cfg.h_k = 2;
        cfg.h_q = 2 * r.h_ratio;
        cfg.s_q = r.s_q;
        cfg.s_new = 1;
        cfg.d = r.d;
        cfg.cache_lens = {700, 301};
        cfg.block_size = block_size;
        KVCacheCase c = KVCacheCase::make(rng, cfg);
        c.opts.causal = true;
        c.num_splits = splits;
        SCOPED_TRACE(describe_case(c));
        check_capped_gives_default_bits(c, optin);
        ++ran;
      }
    }
  }
  EXPECT_GT(ran, 0);
}

// ---------------------------------------------------------------- workspace, CUDA graphs

// The workspace a capped call reports is what it needs (the small configuration's split
// heuristic counts more blocks per SM than the default's), the same during capture, and a
// captured call replays to the direct call's bits. 16-bit at d 128 (small decode
// configuration), 16-bit at the largest bucket above 128 (the fused forward: no
// workspace but the append check's verdict, num_splits unused) and fp8 there (small
// configuration).
TEST(CudaSmemCap, WorkspaceAndGraphCapture) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  std::vector<std::pair<int, bool>> rows;
  if (detail::cuda::supports_head_dim(128)) rows.push_back({128, false});
  for (int d : {256, 224, 192, 160}) {
    if (!detail::cuda::supports_head_dim(d)) continue;
    rows.push_back({d, false});
    rows.push_back({d, true});
    break;
  }
  for (const auto [d, fp8] : rows) {
    for (int splits : {0, 5, 11}) {  // sm90: 5 the cluster merge (no workspace), 11 the workspace's
      KVCacheConfig cfg;
      cfg.dtype = DType::kBFloat16;
      cfg.batch = 3;
      cfg.h_q = 32;
      cfg.h_k = 8;
      cfg.s_q = 3;  // 12 packed rows: the 16-row form, whose 16-bit d 128 is the small one
      cfg.s_new = 3;
      cfg.d = d;
      cfg.fp8 = fp8;
      cfg.max_cache_len = 2000;
      cfg.block_size = 16;
      check_capped_workspace_and_replay(rng, cfg, splits, [&](std::size_t ws_bytes) {
        // The append (s_new = 3, paged) ends the workspace with the device check's verdict.
        const std::size_t verdict = detail::cuda::kAppendVerdictBytes;
        if (!fp8 && d > 128) EXPECT_EQ(ws_bytes, verdict) << "the fused forward needs no workspace but the verdict";
        if (splits == 11 && (fp8 || d <= 128)) EXPECT_GT(ws_bytes, verdict);
      });
    }
  }
}

}  // namespace
}  // namespace flashattn::test
