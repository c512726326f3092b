// Multi-head latent attention (Options::qv, FlashAttention-3's qv) on CUDA: both MLA
// kernels. Each case runs once per family of gpu_families() (opts.kernel_family sm80, and
// on an H100 / H200 also sm90): sm80 runs the sm80 family's MLA kernel
// (src/cuda/sm80/mla_kernel.cuh), sm90 the sm90 MLA kernel (src/cuda/sm90/mla_kernel.cuh:
// wgmma, TMA) where sm90::mla_unsupported takes the call, else the sm80 one; the cases
// without a family (options, splits, graph) run in the process's (auto: the sm90 kernel on
// an H100 / H200; FLASHATTN_KERNEL_FAMILY=sm80 the sm80 one). Each case runs on the device
// (inputs fresh random, out / lse NaN-poisoned, cache slots past the sequences NaN) and on
// the CPU backend, which implements qv: KV-cache calls through kvcache_runs.hpp's
// check_case (the caches after the append bitwise equal, the outputs against the fp64
// oracle under the suite's tolerance rule, lse included), the dense and varlen forward
// against the oracle the same way.
// Shapes: DeepSeek-V3 decode (d 64 rope, d_v 512 latent, h_k 1 under 1 / 16 / 128 query
// heads), odd cache lengths (0, 1, 63 / 64 / 65 at the sm90 kernel's tile edge, 77, 1000,
// 4097), dense caches (cache_batch_idx) and paged ones (blocks of 8, 16, 32, 48, 64, 256:
// the sm90 kernel's TMA boxes of gcd(block, 64) rows; blocks of 12 it declines to sm80),
// with and without appends, causal speculative rows (s_q > 1), splits forced (num_splits >
// 1) and chosen (0); d < 64 and d_v < 512 (zero padding). Which calls the sm90 kernel takes
// is checked on its own (CudaMlaSm90Dispatch). What the kernels do not cover is Unsupported
// naming the argument, before the append. Runs only with a GPU; skips without one.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
#include "cuda/sm90/mla.hpp"
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
    // The sm90 kernel's 64-key tiles: lengths at a tile's edge (the appended key included),
    // an empty sequence, TMA boxes of 32, 16 (blocks of 48: tiles across blocks) and 8 rows,
    // a dense cache with forced splits, 256 packed rows (4 row chunks).
    {"decode_h128_paged64_edges", DType::kBFloat16, 5, 128, 1, 64, 512, 1, 1, 64, {0, 62, 63, 64, 2047}, true, 1},
    {"decode_h128_paged32_split4", DType::kFloat16, 3, 128, 1, 64, 512, 1, 1, 32, {130, 0, 1999}, true, 4},
    {"spec_h128_paged48_causal", DType::kFloat16, 2, 128, 1, 64, 512, 2, 2, 48, {500, 97}, true, 3},
    {"decode_h128_paged8_auto", DType::kBFloat16, 2, 128, 1, 64, 512, 1, 0, 8, {257, 95}, false, 0},
    {"decode_h128_dense_split6", DType::kBFloat16, 2, 128, 1, 64, 512, 1, 1, 0, {3000, 129}, true, 6},
    {"spec_h128_dense_s2", DType::kFloat16, 2, 128, 1, 64, 512, 2, 2, 0, {1000, 64}, true, 1},
    // The sm90 kernel's consumers take alternate tiles: 1, 2, 3 and 4 tiles per split (one
    // consumer with no tile of its own; the last tile either's), the same over 3 splits.
    {"decode_h64_paged64_tile_counts", DType::kBFloat16, 4, 64, 1, 64, 512, 1, 1, 64, {63, 127, 191, 255}, true, 1},
    {"decode_h64_dense_tile_counts_split3", DType::kFloat16, 4, 64, 1, 64, 512, 1, 1, 0, {63, 191, 383, 511}, true, 3},
    // The sm90 kernel's round order (S of the own tile first when its stage has landed, else
    // P V of the other's tile first): 5 to 10 tiles in one split (odd counts: the last tile
    // consumer 0's; 2 mod 4 and 0 mod 4: consumer 1's), and 9 to 11 over 2 splits (5 / 4,
    // 5 / 5, 6 / 5 per split).
    {"decode_h64_paged64_tile_counts_5_10", DType::kFloat16, 6, 64, 1, 64, 512, 1, 1, 64,
     {319, 383, 447, 511, 575, 639}, true, 1},
    {"decode_h128_dense_tile_counts_split2", DType::kBFloat16, 3, 128, 1, 64, 512, 1, 1, 0, {575, 639, 703}, true, 2},
    // Blocks of 12 (boxes of gcd(12, 64) = 4 rows): the sm90 kernel declines, sm80 runs it.
    {"decode_h32_paged12_sm80", DType::kBFloat16, 2, 32, 1, 64, 512, 1, 1, 12, {100, 37}, true, 1},
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

