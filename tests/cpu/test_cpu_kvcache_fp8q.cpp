// CPU backend, kvcache_forward with fp8 (e4m3) q and an fp8 cache, FlashAttention-3's
// interface (issue 21): q, k_cache, v_cache, k_new, v_new float8_e4m3, dequantized by
// Options::q_descale / k_descale / v_descale fp32 [b, h_k] (one per sequence and KV head,
// whatever block or cache row holds a key), out bfloat16 / float16. Against the fp64
// oracle over the dequantized inputs (support/cases.hpp KVCacheConfig::fp8_q) on poisoned
// outputs: random paged layouts (shared blocks read under two sequences' descales) and
// dense caches with cache_batch_idx, the append (a byte copy, checked bytewise), split-KV,
// GQA / MQA, causal / window, softcap, ALiBi, leftpad, sinks, draft trees, odd head dims;
// descales spread over 100x so that a descale read for the wrong sequence or head shows;
// undefined descales are 1; and the argument rules (fp8 q needs an fp8 cache, takes no
// k_scale / v_scale, out bf16 / fp16, k_new fp8).
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "flashattn/semantics.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

std::string describe_case(const KVCacheCase& c) {
  const KVCacheConfig& k = c.cfg;
  std::string s = "fp8 q + fp8 cache (descales [b, h_k]); b=" + std::to_string(k.batch) +
                  " s_q=" + std::to_string(k.s_q) + " s_new=" + std::to_string(k.s_new) +
                  " h_q=" + std::to_string(k.h_q) + " h_k=" + std::to_string(k.h_k) +
                  " d=" + std::to_string(k.d) + " d_v=" + std::to_string(k.dv()) + " out " +
                  dtype_name(k.dtype) + " block_size=" + std::to_string(k.block_size) +
                  " shared=" + std::to_string(k.share_blocks) +
                  " batch_idx=" + std::to_string(k.use_batch_idx) +
                  " leftpad=" + std::to_string(k.leftpad) + " splits=" + std::to_string(c.num_splits) +
                  " cache_seqlens=";
  for (int len : c.cache_lens) s += std::to_string(len) + ",";
  return s + " " + describe(c.call_options());
}

ForwardResults check(KVCacheCase& c, const ForwardExpectation* expectation = nullptr) {
  SCOPED_TRACE(describe_case(c));
  return run_and_check_kvcache(c, expectation);
}

KVCacheConfig base_config() {
  KVCacheConfig cfg;
  cfg.fp8_q = true;
  cfg.dtype = DType::kBFloat16;
  // Descales over 100x: one read for the wrong sequence or KV head is visibly off.
  cfg.scale_lo = 0.002;
  cfg.scale_hi = 0.2;
  return cfg;
}

KVCacheConfig random_config(Rng& rng) {
  KVCacheConfig cfg = base_config();
  cfg.batch = uniform_int(rng, 1, 4);
  cfg.s_q = uniform_int(rng, 1, 7);
  cfg.s_new = coin(rng, 0.7) ? uniform_int(rng, 1, 6) : 0;
  cfg.h_k = uniform_int(rng, 1, 3);
  cfg.h_q = cfg.h_k * uniform_int(rng, 1, 4);
  cfg.d = std::vector<int>{3, 8, 24, 64, 128}[static_cast<std::size_t>(uniform_int(rng, 0, 4))];
  if (coin(rng, 0.2)) cfg.d_v = std::vector<int>{5, 16, 40}[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
  cfg.dtype = coin(rng) ? DType::kBFloat16 : DType::kFloat16;
  cfg.block_size = std::vector<int>{0, 1, 3, 16, 64, 256}[static_cast<std::size_t>(uniform_int(rng, 0, 5))];
  cfg.use_batch_idx = cfg.block_size == 0 && coin(rng);
  cfg.cache_rows = cfg.use_batch_idx ? cfg.batch + uniform_int(rng, 0, 3) : 0;
  cfg.share_blocks = cfg.block_size > 0 && coin(rng);
  cfg.max_cache_len = uniform_int(rng, 0, 300);
  return cfg;
}

TEST(CpuKVCacheFp8Q, RandomLayoutsAgainstOracle) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 30; ++trial) {
    const KVCacheConfig cfg = random_config(rng);
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 100);
    if (coin(rng, 0.2)) c.opts.window_right = uniform_int(rng, 0, 3);
    if (coin(rng, 0.3)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 8.0));
    if (coin(rng, 0.3)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, per_batch), per_batch);
    }
    if (coin(rng, 0.3)) c.sink.set(random_sink(rng, cfg.h_q));
    c.sink.want_grad = false;
    c.num_splits = std::vector<int>{1, 2, 7, 0}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
    check(c);
  }
}

