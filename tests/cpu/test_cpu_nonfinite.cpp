// CPU backend: NaN and inf in the inputs (docs/semantics.md, "Non-finite values"). Each
// test plants a NaN / inf at a random place of fresh random inputs and compares with the
// same run without it, element by element: the rows (or columns) the rules name must be
// NaN, empty or non-finite, every other element bit-identical to the clean run.
#include <cmath>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "flashattn/semantics.hpp"
#include "support/cases.hpp"
#include "support/describe.hpp"
#include "support/nonfinite.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr DType kAllDtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};

struct MaskCase {
  const char* name;
  bool causal;
  int left, right;
};
// s_q = 37 > s_k = 29 under causal leaves the first 8 rows empty.
constexpr MaskCase kMasks[] = {{"none", false, -1, -1}, {"causal", true, -1, -1}, {"window", false, 9, 4}};

DenseCase dense(Rng& rng, DType dtype, const MaskCase& m, int s_q = 37, int s_k = 29) {
  DenseCase c = DenseCase::random(rng, Shape{2, s_q, s_k, 4, 2, 24}, dtype);
  c.opts.causal = m.causal;
  c.opts.window_left = m.left;
  c.opts.window_right = m.right;
  return c;
}

semantics::Mask mask_of(const Options& o) { return semantics::Mask::make(o.causal, o.window_left, o.window_right); }

bool row_sees_keys(const Options& o, int i, int s_q, int s_k) {
  return !semantics::visible_keys(i, s_q, s_k, mask_of(o)).empty();
}

// A NaN in q[b0, i0, h0, c0]: that row is NaN (or empty, if it sees no key); every other
// row of every sequence and head is the clean run's, bit for bit.
TEST(CpuNonFinite, NanQueryPoisonsItsRowOnly) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    for (const MaskCase& m : kMasks) {
      DenseCase clean = dense(rng, dtype, m);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " mask " + m.name);
      DenseCase bad = clean;
      const int b0 = uniform_int(rng, 0, 1), i0 = uniform_int(rng, 0, 36), h0 = uniform_int(rng, 0, 3),
                c0 = uniform_int(rng, 0, 23);
      bad.q.set(bad.q.index({b0, i0, h0, c0}), kNaN);
      clean.poison_forward();
      bad.poison_forward();
      clean.run_forward();
      bad.run_forward();
      const bool sees = row_sees_keys(clean.opts, i0, 37, 29);
      const ExpectRule rule = [&](int b, int i, int h, int) {
        if (b == b0 && i == i0 && h == h0) return sees ? Expect::kNan : Expect::kEmpty;
        return Expect::kSame;
      };
      expect_pattern("out", bad.out, clean.out, false, rule);
      expect_pattern("lse", bad.lse, clean.lse, true, rule);
    }
  }
}

// A NaN in k[b0, j0, g0, c0] reaches exactly the rows of (b0, the query heads of g0) that
// see key j0; a row the mask hides j0 from is clean (the masked score is a select).
TEST(CpuNonFinite, NanKeyReachesExactlyTheRowsThatSeeIt) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (const MaskCase& m : kMasks) {
      for (int variant = 0; variant < 2; ++variant) {  // 1: softcap and ALiBi on
        DenseCase clean = dense(rng, dtype, m);
        if (variant == 1) {
          clean.opts.softcap = 3.0f;
          clean.set_alibi(random_alibi(rng, 2, 4, true), true);
        }
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " mask " + m.name + " " + describe(clean.call_options()));
        DenseCase bad = clean;
        const int b0 = uniform_int(rng, 0, 1), j0 = uniform_int(rng, 0, 28), g0 = uniform_int(rng, 0, 1),
                  c0 = uniform_int(rng, 0, 23);
        bad.k.set(bad.k.index({b0, j0, g0, c0}), kNaN);
        clean.run_forward();
        bad.run_forward();
        const semantics::Mask mk = mask_of(clean.opts);
        const ExpectRule rule = [&](int b, int i, int h, int) {
          if (b == b0 && h / 2 == g0 && semantics::key_visible(i, j0, 37, 29, mk)) return Expect::kNan;
          return Expect::kSame;
        };
        expect_pattern("out", bad.out, clean.out, false, rule);
        expect_pattern("lse", bad.lse, clean.lse, true, rule);
      }
    }
  }
}

