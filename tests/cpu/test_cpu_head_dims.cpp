// CPU backend, head dims: v with another head dim than q and k (d_v != d, DeepSeek-V3's
// (192, 128) prefill), head dims up to 512, and MLA decode through FlashAttention-3's qv
// (scores = scale * (q . k + qv . v), many query heads over one latent KV head, paged).
// Forward, backward (dq, dk of d; dv, out, dout of d_v), varlen, KV cache (dense, paged,
// split-KV, append, fp8, sinks, softcap, ALiBi, windows, tree masks) against the fp64
// oracle (reference.hpp: v, out, dout of d_v; qv joins the dot product); the default scale
// (1/sqrt(d), and 1/sqrt(d + d_v) with qv).
#include <cmath>
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr DType kAllDtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64};

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d, int d_v) {
  Shape s{b, s_q, s_k, h_q, h_k, d};
  s.d_v = d_v;
  return s;
}

void check_dense(DenseCase& c, bool with_backward) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  ASSERT_EQ(p.dv(), c.shape.dv());
  const ForwardResults fwd = forward_results(c);
  ASSERT_EQ(fwd.out.size(), static_cast<std::size_t>(c.shape.batch) * c.shape.s_q * c.shape.h_q * c.shape.dv());
  expect_forward_matches(p, c.dtype, fwd);
  if (!with_backward) return;
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
}

// ------------------------------------------------------------------ dense, d_v != d

struct Dims {
  const char* name;
  int s_q, s_k, h_q, h_k, d, d_v;
  bool causal;
  int left, right;
  float softcap;
  float dropout;
};

void PrintTo(const Dims& f, std::ostream* os) { *os << f.name; }

class CpuHeadDims : public ::testing::TestWithParam<Dims> {};

TEST_P(CpuHeadDims, ForwardAndBackwardMatchOracleInEveryDtype) {
  const Dims& f = GetParam();
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, f.s_q, f.s_k, f.h_q, f.h_k, f.d, f.d_v), dtype);
    c.opts.causal = f.causal;
    c.opts.window_left = f.left;
    c.opts.window_right = f.right;
    c.opts.softcap = f.softcap;
    c.opts.dropout_p = f.dropout;
    c.opts.seed = rng();
    c.opts.offset = rng();
    check_dense(c, true);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, CpuHeadDims,
    ::testing::Values(Dims{"deepseek_192_128", 37, 45, 2, 2, 192, 128, false, -1, -1, 0, 0},
                      Dims{"d64_dv32_gqa", 29, 70, 6, 2, 64, 32, false, -1, -1, 0, 0},
                      Dims{"d40_dv72_causal", 70, 41, 4, 4, 40, 72, true, -1, 0, 0, 0},
                      Dims{"d192_dv128_causal_gqa", 66, 66, 4, 1, 192, 128, true, -1, 0, 0, 0},
                      Dims{"d17_dv5_window", 33, 50, 3, 1, 17, 5, false, 9, 4, 0, 0},
                      Dims{"d8_dv24_softcap", 21, 30, 2, 1, 8, 24, false, -1, -1, 5.0f, 0},
                      Dims{"d24_dv8_dropout_causal", 40, 40, 4, 2, 24, 8, true, -1, 0, 0, 0.15f},
                      Dims{"d1_dv3", 9, 11, 2, 2, 1, 3, false, -1, -1, 0, 0},
                      Dims{"d3_dv1", 9, 11, 2, 2, 3, 1, false, -1, -1, 0, 0}),
    [](const ::testing::TestParamInfo<Dims>& info) { return std::string(info.param.name); });

// ALiBi, a learnable sink (with its gradient) and the debug probabilities, d_v != d.
TEST(CpuHeadDims, AlibiSinkAndProbs) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat64}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 19, 27, 4, 2, 48, 16), dtype);
    c.opts.causal = true;
    c.set_alibi(random_alibi(rng, 2, 4, true), true);
    c.sink.set(random_sink(rng, 4));
    c.want_probs();
    check_dense(c, true);
  }
}

