// CUDA KV-cache calls at head dims above 256 (issue 22): d = d_v in 264 .. 512 run the
// decode kernel's 512 bucket (16-key tiles, the 4 warps splitting O's columns,
// decode_launch.hpp: kColGroups) with every feature it has below 256, and the fused
// forward's 512 bucket where the decode kernel leaves the call (d_v != d, more than 128
// GQA-packed rows without splits, fp8 or a tree). Every case runs on the device and on the
// CPU backend (kvcache_runs.hpp: check_case): the caches after the append bitwise equal,
// out and lse (NaN-poisoned before) against the fp64 oracle under the suite's tolerance
// rule. Head dims 288, 320, 384, 400 and 512; fp16 and bf16; dense caches through
// cache_batch_idx over spare rows, paged ones with blocks of 16 (tensor copies on sm90),
// 256, 3 (cp.async) and shared prefix blocks; appends of 1 and several tokens (speculative
// decoding: several query tokens, causal); GQA 1 .. 16 and MQA (the transposed and the
// 16-row forms, several row chunks); causal, sliding windows, softcap, ALiBi, learnable
// sinks; draft-tree masks; fp8 caches (per-head and per-block scales) and fp8 q; split
// counts 1, the heuristic and forced ones (the cluster merge on sm90, the workspace merge
// above 16 or the SMs), agreeing with no split; a decode step captured in a CUDA graph.
// On a 99 KiB GPU (opts.smem_cap = 101376, sm80 forced) the decode kernel fits (82 KiB;
// fp8 with 4 stages instead of 5, the default's bits) and takes every row count, and a
// call with d_v != d, which only the fused forward (112 KiB) runs, is Unsupported naming
// v_cache before the append. Skipped where the build has no 512 bucket (FLASHATTN_HEAD_DIMS).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/kvcache_runs.hpp"
#include "flashattn/error.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using ::testing::HasSubstr;

// The fused forward's tile in the 512 bucket (tile_size.hpp: 64 x 32, one K and one V
// buffer): the shared memory per block that KV-cache calls with d_v != d need above 256.
constexpr int kFused512Smem = 112 * 1024;

bool built_512() { return detail::cuda::supports_wide_head_dim(512); }

#define FA_REQUIRE_512()                                                          \
  do {                                                                            \
    FA_REQUIRE_GPU();                                                             \
    if (!built_512()) GTEST_SKIP() << "head-dim bucket 512 not in this build";    \
  } while (0)

// ---------------------------------------------------------------- the feature table

enum class Fp8 { kNone, kPerHead, kPerBlock, kQ };

struct Row {
  const char* name;
  int d;
  int batch, h_q, h_k, s_q, s_new;
  int block_size;  // 0: dense through cache_batch_idx over spare rows
  bool share;      // paged: sequence 1 shares sequence 0's prefix blocks
  std::vector<int> lens;
  bool causal;
  int left, right;
  float softcap;
  bool alibi, sink;
  Fp8 fp8;
  KVCacheConfig::Tree tree;
  std::vector<int> splits;
};

void PrintTo(const Row& r, std::ostream* os) { *os << r.name; }

KVCacheCase make_case(Rng& rng, const Row& r, DType dtype) {
  KVCacheConfig cfg;
  cfg.dtype = dtype;
  cfg.d = r.d;
  cfg.batch = r.batch;
  cfg.h_q = r.h_q;
  cfg.h_k = r.h_k;
  cfg.s_q = r.s_q;
  cfg.s_new = r.s_new;
  cfg.cache_lens = r.lens;
  cfg.max_cache_len = *std::max_element(r.lens.begin(), r.lens.end());
  cfg.block_size = r.block_size;
  cfg.fp8 = r.fp8 == Fp8::kPerHead || r.fp8 == Fp8::kPerBlock;
  cfg.per_block_scales = r.fp8 == Fp8::kPerBlock;
  if (r.fp8 == Fp8::kQ) {  // FlashAttention-3's descales, spread 100x per (sequence, KV head)
    cfg.fp8_q = true;
    cfg.scale_lo = 0.002;
    cfg.scale_hi = 0.2;
  }
  cfg.tree = r.tree;
  random_cache_layout(cfg, r.share);
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = r.causal;
  c.opts.window_left = r.left;
  c.opts.window_right = r.right;
  c.opts.softcap = r.softcap;
  if (r.alibi) c.set_alibi(random_alibi(rng, r.batch, r.h_q, false), false);
  if (r.sink) {
    c.sink.want_grad = false;  // a forward
    c.sink.set(random_sink(rng, r.h_q));
  }
  return c;
}