// Sequences 0 and 1 share their prefix blocks (prefix sharing) under descales of their
// own: the shared bytes dequantize differently for each, as in FlashAttention-3 (the
// descale belongs to the sequence, not to the block).
TEST(CpuKVCacheFp8Q, SharedBlocksTakeEachSequencesDescale) {
  FA_SEEDED_RNG(rng);
  for (int block_size : {1, 16, 100}) {
    KVCacheConfig cfg = base_config();
    cfg.batch = 3;
    cfg.s_q = 2;
    cfg.s_new = 2;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 32;
    cfg.block_size = block_size;
    cfg.share_blocks = true;
    cfg.cache_lens = {uniform_int(rng, 200, 300), uniform_int(rng, 200, 300), uniform_int(rng, 0, 50)};
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    // Sequence 1's descales 8x sequence 0's: a per-block reading would use one of them
    // for both.
    for (HostTensor* ds : {&c.k_descale, &c.v_descale})
      for (int g = 0; g < cfg.h_k; ++g) ds->as<float>()[cfg.h_k + g] = 8.0f * ds->as<float>()[g];
    c.opts.causal = true;
    check(c);
  }
}

TEST(CpuKVCacheFp8Q, SplitCountsAgreeWithNoSplit) {
  FA_SEEDED_RNG(rng);
  for (int block_size : {0, 16}) {
    KVCacheConfig cfg = base_config();
    cfg.batch = 3;
    cfg.s_q = 3;
    cfg.s_new = 1;
    cfg.h_q = 6;
    cfg.h_k = 2;
    cfg.d = 16;
    cfg.block_size = block_size;
    cfg.cache_lens = {uniform_int(rng, 0, 5), uniform_int(rng, 300, 600), uniform_int(rng, 60, 130)};
    KVCacheCase base = KVCacheCase::make(rng, cfg);
    base.opts.causal = true;
    const ForwardExpectation expect = ForwardExpectation::of(base.problem(), cfg.dtype);
    expect_split_counts_agree(base, expect, cfg.dtype, {1, 2, 7, 0, 16},
                              [&](KVCacheCase& c) { return check(c, &expect); });
  }
}

// Left-padded dense caches (cache_leftpad) with sinks, windows and the append; fp16 out.
TEST(CpuKVCacheFp8Q, LeftpadSinkWindow) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 6; ++trial) {
    KVCacheConfig cfg = base_config();
    cfg.dtype = trial % 2 ? DType::kFloat16 : DType::kBFloat16;
    cfg.batch = 3;
    cfg.s_q = uniform_int(rng, 1, 5);
    cfg.s_new = uniform_int(rng, 0, 4);
    cfg.h_q = 4;
    cfg.h_k = trial % 3 == 0 ? 1 : 2;
    cfg.d = 40;
    cfg.leftpad = true;
    cfg.use_batch_idx = trial % 2 == 0;
    cfg.cache_rows = cfg.use_batch_idx ? 5 : 0;
    cfg.max_cache_len = 120;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = coin(rng);
    c.opts.window_left = uniform_int(rng, 5, 60);
    c.sink.set(random_sink(rng, cfg.h_q));
    c.sink.want_grad = false;
    c.num_splits = trial % 3;
    check(c);
  }
}