// The default scale is 1/sqrt(d) of q and k, not of v: the call with no softmax_scale is
// bit-identical to the call with 1/sqrt(d) and differs from 1/sqrt(d_v).
TEST(CpuHeadDims, DefaultScaleIsOneOverSqrtOfQKHeadDim) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 9, 13, 2, 1, 64, 16), DType::kFloat32);
  c.run_forward();
  const HostTensor by_default = c.out;
  c.opts.softmax_scale = 1.0f / std::sqrt(64.0f);
  c.poison_forward();
  c.run_forward();
  EXPECT_TRUE(c.out.bitwise_equal(by_default));
  c.opts.softmax_scale = 1.0f / std::sqrt(16.0f);
  c.poison_forward();
  c.run_forward();
  EXPECT_FALSE(c.out.bitwise_equal(by_default));
}

// Central differences of the public fp64 forward for dq, dk, dv with d_v != d: checks the
// backward independently of the oracle's formulas (which this change extended too).
TEST(CpuHeadDims, FiniteDifferencesFp64) {
  FA_SEEDED_RNG(rng);
  struct Fd {
    int s_q, s_k, h_q, h_k, d, d_v;
    bool causal;
    float softcap, dropout;
  };
  for (const Fd& f : {Fd{4, 5, 2, 1, 3, 6, false, 0, 0}, Fd{6, 4, 4, 2, 5, 2, true, 1.5f, 0},
                      Fd{7, 8, 2, 1, 2, 4, false, 0, 0.3f}}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, f.s_q, f.s_k, f.h_q, f.h_k, f.d, f.d_v),
                                    DType::kFloat64);
    c.opts.causal = f.causal;
    c.opts.softcap = f.softcap;
    c.opts.dropout_p = f.dropout;
    c.opts.seed = rng();
    c.opts.num_threads = 1;  // thousands of tiny forwards: no team start-up each
    SCOPED_TRACE(c.shape.str() + " " + describe(c.call_options()));
    expect_gradients_match_central_differences(c);
  }
}

// ------------------------------------------------------------------ head dims up to 512

TEST(CpuHeadDims512, ForwardAndBackwardMatchOracle) {
  FA_SEEDED_RNG(rng);
  struct Case {
    int d, d_v;
    bool causal;
  };
  for (const Case& k : {Case{512, 512, false}, Case{512, 512, true}, Case{512, 128, true},
                        Case{96, 512, false}, Case{264, 264, true}, Case{505, 511, false}}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      DenseCase c = DenseCase::random(rng, shape_of(1, 67, 70, 2, 1, k.d, k.d_v), dtype);
      c.opts.causal = k.causal;
      check_dense(c, true);
    }
  }
}

TEST(CpuHeadDims512, Fp16AndFp64WithDropout) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat64}) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 20, 33, 2, 2, 512, 512), dtype);
    c.opts.dropout_p = 0.1f;
    c.opts.seed = rng();
    check_dense(c, true);
  }
}

// ------------------------------------------------------------------ varlen

void check_varlen(VarlenCase& c) {
  SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " d=" + std::to_string(c.d) + " d_v=" +
               std::to_string(c.d_v) + " h_q=" + std::to_string(c.h_q) + " h_k=" +
               std::to_string(c.h_k) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
  // Rows and keys past seqused_q / seqused_k: out, dq, dk, dv 0.
  for (double x : c.q_unused_rows(c.out)) EXPECT_EQ(x, 0.0);
  for (double x : c.q_unused_rows(c.dq)) EXPECT_EQ(x, 0.0);
  for (double x : c.dkv_unused_rows()) EXPECT_EQ(x, 0.0);
}