class CudaKVCache512 : public ::testing::TestWithParam<Row> {};

// Each row in fp16 and bf16 (fp8 q: out in each), for each of its split counts, under the
// process's kernel family and shared-memory cap (FLASHATTN_KERNEL_FAMILY / _SMEM_CAP: every
// row fits 99 KiB).
TEST_P(CudaKVCache512, MatchesCpuAndOracle) {
  FA_REQUIRE_512();
  const Row& r = GetParam();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    KVCacheCase c = make_case(rng, r, dtype);
    const bool fp8 = r.fp8 != Fp8::kNone;
    FA_SKIP_UNLESS_KVCACHE_FITS(r.d, fp8, r.tree != KVCacheConfig::Tree::kNone, c.opts);
    for (int splits : r.splits) {
      c.num_splits = splits;
      check_case(c);
    }
  }
}

using Tree = KVCacheConfig::Tree;

// Lengths end inside the 16-key tiles and the blocks; 0 and 1 keys where nothing is
// appended to an empty cache are covered by the first rows.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaKVCache512,
    ::testing::Values(
        // One decode token, GQA 8 (8 packed rows: the transposed form), dense through
        // cache_batch_idx, an empty, a one-key and a long sequence.
        Row{"d512_dense_gqa8", 512, 3, 16, 2, 1, 1, 0, false, {0, 1, 777}, false, -1, -1, 0, false, false,
            Fp8::kNone, Tree::kNone, {1, 0, 3}},
        // Paged blocks of 16 (whole boxes on sm90) with shared prefix blocks, 2 tokens of GQA
        // 4, causal; 17 splits: the workspace merge on every GPU.
        Row{"d512_paged16_shared_causal", 512, 2, 8, 2, 2, 2, 16, true, {501, 333}, true, -1, -1, 0, false, false,
            Fp8::kNone, Tree::kNone, {1, 0, 17}},
        // Blocks of 256, 24 packed rows (the 16-row form, two row chunks), causal.
        Row{"d512_paged256_two_chunks", 512, 2, 8, 1, 3, 3, 256, false, {700, 37}, true, -1, -1, 0, false, false,
            Fp8::kNone, Tree::kNone, {1, 5}},
        // Blocks of 3 (cp.async on every GPU), MHA, a sliding window.
        Row{"d288_paged3_window", 288, 2, 4, 4, 1, 1, 3, false, {301, 95}, false, 100, 0, 0, false, false,
            Fp8::kNone, Tree::kNone, {1, 0}},
        // Speculative decoding: 5 query tokens appended and attended causally with a window
        // and softcap; 10 packed rows.
        Row{"d320_spec_window_softcap", 320, 2, 4, 2, 5, 5, 0, false, {411, 60}, true, 33, 0, 3.0f, false, false,
            Fp8::kNone, Tree::kNone, {1, 4}},
        // ALiBi and a learnable sink (lse includes it), GQA 4, blocks of 16; 8 splits: the
        // cluster merge on sm90.
        Row{"d384_alibi_sink", 384, 2, 8, 2, 1, 1, 16, false, {999, 260}, false, -1, -1, 0, true, true,
            Fp8::kNone, Tree::kNone, {1, 0, 8}},
        // MQA with 12 query heads (12 packed rows: the 16-row form), dense, an odd head dim.
        Row{"d400_mqa", 400, 2, 12, 1, 1, 1, 0, false, {555, 2}, false, -1, -1, 0, false, false, Fp8::kNone,
            Tree::kNone, {1, 2}},
        // GQA 16 over 9 tokens (144 packed rows): the fused forward without splits (the decode
        // kernel under a 99 KiB cap), the decode kernel with 3.
        Row{"d512_rows_over_128", 512, 1, 32, 2, 9, 9, 16, false, {300}, true, -1, -1, 0, false, false, Fp8::kNone,
            Tree::kNone, {1, 3}},
        // fp8 caches: per-head scales over blocks of 16, per-block scales over a dense cache.
        Row{"d512_fp8_per_head", 512, 2, 8, 2, 1, 1, 16, true, {640, 290}, false, -1, -1, 0, false, true,
            Fp8::kPerHead, Tree::kNone, {1, 0, 3}},
        Row{"d320_fp8_per_block_causal", 320, 2, 4, 2, 4, 4, 0, false, {250, 77}, true, -1, -1, 4.0f, false, false,
            Fp8::kPerBlock, Tree::kNone, {1, 17}},
        // fp8 q (FlashAttention-3's fp8 KV-cache call), out in the row's dtype.
        Row{"d512_fp8_q", 512, 2, 8, 2, 1, 1, 16, false, {480, 1}, false, -1, -1, 0, false, false, Fp8::kQ,
            Tree::kNone, {1, 0}},
        // Draft trees (the last s_q keys, appended by the call): linear and random, 16-bit and
        // fp8 caches, 33 drafts of GQA 2 (66 rows, 5 row chunks).
        Row{"d512_tree_linear", 512, 2, 4, 2, 4, 4, 0, false, {200, 0}, true, -1, -1, 0, false, false, Fp8::kNone,
            Tree::kLinear, {1, 3}},
        Row{"d512_tree_random_33", 512, 1, 4, 2, 33, 33, 16, false, {150}, false, -1, -1, 0, false, false,
            Fp8::kNone, Tree::kRandom, {1, 0}},
        Row{"d384_tree_fp8", 384, 2, 8, 2, 3, 3, 16, false, {180, 90}, false, -1, -1, 0, false, false, Fp8::kPerHead,
            Tree::kRandom, {1, 2}}),
    [](const ::testing::TestParamInfo<Row>& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------- d_v != d above 256

// v with its own head dim, the larger above 256: the fused forward's 512 bucket (the decode
// kernel has one head dim), dense and paged with appends, GQA, causal, a sink. Skipped
// where the process's cap leaves it no tile (FLASHATTN_SMEM_CAP; CudaKVCache512Cap99KiB
// checks the error).
TEST(CudaKVCache512, HeadDimVAbove256) {
  FA_REQUIRE_512();
  FA_SEEDED_RNG(rng);
  struct Dims {
    int d, d_v, block_size, s_q;
  };
  for (const Dims hd : {Dims{512, 256, 16, 1}, Dims{320, 512, 0, 3}, Dims{192, 512, 3, 1}, Dims{512, 64, 0, 6}}) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      KVCacheConfig cfg;
      cfg.dtype = dtype;
      cfg.batch = 2;
      cfg.h_q = 8;
      cfg.h_k = 2;
      cfg.s_q = hd.s_q;
      cfg.s_new = hd.s_q;
      cfg.d = hd.d;
      cfg.d_v = hd.d_v;
      cfg.cache_lens = {2 * uniform_int(rng, 100, 300) + 1, uniform_int(rng, 0, 40)};
      cfg.max_cache_len = 601;  // the dense cache's rows (random_cache_layout)
      cfg.block_size = hd.block_size;
      random_cache_layout(cfg, hd.block_size == 16);
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      if (smem_limit_of(c.opts) < kFused512Smem) {
        GTEST_SKIP() << "the fused forward's 512 tile needs " << kFused512Smem << " bytes of shared memory per block";
      }
      c.opts.causal = hd.s_q > 1;
      c.sink.want_grad = false;
      c.sink.set(random_sink(rng, cfg.h_q));
      c.num_splits = 3;  // a hint the fused forward does not use
      ASSERT_EQ(c.v_cache.size(3), hd.d_v);
      check_case(c);
    }
  }
}