// Draft trees (speculative decoding) with fp8 q: the tree rule is independent of the dtype.
TEST(CpuKVCacheFp8Q, DraftTree) {
  FA_SEEDED_RNG(rng);
  for (int s_q : {1, 7, 33}) {
    KVCacheConfig cfg = base_config();
    cfg.batch = 2;
    cfg.s_q = s_q;
    cfg.s_new = s_q;
    cfg.h_q = 2;
    cfg.h_k = 1;
    cfg.d = 16;
    cfg.block_size = 8;
    cfg.tree = KVCacheConfig::Tree::kRandom;
    cfg.max_cache_len = 50;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    c.num_splits = 2;
    check(c);
  }
}

// Undefined descales are 1: bytes quantized with descale 1, the call given none.
TEST(CpuKVCacheFp8Q, UndefinedDescalesAreOne) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = base_config();
  cfg.scale_lo = cfg.scale_hi = 1.0;
  cfg.batch = 2;
  cfg.s_q = 3;
  cfg.s_new = 2;
  cfg.h_q = 4;
  cfg.h_k = 2;
  cfg.d = 8;
  cfg.block_size = 4;
  cfg.max_cache_len = 30;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.poison_outputs();
  Options opts = c.call_options();
  opts.q_descale = Tensor{};
  opts.v_descale = Tensor{};  // k_descale stays given (all ones)
  SCOPED_TRACE(describe_case(c));
  ASSERT_NO_THROW(kvcache_forward(c.args(), c.out.view(), c.lse.view(), opts));
  expect_forward_matches(c.problem(), cfg.dtype, forward_results(c));
  EXPECT_TRUE(c.k_cache.bitwise_equal(c.k_cache_expected));
  EXPECT_TRUE(c.v_cache.bitwise_equal(c.v_cache_expected));
}

// The workspace size does not depend on the output dtype (both compute in fp32) and a
// caller workspace of that size is used.
TEST(CpuKVCacheFp8Q, WorkspaceSizeAndCallerWorkspace) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = base_config();
  cfg.batch = 2;
  cfg.s_q = 2;
  cfg.h_q = 2;
  cfg.h_k = 1;
  cfg.d = 16;
  cfg.cache_lens = {300, 40};
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.num_splits = 4;
  const std::size_t bytes = kvcache_workspace_size(c.args(), c.call_options());
  EXPECT_GT(bytes, 0u);
  std::vector<std::byte> ws(bytes);
  c.poison_outputs();
  ASSERT_NO_THROW(kvcache_forward(c.args(), c.out.view(), c.lse.view(), c.call_options(),
                                  Workspace{ws.data(), ws.size()}));
  expect_forward_matches(c.problem(), cfg.dtype, forward_results(c));
}