TEST(CpuHeadDimsVarlen, EmptySequencesSequsedAndWindows) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {0, 5, 0, 17, 1, 30, 9};
  const std::vector<int> lk = {7, 0, 0, 23, 1, 12, 40};
  for (DType dtype : kAllDtypes) {
    for (int mode = 0; mode < 3; ++mode) {
      const int d = mode == 1 ? 192 : 40, d_v = mode == 1 ? 128 : 72;
      VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 4, 2, d, dtype, 3, 2, d_v);
      ASSERT_EQ(c.v.size(2), d_v);
      c.opts.causal = mode != 0;
      if (mode == 2) {
        c.opts.window_left = 6;
        c.set_seqused_k({3, 0, 0, 20, 1, 12, 33});
        c.set_seqused_q({0, 4, 0, 17, 0, 11, 9});
      }
      check_varlen(c);
    }
  }
}

TEST(CpuHeadDimsVarlen, DropoutSoftcapAnd512) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {13, 1, 29}, lk = {19, 4, 29};
  VarlenCase c = VarlenCase::make(rng, offsets(lq), offsets(lk), 6, 3, 16, DType::kBFloat16, 0, 0, 64);
  c.opts.dropout_p = 0.2f;
  c.opts.seed = rng();
  c.opts.softcap = 3.0f;
  c.opts.causal = true;
  check_varlen(c);
  VarlenCase w = VarlenCase::make(rng, offsets(lq), offsets(lk), 2, 1, 512, DType::kFloat32, 1, 1, 512);
  w.opts.causal = true;
  check_varlen(w);
}

// ------------------------------------------------------------------ KV cache

void check_kvcache(KVCacheCase& c) {
  SCOPED_TRACE("b=" + std::to_string(c.cfg.batch) + " s_q=" + std::to_string(c.cfg.s_q) + " h_q=" +
               std::to_string(c.cfg.h_q) + " h_k=" + std::to_string(c.cfg.h_k) + " d=" +
               std::to_string(c.cfg.d) + " d_v=" + std::to_string(c.cfg.dv()) + " qv=" +
               std::to_string(c.cfg.qv) + " block_size=" + std::to_string(c.cfg.block_size) +
               " splits=" + std::to_string(c.num_splits) + " " + dtype_name(c.cfg.dtype) + " " +
               describe(c.call_options()));
  run_and_check_kvcache(c);
}

TEST(CpuHeadDimsKVCache, DensePagedSplitsAppendAndGqa) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    for (int block_size : {0, 16}) {
      for (int s_q : {1, 5}) {
        for (int splits : {1, 3, 0}) {
          KVCacheConfig cfg;
          cfg.batch = 3;
          cfg.s_q = s_q;
          cfg.s_new = s_q == 5 ? 2 : 1;
          cfg.h_q = 8;  // GQA 4: s_q = 1 packs the group's heads into one task
          cfg.h_k = 2;
          cfg.d = block_size ? 24 : 40;
          cfg.d_v = block_size ? 56 : 8;
          cfg.dtype = dtype;
          cfg.block_size = block_size;
          cfg.max_cache_len = 300;
          cfg.cache_lens = {uniform_int(rng, 0, 300), 0, 257};
          KVCacheCase c = KVCacheCase::make(rng, cfg);
          ASSERT_EQ(c.v_cache.size(3), cfg.dv());
          c.num_splits = splits;
          c.opts.causal = true;
          if (splits == 3) c.opts.window_left = 100;
          check_kvcache(c);
        }
      }
    }
  }
}

TEST(CpuHeadDimsKVCache, Fp8CacheAndBatchIdx) {
  FA_SEEDED_RNG(rng);
  for (bool per_block : {false, true}) {
    KVCacheConfig cfg;
    cfg.batch = 2;
    cfg.s_q = 2;
    cfg.s_new = 2;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 32;
    cfg.d_v = 16;
    cfg.dtype = DType::kBFloat16;
    cfg.fp8 = true;
    cfg.per_block_scales = per_block;
    cfg.block_size = per_block ? 8 : 0;
    cfg.use_batch_idx = !per_block;
    cfg.cache_rows = per_block ? 0 : 4;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    check_kvcache(c);
  }
}