// ---------------------------------------------------------------- splits

// Split counts from 2 to more than the key tiles agree with no split (out and lse), with
// no workspace wherever the plan takes the cluster merge (sm90), at d 512 (the transposed
// form) and 320 (16-row form, two row chunks, an fp8 cache).
TEST(CudaKVCache512, SplitsAgreeWithNoSplit) {
  FA_REQUIRE_512();
  FA_SEEDED_RNG(rng);
  int dev = 0, sms = 0;
  FA_CUDA_OK(cudaGetDevice(&dev));
  FA_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  struct Shape {
    DType dtype;
    int d, h_q, h_k, s_q;
    std::vector<int> lens;
    bool fp8;
  };
  for (const Shape& sh : {Shape{DType::kBFloat16, 512, 16, 4, 1, {1201, 333}, false},
                          Shape{DType::kFloat16, 320, 16, 2, 3, {901}, true}}) {
    KVCacheConfig cfg;
    cfg.dtype = sh.dtype;
    cfg.batch = static_cast<int>(sh.lens.size());
    cfg.h_q = sh.h_q;
    cfg.h_k = sh.h_k;
    cfg.s_q = sh.s_q;
    cfg.s_new = 1;
    cfg.d = sh.d;
    cfg.fp8 = sh.fp8;
    cfg.cache_lens = sh.lens;
    cfg.block_size = 16;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    c.sink.want_grad = false;
    c.sink.set(random_sink(rng, cfg.h_q));
    c.num_splits = 1;
    check_case(c);
    const ForwardResults base = forward_results(c);
    for (int splits : {2, 7, 8, 9, 16, 17, 31, 64, 0}) {
      c.num_splits = splits;
      SCOPED_TRACE(describe_case(c));
      // The append to blocks ends the workspace with the device check's verdict.
      if (splits > 0) {
        expect_workspace_follows_clusters(c, dev, sms, detail::cuda::kAppendVerdictBytes, smem_limit_of(c.opts));
      }
      check_case_agrees_with_no_split(c, base);
    }
  }
}