// Scores that grow along the keys, so that the rows' reference max moves (the kernels'
// lazy rescale: by more than 2^8) every few tiles, in tiles of both sm90 consumers: each
// rescales its half of O by the factor the tile's owner hands over with P, whichever of
// S and the other's P V its round issues first. qv is made positive and every latent
// value of key j gets 0.003 j added (sequence 0: rising throughout; sequence 1: a
// sawtooth of 384 keys, the max rising, then falling behind and passed again); one split
// and three. No append (the caches are changed after the draw).
TEST(CudaMlaKVCacheRescale, GrowingScores) {
  FA_REQUIRE_GPU();
  FA_SKIP_UNLESS_MLA_FITS(Options{});
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 2; ++it) {
    const MlaKV m{"growing", it ? DType::kFloat16 : DType::kBFloat16, 2, 64, 1, 64, 512, 1, 0, 64, {1000, 777},
                  false, it ? 3 : 1};
    KVCacheCase base = make_kv_case(rng, m);
    for (std::int64_t i = 0; i < base.qv.numel(); ++i) base.qv.set(i, std::fabs(base.qv.get(i)));
    const std::int64_t width = std::int64_t(m.h_k) * m.d_v, rows_per = base.v_cache.size(1);
    // (A block shared by both sequences' prefixes takes sequence 0's bias, once.)
    std::vector<char> biased(static_cast<std::size_t>(base.v_cache.size(0) * rows_per), 0);
    for (int b = 0; b < m.batch; ++b) {
      for (int j = 0; j < base.cache_lens[static_cast<std::size_t>(b)]; ++j) {
        const double bias = 0.003 * (b == 0 ? j : j % 384);
        const auto [slot, row] = base.locate(b, j);
        const std::int64_t r = std::int64_t(slot) * rows_per + row;
        if (biased[static_cast<std::size_t>(r)]) continue;
        biased[static_cast<std::size_t>(r)] = 1;
        for (std::int64_t e = r * width; e < (r + 1) * width; ++e) base.v_cache.set(e, base.v_cache.get(e) + bias);
      }
    }
    base.v_cache_expected = base.v_cache;
    for (KernelFamily family : gpu_families()) {
      KVCacheCase c = base;
      c.opts.kernel_family = family;
      SCOPED_TRACE(std::string(family_str(family)) + (it ? " fp16, 3 splits" : " bf16, 1 split"));
      check_case(c);
    }
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
  expect_replay_gives_direct_bits(c);
  expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
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

// ---------------------------------------------------------------- which calls the sm90 kernel takes

// sm90::mla_unsupported (which dispatch.cu asks before running the sm90 MLA kernel) takes
// the call shapes of the suite above, so that their sm90 runs are the sm90 kernel's and
// not the sm80 fallback's, and leaves to the sm80 kernel what it does not cover: paged
// blocks whose gcd with 64 is below 8 (TMA boxes of 8 rows at least), an fp8 cache, d above
// 64, a shared-memory limit below its tiles, a K / V base or stride off 16 bytes. It reads
// no tensor: the pointers only need their alignment.
TEST(CudaMlaSm90Dispatch, TakesTheSuiteShapesDeclinesTheRest) {
  FA_REQUIRE_GPU();
  if (detail::cuda::compute_capability(0) != 90) GTEST_SKIP() << "the sm90 MLA kernel needs compute capability 9.0";
#if !FLASHATTN_WITH_SM90
  GTEST_SKIP() << "built without the sm90 family";
#endif
  void* buf = nullptr;
  FA_CUDA_OK(cudaMalloc(&buf, 4096));
  auto* base = static_cast<unsigned char*>(buf);
  using detail::FwdParams;
  namespace sm90 = detail::cuda::sm90;
  // A KV-cache decode call, DeepSeek-V3's shape: paged blocks of 64, 128 query heads.
  auto decode = [&](int block_size) {
    FwdParams p;
    p.device_index = 0;
    p.dtype = p.q_dtype = p.kv_dtype = DType::kBFloat16;
    p.batch = 2;
    p.h_q = 128;
    p.h_k = 1;
    p.h_ratio = 128;
    p.d = 64;
    p.d_v = 512;
    p.seqlen_q = 1;
    p.q = p.qv = p.out = base;
    p.k = base + 1024;
    p.v = base + 2048;
    p.cache_seqlens = reinterpret_cast<const int*>(base + 3072);
    p.k_row_stride = p.k_head_stride = p.d;
    p.v_row_stride = p.v_head_stride = p.d_v;
    if (block_size > 0) {
      p.block_table = reinterpret_cast<const int*>(base + 3584);
      p.block_size = p.kv_cache_len = block_size;
      p.kv_cache_rows = 64;
    } else {  // dense, over spare cache rows
      p.kv_cache_len = 3010;
      p.kv_cache_rows = 4;
    }
    p.k_batch_stride = std::int64_t(p.kv_cache_len) * p.k_row_stride;
    p.v_batch_stride = std::int64_t(p.kv_cache_len) * p.v_row_stride;
    return p;
  };
  for (int block : {0, 8, 16, 32, 48, 64, 256}) {
    SCOPED_TRACE("block_size " + std::to_string(block));
    const char* why = sm90::mla_unsupported(decode(block));
    EXPECT_EQ(why, nullptr) << why;
  }
  {  // d 32 / d_v 136, d 48 / d_v 256 (the suite's zero-padded heads)
    FwdParams p = decode(0);
    p.d = 32;
    p.d_v = 136;
    p.k_row_stride = p.k_head_stride = p.d;
    p.v_row_stride = p.v_head_stride = p.d_v;
    p.k_batch_stride = std::int64_t(p.kv_cache_len) * p.d;
    p.v_batch_stride = std::int64_t(p.kv_cache_len) * p.d_v;
    const char* why = sm90::mla_unsupported(p);
    EXPECT_EQ(why, nullptr) << why;
  }
  {  // the dense and the varlen forward
    FwdParams p = decode(0);
    p.cache_seqlens = nullptr;
    p.seqlen_k = 600;
    p.k_batch_stride = 600 * p.k_row_stride;
    p.v_batch_stride = 600 * p.v_row_stride;
    const char* why = sm90::mla_unsupported(p);
    EXPECT_EQ(why, nullptr) << why;
    p.cu_seqlens_q = p.cu_seqlens_k = reinterpret_cast<const int*>(base + 3072);
    p.total_q = 111;
    p.total_k = 1490;
    why = sm90::mla_unsupported(p);
    EXPECT_EQ(why, nullptr) << why;
  }
  auto declined = [&](const FwdParams& p, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_NE(sm90::mla_unsupported(p), nullptr);
  };
  declined(decode(12), "blocks of 12 (boxes of 4 rows)");
  declined(decode(20), "blocks of 20 (boxes of 4 rows)");
  {
    FwdParams p = decode(64);
    p.kv_dtype = DType::kFloat8E4M3;
    declined(p, "an fp8 cache");
  }
  {
    FwdParams p = decode(64);
    p.d = 128;
    declined(p, "d 128");
  }
  {
    FwdParams p = decode(64);
    p.smem_limit = 101376;
    declined(p, "a 99 KiB shared-memory limit");
  }
  {
    FwdParams p = decode(64);
    p.k = base + 1032;
    declined(p, "k 8 bytes off 16");
  }
  {
    FwdParams p = decode(64);
    p.v_row_stride = 516;
    declined(p, "v's row stride 1032 bytes");
  }
  cudaFree(buf);
}

// ---------------------------------------------------------------- what the MLA kernel does not cover

// Unsupported naming `argument` (and saying `what`) from kvcache_workspace_size and from
// kvcache_forward, before the append (caches unchanged, out not written).
void expect_kv_declined(KVCacheCase& c, const std::string& argument, const std::string& what) {
  SCOPED_TRACE(describe_case(c) + " -> " + argument);
  auto check = [&](const Unsupported& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(what));
  };
  expect_declined(c, check, argument);
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
