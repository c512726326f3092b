// CPU backend, speculative decoding with a draft tree (tree_mask): the last s_q keys
// are the drafts; linear drafts (draft i sees drafts <= i) equal causal attention bit
// for bit; random trees (random parent pointers -> ancestor bitmasks, s_q up to 40 so
// rows span two words, padded rows, set bits beyond s_q) over paged and dense caches,
// fp8 or not, with and without causal / window, against the fp64 oracle; split counts
// agree with no split; a row whose mask hides every key gives out 0, lse -inf.
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
  const KVCacheConfig& k = c.cfg;
  std::string s = std::string(k.tree == KVCacheConfig::Tree::kLinear ? "linear" : "random") +
                  " draft tree; b=" + std::to_string(k.batch) + " s_q=" + std::to_string(k.s_q) +
                  " s_new=" + std::to_string(k.s_new) + " h_q=" + std::to_string(k.h_q) +
                  " h_k=" + std::to_string(k.h_k) + " d=" + std::to_string(k.d) + " " +
                  dtype_name(k.dtype) + (k.fp8 ? " fp8 cache" : "") +
                  " block_size=" + std::to_string(k.block_size) + " row_pad=" + std::to_string(k.tree_row_pad) +
                  " splits=" + std::to_string(c.num_splits) + " cache_seqlens=";
  for (int len : c.cache_lens) s += std::to_string(len) + ",";
  if (!c.tree_parents.empty()) {
    s += " parents(seq 0)=";
    for (int i = 0; i < k.s_q; ++i) s += std::to_string(c.tree_parents[static_cast<std::size_t>(i)]) + ",";
  }
  return s + " " + describe(c.call_options());
}

ForwardResults check_tree(KVCacheCase& c, const ForwardExpectation* expectation = nullptr) {
  SCOPED_TRACE(describe_case(c));
  return run_and_check_kvcache(c, expectation);
}

// Linear drafts without causal are causal attention: the same keys are hidden, so the
// CPU backend gives the same bits.
TEST(CpuKVCacheTree, LinearDraftsEqualCausal) {
  FA_SEEDED_RNG(rng);
  for (int s_q : {1, 2, 5, 31, 32, 33, 40}) {
    for (int block_size : {0, 1, 16}) {
      KVCacheConfig cfg;
      cfg.batch = 3;
      cfg.s_q = s_q;
      cfg.s_new = s_q;
      cfg.h_q = 4;
      cfg.h_k = 2;
      cfg.d = 16;
      cfg.dtype = DType::kBFloat16;
      cfg.block_size = block_size;
      cfg.tree = KVCacheConfig::Tree::kLinear;
      cfg.tree_row_pad = coin(rng) ? 1 : 0;
      cfg.max_cache_len = 150;
      KVCacheCase tree = KVCacheCase::make(rng, cfg);
      tree.num_splits = uniform_int(rng, 1, 3);
      const ForwardResults t = check_tree(tree);

      KVCacheCase causal = tree;
      causal.cfg.tree = KVCacheConfig::Tree::kNone;
      causal.tree_words.clear();
      causal.opts.causal = true;
      causal.poison_outputs();
      ASSERT_NO_THROW(causal.run());
      const ForwardResults c = forward_results(causal);
      SCOPED_TRACE(describe_case(tree));
      EXPECT_TRUE(bitwise_equal("out (linear tree vs causal)", t.out, c.out));
      EXPECT_TRUE(bitwise_equal("lse (linear tree vs causal)", t.lse, c.lse));
    }
  }
}