// ---------------------------------------------------------------- CUDA graphs

// A decode step at d 512 (bf16, 32 query heads over 8 KV heads, one appended token, blocks
// of 16) with the heuristic's splits and a caller workspace, captured and replayed: the
// workspace size asked under capture is the eager one and the replay gives the direct
// call's bits (out, lse, the appended cache).
TEST(CudaKVCache512, GraphCaptureReplaysTheDirectCall) {
  FA_REQUIRE_512();
  FA_SEEDED_RNG(rng);
  for (bool fp8 : {false, true}) {
    KVCacheConfig cfg;
    cfg.dtype = DType::kBFloat16;
    cfg.batch = 2;
    cfg.h_q = 32;
    cfg.h_k = 8;
    cfg.s_q = 1;
    cfg.s_new = 1;
    cfg.d = 512;
    cfg.fp8 = fp8;
    cfg.cache_lens = {1500, 97};
    cfg.block_size = 16;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.num_splits = 0;
    SCOPED_TRACE(describe_case(c));
    ReplayedCache k;
    expect_replay_gives_direct_bits(c, ReplayCache::kK, &k);
    EXPECT_TRUE(k.graph.bitwise_equal(c.k_cache_expected)) << "k_cache after the append";
    expect_written_and_matching(c, c.problem());
  }
}

// ---------------------------------------------------------------- 99 KiB of shared memory

// Random cases within 99 KiB (sm80 forced): the decode kernel runs every row count (also
// above 128 packed rows, which the fused forward would take with more shared memory),
// 16-bit and fp8 caches, trees, splits, dense and paged, at d 264 .. 512.
TEST(CudaKVCache512Cap99KiB, RandomCasesMatchCpuAndOracle) {
  FA_REQUIRE_512();
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 10; ++it) {
    KVCacheConfig cfg;
    cfg.dtype = it % 2 ? DType::kBFloat16 : DType::kFloat16;
    cfg.fp8 = it % 4 == 2;
    cfg.per_block_scales = cfg.fp8 && it >= 6;
    // fp8 rows: 16-byte multiples.
    cfg.d = cfg.fp8 ? pick(rng, {272, 320, 400, 512}) : pick(rng, {264, 320, 400, 512, 512});
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.h_k = pick(rng, {1, 2});
    cfg.h_q = cfg.h_k * pick(rng, {1, 4, 8, 16});
    cfg.s_q = it == 3 ? 9 : pick(rng, {1, 1, 3, 13});  // it 3: 9 tokens, up to 144 rows
    cfg.s_new = pick(rng, {0, 1, cfg.s_q});
    if (it == 5) {
      cfg.tree = KVCacheConfig::Tree::kRandom;
      cfg.s_new = cfg.s_q;
    }
    cfg.max_cache_len = pick(rng, {0, 37, 300, 900});
    cfg.block_size = it % 3 == 0 ? 0 : pick(rng, {1, 16, 64, 256});
    check_random_case_at_99k(rng, cfg, it);
  }
}

// fp8 caches at d 512 have a small configuration of their own within 99 KiB (4 stages
// instead of 5): the capped call gives the bits of one with the device's whole shared
// memory, for a fixed split count, dense (tensor copies on sm90) and paged with blocks of
// 1 (cp.async); 16-bit caches have one configuration (82 KiB) and give its bits.
TEST(CudaKVCache512Cap99KiB, SmallDecodeGivesTheDefaultsBits) {
  FA_REQUIRE_512();
  int optin = 0;  // a 99 KiB GPU runs the small configuration twice
  FA_CUDA_OK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  FA_SEEDED_RNG(rng);
  for (bool fp8 : {true, false}) {
    for (int block_size : {0, 1}) {
      for (int splits : {1, 3}) {
        KVCacheConfig cfg;
        cfg.dtype = DType::kBFloat16;
        cfg.fp8 = fp8;
        cfg.batch = 2;
        cfg.h_k = 2;
        // 2 packed rows (the transposed form), 12 and 8 (the 16-row form, fp8 dense; and 16-bit)
        cfg.h_q = fp8 ? (block_size == 0 ? 24 : 4) : 16;
        cfg.s_q = 1;
        cfg.s_new = 1;
        cfg.d = 512;
        cfg.cache_lens = {700, 301};
        cfg.block_size = block_size;
        KVCacheCase c = KVCacheCase::make(rng, cfg);
        c.num_splits = splits;
        SCOPED_TRACE(describe_case(c));
        check_capped_gives_default_bits(c, optin);
      }
    }
  }
}