// A NaN in v[b0, j0, g0, c0]: column c0 of every row that sees j0 is NaN, dropped or not;
// its other columns and lse are the clean run's. Rows of the same sequence and heads that
// do not see j0 are not specified (0 * NaN in a shared tile); everything else is clean.
TEST(CpuNonFinite, NanValueReachesItsColumnOfTheRowsThatSeeIt) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat64}) {
    for (const MaskCase& m : kMasks) {
      for (float dropout : {0.0f, 0.5f}) {
        DenseCase clean = dense(rng, dtype, m);
        clean.opts.dropout_p = dropout;
        clean.opts.seed = rng();
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " mask " + m.name + " " + describe(clean.call_options()));
        DenseCase bad = clean;
        const int b0 = uniform_int(rng, 0, 1), j0 = uniform_int(rng, 0, 28), g0 = uniform_int(rng, 0, 1),
                  c0 = uniform_int(rng, 0, 23);
        bad.v.set(bad.v.index({b0, j0, g0, c0}), kNaN);
        clean.run_forward();
        bad.run_forward();
        const semantics::Mask mk = mask_of(clean.opts);
        const ExpectRule rule = [&](int b, int i, int h, int c) {
          if (b != b0 || h / 2 != g0) return Expect::kSame;
          if (!semantics::key_visible(i, j0, 37, 29, mk)) return m.causal || m.left >= 0 ? Expect::kUnchecked : Expect::kSame;
          return c == c0 ? Expect::kNan : Expect::kSame;
        };
        expect_pattern("out", bad.out, clean.out, false, rule);
        expect_pattern("lse", bad.lse, clean.lse, true, rule);
      }
    }
  }
}

// q[b0, i0, h0, c0] = +-inf with k[..., c0] > 0 everywhere: every visible score of the row is
// +inf (the row is NaN) or -inf (the row is empty); with a softcap the scores are capped to
// +-softcap: a finite row, lse = +-softcap + log(visible keys) up to the row's ALiBi-free rounding.
TEST(CpuNonFinite, InfiniteScores) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (const MaskCase& m : kMasks) {
      for (double sign : {1.0, -1.0}) {
        for (float softcap : {0.0f, 2.0f}) {
          DenseCase clean = dense(rng, dtype, m);
          clean.opts.softcap = softcap;
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " mask " + m.name + " sign " + std::to_string(sign) +
                       " " + describe(clean.call_options()));
          const int b0 = uniform_int(rng, 0, 1), i0 = uniform_int(rng, 0, 36), h0 = uniform_int(rng, 0, 3),
                    c0 = uniform_int(rng, 0, 23);
          for (std::int64_t e = c0; e < clean.k.numel(); e += 24)
            clean.k.set(e, std::fabs(clean.k.get(e)) + 0.25);
          DenseCase bad = clean;
          bad.q.set(bad.q.index({b0, i0, h0, c0}), sign * kInf);
          clean.run_forward();
          bad.run_forward();
          const semantics::KeyRange keys = semantics::visible_keys(i0, 37, 29, mask_of(clean.opts));
          const bool sees = !keys.empty();
          const Expect row = !sees ? Expect::kEmpty
                             : softcap > 0 ? Expect::kUnchecked
                             : sign > 0    ? Expect::kNan
                                           : Expect::kEmpty;
          const ExpectRule rule = [&](int b, int i, int h, int) {
            return b == b0 && i == i0 && h == h0 ? row : Expect::kSame;
          };
          expect_pattern("out", bad.out, clean.out, false, rule);
          expect_pattern("lse", bad.lse, clean.lse, true, rule);
          if (sees && softcap > 0) {
            const double lse = bad.lse.at({b0, h0, i0});
            const double want = sign * softcap + std::log(double(keys.end - keys.begin));
            EXPECT_NEAR(lse, want, 1e-4 * (1 + std::fabs(want)));
            for (int c = 0; c < 24; ++c) EXPECT_TRUE(std::isfinite(bad.out.at({b0, i0, h0, c})));
          }
        }
      }
    }
  }
}

