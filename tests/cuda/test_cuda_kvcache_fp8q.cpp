// CUDA kvcache_forward with fp8 (e4m3) q over an fp8 cache, FlashAttention-3's fp8
// KV-cache call: q, k_cache, v_cache, k_new, v_new float8_e4m3 dequantized by
// Options::q_descale / k_descale / v_descale fp32 [b, h_k], out bfloat16 / float16, run by
// the decode kernel (q converted to f16 exactly; q_descale * k_descale in the softmax
// scale, v_descale in the output). Every case runs on the device and on the CPU backend
// (kvcache_runs.hpp: check_case): the caches after the append must be bitwise equal (the
// append copies the e4m3 bytes of k_new / v_new, which the case's expected caches hold at
// cache_seqlens), and out / lse are checked against the fp64 oracle over the dequantized
// inputs under the suite's tolerance rule, on NaN-poisoned outputs. Descales spread over
// 100x per (sequence, KV head), so that one read for the wrong sequence or head shows.
// Random paged (1, 16, 256, shared prefix blocks) and dense (cache_batch_idx) layouts, GQA
// 1 / 4 / 8, s_q 1..40 (causal with s_q > 1), window / softcap / ALiBi / sinks / draft
// trees, odd cache lengths (1, 77, 1000, 4097), splits 1 and > 1 agreeing, undefined
// descales (1), a decode step captured in a CUDA graph; and what stays Unsupported (d_v !=
// d naming v_cache, cache_leftpad, head dims above 512 naming q) or invalid (a descale
// that is not contiguous [b, h_k]), with nothing written.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/kvcache_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

// fp8 q with descales drawn from [0.002, 0.2] per (sequence, KV head).
KVCacheConfig fp8q_config(DType out) {
  KVCacheConfig cfg;
  cfg.fp8_q = true;
  cfg.dtype = out;
  cfg.scale_lo = 0.002;
  cfg.scale_hi = 0.2;
  return cfg;
}

// The process may run with a 99 KiB cap (FLASHATTN_SMEM_CAP): fp8 caches fit at every
// head dim up to 512 there (decode_dispatch.cu), so no case skips for it; the macro
// documents the assumption.
#define FA_FP8Q_FITS(d, tree, opts) FA_SKIP_UNLESS_KVCACHE_FITS(d, true, tree, opts)

TEST(CudaKVCacheFp8Q, RandomLayouts) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 30; ++it) {
    KVCacheConfig cfg = fp8q_config(it % 2 ? DType::kBFloat16 : DType::kFloat16);
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.h_k = pick(rng, {1, 2});
    cfg.h_q = cfg.h_k * pick(rng, {1, 4, 8});
    cfg.s_q = pick(rng, {1, 1, 2, 5, 13, 40});
    cfg.s_new = pick(rng, {0, 1, cfg.s_q});
    cfg.d = pick(rng, {64, 128, 80});  // fp8 rows: 16-byte multiples
    cfg.max_cache_len = pick(rng, {0, 37, 300, 1500});
    cfg.block_size = it % 5 == 4 ? 0 : pick(rng, {1, 16, 256});
    random_cache_layout(cfg, it % 3 == 0);
    if (it % 7 == 6) {
      cfg.tree = it % 2 ? KVCacheConfig::Tree::kRandom : KVCacheConfig::Tree::kLinear;
      cfg.s_new = cfg.s_q;  // the drafts are appended by the call
      random_cache_layout(cfg, false);
    }
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    FA_FP8Q_FITS(cfg.d, cfg.tree != KVCacheConfig::Tree::kNone, c.opts);
    c.opts.causal = cfg.s_q > 1 && it % 4 != 1;
    if (it % 6 == 3) c.opts.window_left = uniform_int(rng, 0, 200);
    if (it % 5 == 2) c.opts.softcap = 4.0f;
    if (it % 6 == 4) c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, it % 12 == 4), it % 12 == 4);
    if (it % 4 == 2) {
      c.sink.set(random_sink(rng, cfg.h_q));
      c.sink.want_grad = false;
    }
    c.num_splits = pick(rng, {1, 0, 0, 3, 17});
    check_case(c);
  }
}