// d_v != d above 256 within 99 KiB: only the fused forward runs it and its 512 tile needs
// 112 KiB: Unsupported naming v_cache, the bytes needed and the cap, from
// kvcache_workspace_size and from the call, before the append (caches and out unchanged).
TEST(CudaKVCache512Cap99KiB, HeadDimVIsUnsupportedBeforeTheAppend) {
  FA_REQUIRE_512();
  FA_SEEDED_RNG(rng);
  struct Dims {
    int d, d_v;
  };
  for (const Dims hd : {Dims{512, 256}, Dims{128, 320}}) {
    KVCacheConfig cfg;
    cfg.dtype = DType::kFloat16;
    cfg.batch = 2;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.s_q = 1;
    cfg.s_new = 1;
    cfg.d = hd.d;
    cfg.d_v = hd.d_v;
    cfg.max_cache_len = 90;
    cfg.block_size = 16;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    cap_99k(c.opts);
    SCOPED_TRACE(describe_case(c));
    auto expect_message = [&](const Unsupported& e) {
      EXPECT_EQ(e.argument(), "v_cache");
      EXPECT_THAT(e.what(), HasSubstr("expected head dim d_v == d = " + std::to_string(hd.d)));
      EXPECT_THAT(e.what(), HasSubstr("at least " + std::to_string(kFused512Smem) +
                                      " bytes of shared memory per block for the fused forward"));
      EXPECT_THAT(e.what(),
                  HasSubstr("got d_v = " + std::to_string(hd.d_v) + " with " + std::to_string(kCap99KiB) + " bytes"));
    };
    expect_declined(c, expect_message, "d_v != d above 256 within 99 KiB");
  }
}

// The workspace a capped call reports is the one it needs (fp8 at d 512: the small
// configuration's split heuristic), the same under capture, and the capture replays to
// the direct call's bits; 16-bit at 512 with 144 packed rows runs the decode kernel there
// (its splits' workspace, where the fused forward would need none).
TEST(CudaKVCache512Cap99KiB, WorkspaceAndGraphCapture) {
  FA_REQUIRE_512();
  FA_SEEDED_RNG(rng);
  for (const bool fp8 : {true, false}) {
    for (int splits : {0, 5, 11}) {
      KVCacheConfig cfg;
      cfg.dtype = DType::kBFloat16;
      cfg.batch = 2;
      cfg.h_q = 32;
      cfg.h_k = fp8 ? 8 : 2;
      cfg.s_q = fp8 ? 1 : 9;  // 16-bit: 144 packed rows
      cfg.s_new = 1;
      cfg.d = 512;
      cfg.fp8 = fp8;
      cfg.cache_lens = {1100, 433};
      cfg.block_size = 16;
      check_capped_workspace_and_replay(rng, cfg, splits, [&](std::size_t ws_bytes) {
        if (splits == 11) EXPECT_GT(ws_bytes, detail::cuda::kAppendVerdictBytes) << "11 splits' partials";
      });
    }
  }
}

// ---------------------------------------------------------------- beyond the buckets

// Head dims above the largest compiled bucket are Unsupported naming q (520: beyond every
// build; 320 where the build has no 512 bucket), before the append.
TEST(CudaKVCache512Declined, AboveTheCompiledBuckets) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : {520, 320}) {
    if (d == 320 && built_512()) continue;
    KVCacheConfig cfg;
    cfg.dtype = DType::kBFloat16;
    cfg.batch = 2;
    cfg.h_q = 2;
    cfg.h_k = 1;
    cfg.s_q = 3;
    cfg.s_new = 3;
    cfg.d = d;
    cfg.max_cache_len = 20;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    SCOPED_TRACE(describe_case(c));
    auto expect_message = [&](const Unsupported& e) {
      EXPECT_EQ(e.argument(), "q");
      EXPECT_THAT(e.what(), HasSubstr("got d = " + std::to_string(d)));
    };
    expect_declined(c, expect_message, "d = " + std::to_string(d));
  }
}

}  // namespace
}  // namespace flashattn::test