// A NaN ALiBi slope poisons every row of its (sequence, head) that sees a key, nothing else.
TEST(CpuNonFinite, NanAlibiSlope) {
  FA_SEEDED_RNG(rng);
  for (const MaskCase& m : kMasks) {
    DenseCase clean = dense(rng, DType::kFloat32, m);
    clean.set_alibi(random_alibi(rng, 2, 4, true), true);
    SCOPED_TRACE(std::string("mask ") + m.name);
    DenseCase bad = clean;
    const int b0 = uniform_int(rng, 0, 1), h0 = uniform_int(rng, 0, 3);
    std::vector<float> slopes = clean.alibi;
    slopes[std::size_t(b0 * 4 + h0)] = std::numeric_limits<float>::quiet_NaN();
    bad.set_alibi(slopes, true);
    clean.run_forward();
    bad.run_forward();
    const ExpectRule rule = [&](int b, int i, int h, int) {
      if (b != b0 || h != h0) return Expect::kSame;
      return row_sees_keys(clean.opts, i, 37, 29) ? Expect::kNan : Expect::kEmpty;
    };
    expect_pattern("out", bad.out, clean.out, false, rule);
    expect_pattern("lse", bad.lse, clean.lse, true, rule);
  }
}

// Varlen: NaN in every row that belongs to no sequence (padding after the last sequence,
// keys at or past seqused_k) changes nothing, forward or backward; a NaN in one query row
// of one sequence poisons that row only, and in the backward its dq row and the dk / dv
// rows of the keys it sees.
TEST(CpuNonFinite, VarlenPaddingNeverReadAndRowsContained) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (bool causal : {false, true}) {
      const std::vector<int> cu_q = {0, 13, 13, 54, 61}, cu_k = {0, 20, 27, 70, 77};
      VarlenCase clean = VarlenCase::make(rng, cu_q, cu_k, 4, 2, 16, dtype, 5, 7);
      clean.set_seqused_k({17, 7, 40, 0});
      clean.opts.causal = causal;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (causal ? " causal" : ""));
      VarlenCase bad = clean;
      // Rows that belong to no sequence: q and dout padding, keys past seqused_k, k / v padding.
      for (int r = cu_q.back(); r < clean.total_q; ++r)
        for (int e = 0; e < 4 * 16; ++e) {
          bad.q.set(std::int64_t(r) * 64 + e, kNaN);
          bad.dout.set(std::int64_t(r) * 64 + e, kNaN);
        }
      auto key_row_unused = [&](int r) {
        for (int b = 0; b < clean.batch(); ++b)
          if (r >= cu_k[b] && r < cu_k[b + 1]) return r - cu_k[b] >= clean.used_k(b);
        return true;
      };
      for (int r = 0; r < clean.total_k; ++r)
        if (key_row_unused(r))
          for (int e = 0; e < 2 * 16; ++e) {
            bad.k.set(std::int64_t(r) * 32 + e, kNaN);
            bad.v.set(std::int64_t(r) * 32 + e, kNaN);
          }
      // One NaN query element in sequence 2 (rows 13 .. 53, 40 used keys).
      const int i0 = uniform_int(rng, 0, 40), h0 = uniform_int(rng, 0, 3);
      bad.q.set((std::int64_t(13 + i0) * 4 + h0) * 16 + uniform_int(rng, 0, 15), kNaN);
      for (VarlenCase* c : {&clean, &bad}) {
        c->poison_forward();
        c->poison_backward();
        c->run_forward();
        c->run_backward();
      }
      const semantics::Mask mk = mask_of(clean.opts);
      const bool sees = !semantics::visible_keys(i0, 41, 40, mk).empty();
      auto seq_of_q = [&](int r) {
        for (int b = 0; b < clean.batch(); ++b)
          if (r >= cu_q[b] && r < cu_q[b + 1]) return b;
        return -1;
      };
      const ExpectRule rows = [&](int, int r, int h, int) {
        if (seq_of_q(r) < 0) return Expect::kUnchecked;  // padding rows: never written, never compared
        if (r == 13 + i0 && h == h0) return sees ? Expect::kNan : Expect::kEmpty;
        return Expect::kSame;
      };
      expect_pattern("out", bad.out, clean.out, false, rows);
      expect_pattern("lse", bad.lse, clean.lse, true, rows);
      expect_pattern("dq", bad.dq, clean.dq, false, rows);
      // dk / dv: sequence 2's keys that row i0 sees, in h0's group, are NaN (dS and P of a
      // NaN row are NaN); keys past seqused_k are 0; keys of h0's group that i0 does not see
      // are not specified (its NaN q / dO times their zero P and dS in a shared tile).
      const ExpectRule keys = [&](int, int r, int g, int) {
        for (int b = 0; b < clean.batch(); ++b) {
          if (r < cu_k[b] || r >= cu_k[b + 1]) continue;
          const int j = r - cu_k[b];
          if (j >= clean.used_k(b)) return Expect::kEmpty;
          if (b == 2 && g == h0 / 2 && semantics::key_visible(i0, j, 41, 40, mk)) return Expect::kNan;
          if (b == 2 && g == h0 / 2) return Expect::kUnchecked;  // masked from i0, in its tiles
          return Expect::kSame;
        }
        return Expect::kUnchecked;  // padding rows
      };
      expect_pattern("dk", bad.dk, clean.dk, false, keys);
      expect_pattern("dv", bad.dv, clean.dv, false, keys);
    }
  }
}

