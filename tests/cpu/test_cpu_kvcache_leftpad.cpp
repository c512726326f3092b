// CPU backend, left-padded KV caches (cache_leftpad, flash_attn's semantics): sequence b's
// keys are cache rows cache_leftpad[b] .. cache_seqlens[b] + s_new - 1, the new rows are
// still appended at cache_seqlens[b], and masks / ALiBi use s_k = cache_seqlens[b] + s_new
// - cache_leftpad[b]. The padding rows hold NaN, so reading one shows. Compared with the
// fp64 oracle over the gathered keys (support/cases.cpp: KVCacheCase::problem).
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

std::string describe_case(const KVCacheCase& c) {
  std::string s = "b=" + std::to_string(c.cfg.batch) + " s_q=" + std::to_string(c.cfg.s_q) +
                  " s_new=" + std::to_string(c.cfg.s_new) + " h_q=" + std::to_string(c.cfg.h_q) +
                  " h_k=" + std::to_string(c.cfg.h_k) + " d=" + std::to_string(c.cfg.d) + " d_v=" + std::to_string(c.cfg.dv()) +
                  (c.cfg.qv ? " qv " : " ") +
                  dtype_name(c.cfg.dtype) + " splits=" + std::to_string(c.num_splits) + " (seqlen, leftpad)=";
  for (std::size_t b = 0; b < c.cache_lens.size(); ++b)
    s += "(" + std::to_string(c.cache_lens[b]) + "," + std::to_string(c.leftpad[b]) + ")";
  return s + " " + describe(c.call_options());
}

void check_leftpad(KVCacheCase& c) {
  SCOPED_TRACE(describe_case(c));
  run_and_check_kvcache(c);
}

TEST(CpuKVCacheLeftpad, RandomFeatures) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 24; ++trial) {
    KVCacheConfig cfg;
    cfg.batch = uniform_int(rng, 1, 4);
    cfg.s_q = uniform_int(rng, 1, 7);
    cfg.s_new = coin(rng) ? uniform_int(rng, 1, cfg.s_q) : 0;
    cfg.h_k = uniform_int(rng, 1, 2);
    cfg.h_q = cfg.h_k * (1 << uniform_int(rng, 0, 2));
    cfg.d = std::vector<int>{3, 16, 59, 64}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
    cfg.dtype = std::vector<DType>{DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                                   DType::kFloat64}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
    cfg.use_batch_idx = coin(rng);
    cfg.cache_rows = cfg.use_batch_idx ? cfg.batch + 2 : 0;
    cfg.max_cache_len = uniform_int(rng, 0, 90);
    cfg.s_cache = cfg.max_cache_len + cfg.s_new + uniform_int(rng, 0, 5);
    cfg.leftpad = true;
    // v's own head dim, and MLA's qv (one KV head), over the same left-padded cache rows.
    if (coin(rng, 0.3)) cfg.d_v = std::vector<int>{5, 32, 72}[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    if (cfg.h_k == 1 && coin(rng, 0.3)) cfg.qv = true;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.4)) c.opts.window_left = uniform_int(rng, 0, 30);
    if (coin(rng, 0.3)) c.opts.window_right = uniform_int(rng, 0, 4);
    if (coin(rng, 0.3)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 8.0));
    if (coin(rng, 0.4)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, per_batch), per_batch);
    }
    c.num_splits = uniform_int(rng, 0, 5);
    check_leftpad(c);
  }
}

// Edges: no padding, padding up to cache_seqlens (only the new keys are seen), and a
// sequence whose keys are all padding without an append (empty rows: out 0, lse -inf).
TEST(CpuKVCacheLeftpad, Edges) {
  FA_SEEDED_RNG(rng);
  for (int s_new : {0, 2}) {
    KVCacheConfig cfg;
    cfg.batch = 4;
    cfg.s_q = 2;
    cfg.s_new = s_new;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 8;
    cfg.dtype = DType::kFloat32;
    cfg.cache_lens = {9, 9, 0, 30};
    cfg.leftpads = {0, 9, 0, 17};
    cfg.leftpad = true;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    check_leftpad(c);
    if (s_new == 0) {
      for (int h = 0; h < 4; ++h)
        for (int i = 0; i < 2; ++i) {
          EXPECT_EQ(c.lse.at({1, h, i}), -INFINITY);
          EXPECT_EQ(c.out.at({1, i, h, 0}), 0.0);
        }
    }
  }
}

// A left-padded call equals the call on the same keys moved to the start of the row
// (cache_seqlens - leftpad, no padding): the padding is invisible, bit for bit.
TEST(CpuKVCacheLeftpad, EqualsUnpaddedCache) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg;
  cfg.batch = 3;
  cfg.s_q = 3;
  cfg.s_new = 3;
  cfg.h_q = 4;
  cfg.h_k = 1;
  cfg.d = 16;
  cfg.dtype = DType::kBFloat16;
  cfg.cache_lens = {40, 12, 25};
  cfg.leftpads = {13, 0, 25};
  cfg.leftpad = true;
  KVCacheCase padded = KVCacheCase::make(rng, cfg);
  padded.opts.causal = true;
  padded.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, false), false);
  KVCacheConfig flat_cfg = cfg;
  flat_cfg.leftpad = false;
  flat_cfg.leftpads.clear();
  for (int b = 0; b < 3; ++b) flat_cfg.cache_lens[static_cast<std::size_t>(b)] -= cfg.leftpads[static_cast<std::size_t>(b)];
  KVCacheCase flat = KVCacheCase::make(rng, flat_cfg);
  flat.opts = padded.opts;
  flat.set_alibi(padded.alibi, false);
  // The same keys, values, queries and new rows.
  flat.q = padded.q;
  flat.k_new = padded.k_new;
  flat.v_new = padded.v_new;
  for (int b = 0; b < 3; ++b)
    for (int j = 0; j < flat.cache_lens[static_cast<std::size_t>(b)]; ++j)
      for (int g = 0; g < cfg.h_k; ++g)
        for (int e = 0; e < cfg.d; ++e) {
          const int src = padded.leftpad[static_cast<std::size_t>(b)] + j;
          flat.k_cache.set(flat.k_cache.index({b, j, g, e}), padded.k_cache.at({b, src, g, e}));
          flat.v_cache.set(flat.v_cache.index({b, j, g, e}), padded.v_cache.at({b, src, g, e}));
        }
  padded.poison_outputs();
  flat.poison_outputs();
  padded.run();
  flat.run();
  EXPECT_TRUE(padded.out.bitwise_equal(flat.out));
  EXPECT_TRUE(padded.lse.bitwise_equal(flat.lse));
}

}  // namespace
}  // namespace flashattn::test