TEST(CpuKVCacheTree, RandomTreesAgainstOracle) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 30; ++trial) {
    KVCacheConfig cfg;
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.s_q = coin(rng) ? uniform_int(rng, 1, 12) : uniform_int(rng, 30, 40);
    // The drafts are usually the new rows (s_new = s_q); other counts are legal too.
    cfg.s_new = coin(rng, 0.7) ? cfg.s_q : uniform_int(rng, 0, 8);
    cfg.h_k = uniform_int(rng, 1, 2);
    cfg.h_q = cfg.h_k * uniform_int(rng, 1, 3);
    cfg.d = std::vector<int>{3, 16, 64}[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    cfg.dtype = std::vector<DType>{DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                                   DType::kFloat64}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
    cfg.block_size = std::vector<int>{0, 1, 4, 16, 64, 256}[static_cast<std::size_t>(uniform_int(rng, 0, 5))];
    cfg.use_batch_idx = cfg.block_size == 0 && coin(rng);
    cfg.cache_rows = cfg.use_batch_idx ? cfg.batch + 1 : 0;
    cfg.share_blocks = cfg.block_size > 0 && coin(rng);
    cfg.fp8 = coin(rng, 0.4);
    cfg.per_block_scales = coin(rng);
    cfg.tree = KVCacheConfig::Tree::kRandom;
    cfg.tree_row_pad = uniform_int(rng, 0, 2);
    cfg.max_cache_len = uniform_int(rng, 0, 200);
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 60);
    if (coin(rng, 0.2)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 8.0));
    if (coin(rng, 0.2)) c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, false), false);
    c.num_splits = std::vector<int>{1, 2, 7, 0}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
    check_tree(c);
  }
}

TEST(CpuKVCacheTree, SplitCountsAgreeWithNoSplit) {
  FA_SEEDED_RNG(rng);
  for (bool fp8 : {false, true}) {
    KVCacheConfig cfg;
    cfg.batch = 2;
    cfg.s_q = 37;
    cfg.s_new = 37;
    cfg.h_q = 4;
    cfg.h_k = 1;
    cfg.d = 16;
    cfg.dtype = DType::kFloat32;
    cfg.block_size = 16;
    cfg.fp8 = fp8;
    cfg.per_block_scales = true;
    cfg.tree = KVCacheConfig::Tree::kRandom;
    cfg.cache_lens = {uniform_int(rng, 200, 500), uniform_int(rng, 0, 20)};
    KVCacheCase base = KVCacheCase::make(rng, cfg);
    const RefProblem p = base.problem();
    const ForwardExpectation expect = ForwardExpectation::of(p, cfg.dtype);
    expect_split_counts_agree(base, expect, cfg.dtype, {1, 2, 7, 0, 12},
                              [&](KVCacheCase& c) { return check_tree(c, &expect); });
  }
}

// A draft whose row is all zero sees no draft; with an empty cache it sees nothing:
// out 0, lse -inf. With a cache it sees exactly the cache.
TEST(CpuKVCacheTree, RowHidingEveryKey) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg;
  cfg.batch = 2;
  cfg.s_q = 35;
  cfg.s_new = 35;
  cfg.h_q = 2;
  cfg.h_k = 1;
  cfg.d = 8;
  cfg.block_size = 8;
  cfg.tree = KVCacheConfig::Tree::kRandom;
  cfg.cache_lens = {0, 20};
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  const int W = c.tree_words_per_row();
  const int hidden = uniform_int(rng, 0, cfg.s_q - 1);
  for (int b = 0; b < cfg.batch; ++b)
    for (int w = 0; w < W; ++w) {
      c.tree_words[static_cast<std::size_t>((b * cfg.s_q + hidden) * W + w)] = 0u;
      c.tree_mask.as<std::int32_t>()[c.tree_mask.index({b, hidden, w})] = 0;
    }
  c.num_splits = 2;
  check_tree(c);
  for (int h = 0; h < cfg.h_q; ++h) {
    EXPECT_EQ(c.lse.at({0, h, hidden}), -INFINITY) << "row " << hidden << " of the empty-cache sequence";
    for (int e = 0; e < cfg.d; ++e) EXPECT_EQ(c.out.at({0, hidden, h, e}), 0.0);
    EXPECT_TRUE(std::isfinite(c.lse.at({1, h, hidden})));
  }
}

}  // namespace
}  // namespace flashattn::test