// Backward: a NaN in dout[b0, i0, h0, c0] makes dq of that row NaN, dk of every key the row
// sees NaN and column c0 of their dv NaN; dq of every other row, dk of the keys the row does
// not see (dS = 0 by a select), and everything of the other sequences and groups are the
// clean run's.
TEST(CpuNonFinite, NanGradientContained) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat64}) {
    for (const MaskCase& m : kMasks) {
      DenseCase clean = dense(rng, dtype, m);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " mask " + m.name);
      clean.run_forward();
      DenseCase bad = clean;
      const int b0 = uniform_int(rng, 0, 1), i0 = uniform_int(rng, 0, 36), h0 = uniform_int(rng, 0, 3),
                c0 = uniform_int(rng, 0, 23);
      bad.dout.set(bad.dout.index({b0, i0, h0, c0}), kNaN);
      for (DenseCase* c : {&clean, &bad}) {
        c->poison_backward();
        c->run_backward();
      }
      const semantics::Mask mk = mask_of(clean.opts);
      const bool sees = row_sees_keys(clean.opts, i0, 37, 29);
      expect_pattern("dq", bad.dq, clean.dq, false, [&](int b, int i, int h, int) {
        if (b == b0 && i == i0 && h == h0) return sees ? Expect::kNan : Expect::kEmpty;
        return Expect::kSame;
      });
      expect_pattern("dk", bad.dk, clean.dk, false, [&](int b, int j, int g, int) {
        if (b == b0 && g == h0 / 2 && semantics::key_visible(i0, j, 37, 29, mk)) return Expect::kNan;
        return Expect::kSame;
      });
      expect_pattern("dv", bad.dv, clean.dv, false, [&](int b, int j, int g, int c) {
        if (b != b0 || g != h0 / 2) return Expect::kSame;
        if (!semantics::key_visible(i0, j, 37, 29, mk)) return Expect::kUnchecked;  // P = 0 times NaN in P^T dO
        return c == c0 ? Expect::kNan : Expect::kSame;
      });
    }
  }
}

// KV cache with split-KV: a NaN query row merges to NaN out and lse (every split is NaN:
// the merge must not take it for an empty row); a NaN in one sequence's k_new poisons that
// sequence's rows in the group only. Unused cache slots are NaN throughout (KVCacheCase).
TEST(CpuNonFinite, KVCacheSplitsAndAppend) {
  FA_SEEDED_RNG(rng);
  for (int splits : {1, 3}) {
    for (int block_size : {0, 16}) {
      KVCacheConfig cfg;
      cfg.batch = 3;
      cfg.s_q = 1;
      cfg.s_new = 2;
      cfg.h_q = 4;
      cfg.h_k = 2;
      cfg.d = 16;
      cfg.dtype = DType::kBFloat16;
      cfg.cache_lens = {70, 33, 101};
      cfg.block_size = block_size;
      KVCacheCase clean = KVCacheCase::make(rng, cfg);
      clean.num_splits = splits;
      SCOPED_TRACE("splits " + std::to_string(splits) + " block_size " + std::to_string(block_size));
      KVCacheCase bad = clean;
      const int h0 = uniform_int(rng, 0, 3), g1 = uniform_int(rng, 0, 1);
      bad.q.set(bad.q.index({0, 0, h0, uniform_int(rng, 0, 15)}), kNaN);
      bad.k_new.set(bad.k_new.index({2, uniform_int(rng, 0, 1), g1, uniform_int(rng, 0, 15)}), kNaN);
      clean.poison_outputs();
      bad.poison_outputs();
      clean.run();
      bad.run();
      const ExpectRule rule = [&](int b, int, int h, int) {
        if (b == 0 && h == h0) return Expect::kNan;
        if (b == 2 && h / 2 == g1) return Expect::kNan;
        return Expect::kSame;
      };
      expect_pattern("out", bad.out, clean.out, false, rule);
      expect_pattern("lse", bad.lse, clean.lse, true, rule);
    }
  }
}

}  // namespace
}  // namespace flashattn::test