template <class E, class F>
std::string message_of(F&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// What fp8 q accepts and declines, with the argument named; nothing written on failure.
TEST(CpuKVCacheFp8Q, ArgumentRules) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = base_config();
  cfg.batch = 2;
  cfg.s_q = 1;
  cfg.s_new = 1;
  cfg.h_q = 4;
  cfg.h_k = 2;
  cfg.d = 8;
  cfg.max_cache_len = 10;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.poison_outputs();
  const HostTensor k_before = c.k_cache;
  auto invalid = [&](const KVCacheArgs& a, const Tensor& out, const Options& o) {
    return message_of<InvalidArgument>([&] { kvcache_forward(a, out, c.lse.view(), o); });
  };
  auto unsupported = [&](const KVCacheArgs& a, const Tensor& out, const Options& o) {
    return message_of<Unsupported>([&] { kvcache_forward(a, out, c.lse.view(), o); });
  };
  const Options ok = c.call_options();
  // fp8 q with a 16-bit cache.
  HostTensor kc16(DType::kBFloat16, c.k_cache.shape()), vc16(DType::kBFloat16, c.v_cache.shape());
  KVCacheArgs a = c.args();
  a.k_cache = kc16.view();
  a.v_cache = vc16.view();
  std::string m = invalid(a, c.out.view(), ok);
  EXPECT_NE(m.find("'k_cache'"), std::string::npos) << m;
  EXPECT_NE(m.find("expected dtype float8_e4m3 (q is float8_e4m3"), std::string::npos) << m;
  // fp8 q with the k_scale / v_scale of a 16-bit-q fp8 cache.
  HostTensor scale(DType::kFloat32, {cfg.h_k});
  scale.fill(1.0);
  a = c.args();
  a.k_scale = scale.view();
  a.v_scale = scale.view();
  m = invalid(a, c.out.view(), ok);
  EXPECT_NE(m.find("'k_scale'"), std::string::npos) << m;
  EXPECT_NE(m.find("opts.k_descale / v_descale [b, h_k]"), std::string::npos) << m;
  // k_new / v_new of another dtype than q.
  HostTensor kn(DType::kBFloat16, c.k_new.shape()), vn(DType::kBFloat16, c.v_new.shape());
  a = c.args();
  a.k_new = kn.view();
  a.v_new = vn.view();
  m = invalid(a, c.out.view(), ok);
  EXPECT_NE(m.find("'k_new'"), std::string::npos) << m;
  EXPECT_NE(m.find("dtype float8_e4m3 (same as q)"), std::string::npos) << m;
  // out fp32 / fp8.
  for (DType dt : {DType::kFloat32, DType::kFloat8E4M3}) {
    HostTensor out(dt, c.out.shape());
    m = invalid(c.args(), out.view(), ok);
    EXPECT_NE(m.find("'out'"), std::string::npos) << m;
    EXPECT_NE(m.find("bfloat16 or float16"), std::string::npos) << m;
  }
  // Descales [b_cache, h_k] or [h_k] instead of [b, h_k]; fp16 descales.
  HostTensor rows3(DType::kFloat32, {3, cfg.h_k}), heads(DType::kFloat32, {cfg.h_k}),
      half(DType::kFloat16, {cfg.batch, cfg.h_k});
  Options bad = ok;
  bad.k_descale = rows3.view();
  m = invalid(c.args(), c.out.view(), bad);
  EXPECT_NE(m.find("'opts.k_descale'"), std::string::npos) << m;
  EXPECT_NE(m.find("shape [2, 2]"), std::string::npos) << m;
  bad = ok;
  bad.q_descale = heads.view();
  m = invalid(c.args(), c.out.view(), bad);
  EXPECT_NE(m.find("'opts.q_descale'"), std::string::npos) << m;
  bad = ok;
  bad.v_descale = half.view();
  m = invalid(c.args(), c.out.view(), bad);
  EXPECT_NE(m.find("'opts.v_descale'"), std::string::npos) << m;
  EXPECT_NE(m.find("float32"), std::string::npos) << m;
  // qv with fp8 q, dropout: Unsupported.
  HostTensor qv(DType::kFloat8E4M3, c.q.shape());
  bad = ok;
  bad.qv = qv.view();
  m = unsupported(c.args(), c.out.view(), bad);
  EXPECT_NE(m.find("'opts.qv'"), std::string::npos) << m;
  bad = ok;
  bad.dropout_p = 0.1f;
  m = unsupported(c.args(), c.out.view(), bad);
  EXPECT_NE(m.find("'opts.dropout_p'"), std::string::npos) << m;
  // Nothing written: out poisoned, the cache not appended to.
  EXPECT_EQ(c.out.count_nan(), c.out.numel());
  EXPECT_TRUE(c.k_cache.bitwise_equal(k_before));
}

// The reverse combination stays as it was: 16-bit q over an fp8 cache takes k_scale /
// v_scale and no descales.
TEST(CpuKVCacheFp8Q, SixteenBitQOverFp8CacheTakesNoDescales) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg;
  cfg.fp8 = true;
  cfg.dtype = DType::kBFloat16;
  cfg.batch = 2;
  cfg.h_q = 2;
  cfg.h_k = 1;
  cfg.d = 8;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  HostTensor ds(DType::kFloat32, {cfg.batch, cfg.h_k});
  ds.fill(1.0);
  Options o = c.call_options();
  o.k_descale = ds.view();
  const std::string m =
      message_of<InvalidArgument>([&] { kvcache_forward(c.args(), c.out.view(), c.lse.view(), o); });
  EXPECT_NE(m.find("'opts.k_descale'"), std::string::npos) << m;
  EXPECT_NE(m.find("an undefined tensor when q is not float8_e4m3"), std::string::npos) << m;
}

}  // namespace
}  // namespace flashattn::test