// Odd cache lengths (1, 77, 1000, 4097: partial last tiles and blocks) under dense and paged
// (16, 256) caches, appending 1 or several tokens, GQA 1 / 4 / 8, both out dtypes.
TEST(CudaKVCacheFp8Q, OddLengthsAndAppends) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  int it = 0;
  for (int block_size : {0, 16, 256}) {
    for (int ratio : {1, 4, 8}) {
      KVCacheConfig cfg = fp8q_config(it++ % 2 ? DType::kBFloat16 : DType::kFloat16);
      cfg.batch = 4;
      cfg.h_k = 2;
      cfg.h_q = cfg.h_k * ratio;
      cfg.s_q = ratio == 4 ? 3 : 1;
      cfg.s_new = ratio == 1 ? 1 : ratio == 4 ? 3 : 5;
      cfg.d = ratio == 8 ? 64 : 128;
      cfg.cache_lens = {1, 77, 1000, 4097};
      cfg.block_size = block_size;
      random_cache_layout(cfg, block_size == 16);
      cfg.s_cache = block_size == 0 ? 4097 + cfg.s_new + 9 : 0;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.opts.causal = cfg.s_q > 1;
      c.num_splits = pick(rng, {1, 0, 5});
      check_case(c);
    }
  }
}

// Split counts from 1 to more than the key tiles (empty splits) agree with no split.
TEST(CudaKVCacheFp8Q, SplitsAgreeWithNoSplit) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (const auto [dtype, block_size] : {std::pair{DType::kBFloat16, 16}, std::pair{DType::kFloat16, 0}}) {
    KVCacheConfig cfg = fp8q_config(dtype);
    cfg.batch = 2;
    cfg.h_q = 16;
    cfg.h_k = 4;
    cfg.s_q = 2;
    cfg.s_new = 1;
    cfg.d = 128;
    cfg.cache_lens = {2500, 333};
    cfg.block_size = block_size;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    c.num_splits = 1;
    check_case(c);
    const ForwardResults base = forward_results(c);
    for (int splits : {2, 7, 0, 17, 64}) {
      c.num_splits = splits;
      check_case_agrees_with_no_split(c, base);
    }
  }
}

// Undefined descales are 1 (the kernel reads null pointers as 1): a case quantized with
// descale 1, the call given k_descale only.
TEST(CudaKVCacheFp8Q, UndefinedDescalesAreOne) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = fp8q_config(DType::kBFloat16);
  cfg.scale_lo = cfg.scale_hi = 1.0;
  cfg.batch = 2;
  cfg.s_q = 3;
  cfg.s_new = 2;
  cfg.h_q = 8;
  cfg.h_k = 2;
  cfg.d = 64;
  cfg.block_size = 16;
  cfg.max_cache_len = 300;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = true;
  SCOPED_TRACE(describe_case(c));
  DeviceCase dev(c);
  dev.reset(c);
  Options o = dev.opts;
  o.q_descale = Tensor{};
  o.v_descale = Tensor{};
  ASSERT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), o));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dev.out->download(c.out);
  dev.lse->download(c.lse);
  expect_forward_matches(c.problem(), cfg.dtype, forward_results(c));
  HostTensor k_after = c.k_cache;
  dev.kc->download(k_after);
  EXPECT_TRUE(k_after.bitwise_equal(c.k_cache_expected)) << "k_cache after the append";
}