// The CUDA suite's (d, d_v) pairs and features on the CPU backend (the specification that
// test_cuda_kvcache_head_dim_v.cpp compares the device against): bf16 / fp16, dense through
// cache_batch_idx over spare rows, paged with odd blocks, appends, windows, GQA, learnable
// sinks, softcap with ALiBi, and a draft-tree mask (CPU only with d_v != d: CUDA's decode
// kernel, which runs tree masks, has one head dim).
TEST(CpuHeadDimsKVCache, SinksSoftcapAlibiWindowsAndTrees) {
  FA_SEEDED_RNG(rng);
  struct Pair {
    int d, d_v;
  };
  int variant = 0;
  for (const Pair hd : {Pair{192, 128}, Pair{64, 128}, Pair{96, 160}}) {
    for (int it = 0; it < 4; ++it, ++variant) {
      KVCacheConfig cfg;
      cfg.dtype = it % 2 ? DType::kBFloat16 : DType::kFloat16;
      cfg.batch = 3;
      cfg.h_k = 2;
      cfg.h_q = it == 1 ? 8 : 2;
      cfg.d = hd.d;
      cfg.d_v = hd.d_v;
      cfg.s_q = it == 0 ? 1 : it == 1 ? 6 : it == 2 ? 13 : 5;
      cfg.s_new = it == 3 ? cfg.s_q : it;
      cfg.max_cache_len = 200;
      cfg.cache_lens = {2 * uniform_int(rng, 0, 99) + 1, 0, 2 * uniform_int(rng, 40, 90) + 1};
      cfg.block_size = it == 1 ? 5 : it == 3 ? 16 : 0;
      if (it == 2) {
        cfg.use_batch_idx = true;
        cfg.cache_rows = cfg.batch + 2;
        cfg.s_cache = cfg.max_cache_len + cfg.s_new + 9;
      }
      if (it == 3) cfg.tree = KVCacheConfig::Tree::kRandom;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      ASSERT_EQ(c.v_cache.size(3), hd.d_v);
      c.opts.causal = it != 0;
      if (it == 1) {
        c.sink.want_grad = false;
        c.sink.set(random_sink(rng, cfg.h_q));
        c.opts.window_left = 61;
      }
      if (it == 2) {
        c.opts.softcap = 5.0f;
        c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, variant % 2 == 0), variant % 2 == 0);
        c.opts.window_left = 2 * uniform_int(rng, 0, 40) + 1;
      }
      c.num_splits = it == 2 ? 3 : 0;
      check_kvcache(c);
    }
  }
}

// ------------------------------------------------------------------ MLA (qv)

// DeepSeek's MLA decode at reduced size: one latent KV head (h_k = 1) shared by h_q = 16
// query heads; k_cache holds the rope part (d = 64 here, 64 in DeepSeek), v_cache the
// latent (d_v = 128 here, 512 in DeepSeek), qv the query's latent part.
KVCacheConfig mla_config(DType dtype, int block_size) {
  KVCacheConfig cfg;
  cfg.batch = 3;
  cfg.s_q = 1;
  cfg.h_q = 16;
  cfg.h_k = 1;
  cfg.d = 64;
  cfg.d_v = 128;
  cfg.qv = true;
  cfg.dtype = dtype;
  cfg.block_size = block_size;
  cfg.max_cache_len = 200;
  return cfg;
}

TEST(CpuMla, PagedDecodeMatchesOracle) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    for (int splits : {1, 4, 0}) {
      KVCacheConfig cfg = mla_config(dtype, 16);
      cfg.cache_lens = {uniform_int(rng, 1, 200), 0, 131};
      cfg.s_new = splits == 4 ? 1 : 0;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      ASSERT_EQ(c.qv.size(3), 128);
      c.num_splits = splits;
      check_kvcache(c);
    }
  }
}

TEST(CpuMla, MultiTokenDenseCausalSinkAndSoftcap) {
  FA_SEEDED_RNG(rng);
  for (int variant = 0; variant < 3; ++variant) {
    KVCacheConfig cfg = mla_config(DType::kBFloat16, variant == 1 ? 0 : 4);
    cfg.s_q = 3;
    cfg.s_new = 3;
    cfg.h_q = variant == 2 ? 4 : 16;
    cfg.h_k = variant == 2 ? 2 : 1;
    cfg.d = variant == 2 ? 16 : 64;
    cfg.d_v = variant == 2 ? 40 : 128;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    if (variant == 1) c.opts.softcap = 10.0f;
    if (variant == 2) c.sink.set(random_sink(rng, cfg.h_q));
    if (variant == 0) c.opts.softmax_scale = 0.05f;
    check_kvcache(c);
  }
}

TEST(CpuMla, Fp8Cache) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = mla_config(DType::kBFloat16, 8);
  cfg.fp8 = true;
  cfg.per_block_scales = true;
  cfg.scale_lo = 0.1;  // keeps q . k + qv . v of the dequantized cache moderate
  cfg.scale_hi = 0.2;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  check_kvcache(c);
}

// qv really enters the score: the result differs from the call without qv, and with qv = 0
// it equals the call without qv at the same (explicit) scale.
TEST(CpuMla, QvEntersTheScore) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = mla_config(DType::kFloat32, 16);
  cfg.cache_lens = {50, 77, 3};
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.softmax_scale = 0.1f;
  c.run();
  const HostTensor with_qv = c.out;
  c.cfg.qv = false;
  c.poison_outputs();
  c.run();
  EXPECT_FALSE(c.out.bitwise_equal(with_qv));
  const HostTensor without = c.out;
  c.cfg.qv = true;
  c.qv.fill(0.0);
  c.poison_outputs();
  c.run();
  EXPECT_TRUE(c.out.bitwise_equal(without));
}

// With qv the default scale is 1/sqrt(d + d_v) (FlashAttention-3's hopper interface).
TEST(CpuMla, DefaultScaleIsOneOverSqrtOfBothHeadDims) {
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = mla_config(DType::kFloat32, 0);
  cfg.cache_lens = {40, 9, 100};
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.run();
  const HostTensor by_default = c.out;
  c.opts.softmax_scale = 1.0f / std::sqrt(float(64 + 128));
  c.poison_outputs();
  c.run();
  EXPECT_TRUE(c.out.bitwise_equal(by_default));
  c.opts.softmax_scale = 1.0f / std::sqrt(64.0f);
  c.poison_outputs();
  c.run();
  EXPECT_FALSE(c.out.bitwise_equal(by_default));
}

// qv in the dense and varlen forward (FlashAttention-3's flash_attn_func / varlen take it too).
TEST(CpuMla, DenseAndVarlenForwardWithQv) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : kAllDtypes) {
    DenseCase c = DenseCase::random(rng, shape_of(2, 21, 37, 8, 1, 16, 48), dtype);
    c.set_qv(rng);
    c.opts.causal = dtype != DType::kFloat64;
    if (dtype == DType::kBFloat16) c.sink.set(random_sink(rng, 8));
    if (dtype == DType::kFloat32) c.want_probs();  // the debug probabilities see qv . v too
    check_dense(c, false);
    const std::vector<int> lq = {0, 5, 17, 1}, lk = {7, 0, 23, 40};
    VarlenCase v = VarlenCase::make(rng, offsets(lq), offsets(lk), 4, 2, 8, dtype, 2, 1, 24);
    v.set_qv(rng);
    v.opts.window_left = 9;
    v.opts.causal = true;
    v.poison_forward();
    ASSERT_NO_THROW(v.run_forward());
    expect_forward_matches(v.problem(), dtype, forward_results(v));
  }
}

TEST(CpuMla, DenseDefaultScaleWithQv) {
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 5, 9, 2, 1, 8, 32), DType::kFloat32);
  c.set_qv(rng);
  c.run_forward();
  const HostTensor by_default = c.out;
  c.opts.softmax_scale = 1.0f / std::sqrt(40.0f);
  c.poison_forward();
  c.run_forward();
  EXPECT_TRUE(c.out.bitwise_equal(by_default));
}

}  // namespace
}  // namespace flashattn::test