// One decode step (bf16 out, 32 query heads over 8 KV heads, hdim 128, one token appended,
// paged) with the split heuristic and a caller workspace, captured and replayed: the same
// bits as the direct call (the workspace size asked under capture is the eager one).
TEST(CudaKVCacheFp8Q, GraphCaptureReplaysTheDirectCall) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = fp8q_config(DType::kBFloat16);
  cfg.batch = 3;
  cfg.h_q = 32;
  cfg.h_k = 8;
  cfg.s_q = 1;
  cfg.s_new = 1;
  cfg.d = 128;
  cfg.max_cache_len = 2000;
  cfg.block_size = 16;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.num_splits = 0;
  SCOPED_TRACE(describe_case(c));
  ReplayedCache k;
  expect_replay_gives_direct_bits(c, ReplayCache::kK, &k);
  EXPECT_TRUE(k.direct.bitwise_equal(c.k_cache_expected)) << "k_cache after the direct call's append";
  expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
}

// What the CUDA fp8-q call does not run: Unsupported naming the argument, from both entry
// points, before anything is written (expect_declined).
TEST(CudaKVCacheFp8Q, DeclinesNamingTheArgument) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  auto base = [] {
    KVCacheConfig cfg = fp8q_config(DType::kBFloat16);
    cfg.batch = 2;
    cfg.s_q = 1;
    cfg.s_new = 1;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 64;
    cfg.max_cache_len = 40;
    return cfg;
  };
  {  // v with its own head dim: the decode kernel has one.
    KVCacheConfig cfg = base();
    cfg.d_v = 128;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    expect_declined(
        c,
        [](const Unsupported& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("argument 'v_cache': expected head dim d_v == d = 64 with a float8_e4m3 cache"),
                    std::string::npos)
              << m;
          EXPECT_NE(m.find("got d_v = 128"), std::string::npos) << m;
        },
        "fp8 q with d_v != d");
  }
  {  // A left-padded cache: no CUDA KV-cache call takes one.
    KVCacheConfig cfg = base();
    cfg.leftpad = true;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    DeviceCase dev(c);
    DeviceCopy pad(c.leftpad_t);
    dev.args.cache_leftpad = pad.view();
    dev.reset(c);
    expect_declined(
        c, dev,
        [](const Unsupported& e) {
          EXPECT_NE(std::string(e.what()).find("argument 'cache_leftpad'"), std::string::npos) << e.what();
        },
        "fp8 q with cache_leftpad");
  }
  {  // Head dims above the largest bucket (512; test_cuda_kvcache_512.cpp runs fp8 q there)
    KVCacheConfig cfg = base();
    cfg.d = 528;
    cfg.max_cache_len = 8;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    expect_declined(
        c,
        [](const Unsupported& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("argument 'q'"), std::string::npos) << m;
          EXPECT_NE(m.find("d = 528"), std::string::npos) << m;
        },
        "fp8 q at d = 528");
  }
}

// The kernel reads a descale as descale[b * h_k + g]: one that is not contiguous [b, h_k]
// is an InvalidArgument naming it, before the append.
TEST(CudaKVCacheFp8Q, StridedDescaleIsInvalid) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = fp8q_config(DType::kFloat16);
  cfg.batch = 3;
  cfg.s_new = 1;
  cfg.h_q = 4;
  cfg.h_k = 2;
  cfg.d = 64;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  DeviceCase dev(c);
  dev.reset(c);
  HostTensor padded_h(DType::kFloat32, {cfg.batch, 4});
  padded_h.fill(0.5);
  DeviceCopy padded(padded_h);
  Options o = dev.opts;
  o.k_descale = Tensor::strided(padded.data(), DType::kFloat32, {cfg.batch, cfg.h_k}, {4, 1}, Device::cuda(0));
  try {
    kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), o);
    ADD_FAILURE() << "a descale with stride[0] 4 accepted";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("argument 'opts.k_descale': expected stride[0] == 2 (h_k: contiguous [b, h_k]"),
              std::string::npos)
        << m;
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor k_after = c.k_cache;
  dev.kc->download(k_after);
  EXPECT_TRUE(k_after.bitwise_equal(c.k_cache)) << "k_cache appended to by a rejected call";
}

}  // namespace
}  // namespace flashattn::test
