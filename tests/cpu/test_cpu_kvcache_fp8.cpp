// CPU backend, fp8 (e4m3) KV cache: per-head and per-(block, head) scales over random
// paged layouts (block sizes 1..256, shuffled and shared blocks) and dense caches with
// cache_batch_idx, against the fp64 oracle on the dequantized cache; the append
// quantizes k_new / v_new into the cache (checked bytewise against
// semantics::quantize_e4m3 at the expected slots, everything else untouched); split
// counts agree with no split; unused slots (e4m3 NaN 0x7F / 0xFF, NaN scales of unused
// blocks) never reach out / lse. Also the measured error of an fp8 cache against a bf16
// one (docs/semantics.md).
#include <cmath>
#include <cstdio>
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
  std::string s = "fp8 cache, " + std::string(k.per_block_scales ? "per-block" : "per-head") +
                  " scales; b=" + std::to_string(k.batch) + " s_q=" + std::to_string(k.s_q) +
                  " s_new=" + std::to_string(k.s_new) + " h_q=" + std::to_string(k.h_q) +
                  " h_k=" + std::to_string(k.h_k) + " d=" + std::to_string(k.d) + " " +
                  dtype_name(k.dtype) + " block_size=" + std::to_string(k.block_size) +
                  " shared=" + std::to_string(k.share_blocks) + " batch_idx=" + std::to_string(k.use_batch_idx) +
                  " splits=" + std::to_string(c.num_splits) + " cache_seqlens=";
  for (int len : c.cache_lens) s += std::to_string(len) + ",";
  return s + " " + describe(c.call_options());
}

ForwardResults check_fp8(KVCacheCase& c, const ForwardExpectation* expectation = nullptr) {
  SCOPED_TRACE(describe_case(c) + " (an append quantizes with quantize_e4m3)");
  return run_and_check_kvcache(c, expectation);
}

KVCacheConfig random_config(Rng& rng) {
  KVCacheConfig cfg;
  cfg.fp8 = true;
  cfg.per_block_scales = coin(rng);
  cfg.batch = uniform_int(rng, 1, 4);
  cfg.s_q = uniform_int(rng, 1, 6);
  cfg.s_new = coin(rng, 0.7) ? uniform_int(rng, 1, 6) : 0;
  cfg.h_k = uniform_int(rng, 1, 3);
  cfg.h_q = cfg.h_k * uniform_int(rng, 1, 3);
  cfg.d = std::vector<int>{1, 5, 16, 64, 128}[static_cast<std::size_t>(uniform_int(rng, 0, 4))];
  cfg.dtype = std::vector<DType>{DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                                 DType::kFloat64}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
  cfg.block_size = std::vector<int>{0, 1, 3, 16, 64, 256}[static_cast<std::size_t>(uniform_int(rng, 0, 5))];
  cfg.use_batch_idx = cfg.block_size == 0 && coin(rng);
  cfg.cache_rows = cfg.use_batch_idx ? cfg.batch + uniform_int(rng, 0, 3) : 0;
  cfg.share_blocks = cfg.block_size > 0 && coin(rng);
  cfg.max_cache_len = uniform_int(rng, 0, 300);
  return cfg;
}

TEST(CpuKVCacheFp8, RandomLayoutsAgainstOracle) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 24; ++trial) {
    const KVCacheConfig cfg = random_config(rng);
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 100);
    if (coin(rng, 0.2)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 8.0));
    if (coin(rng, 0.3)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, per_batch), per_batch);
    }
    c.num_splits = std::vector<int>{1, 2, 7, 0}[static_cast<std::size_t>(uniform_int(rng, 0, 3))];
    check_fp8(c);
  }
}

TEST(CpuKVCacheFp8, PerHeadAndPerBlockScalesEveryBlockSize) {
  FA_SEEDED_RNG(rng);
  for (int block_size : {1, 2, 16, 100, 256}) {
    for (bool per_block : {false, true}) {
      KVCacheConfig cfg;
      cfg.fp8 = true;
      cfg.per_block_scales = per_block;
      cfg.batch = 3;
      cfg.s_q = 2;
      cfg.s_new = 2;
      cfg.h_q = 4;
      cfg.h_k = 2;
      cfg.d = 32;
      cfg.dtype = DType::kBFloat16;
      cfg.block_size = block_size;
      cfg.share_blocks = true;
      cfg.cache_lens = {uniform_int(rng, 260, 400), uniform_int(rng, 260, 400), uniform_int(rng, 0, 50)};
      // Scales over a wide range: per-block scales that differ by 100x make a wrong
      // block's scale visible.
      cfg.scale_lo = 0.002;
      cfg.scale_hi = 0.2;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.opts.causal = true;
      check_fp8(c);
    }
  }
}

TEST(CpuKVCacheFp8, SplitCountsAgreeWithNoSplit) {
  FA_SEEDED_RNG(rng);
  for (int block_size : {0, 16}) {
    KVCacheConfig cfg;
    cfg.fp8 = true;
    cfg.per_block_scales = block_size > 0;
    cfg.batch = 3;
    cfg.s_q = 3;
    cfg.s_new = 1;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 16;
    cfg.dtype = DType::kFloat32;
    cfg.block_size = block_size;
    cfg.cache_lens = {uniform_int(rng, 0, 5), uniform_int(rng, 300, 600), uniform_int(rng, 60, 130)};
    KVCacheCase base = KVCacheCase::make(rng, cfg);
    base.opts.causal = true;
    const RefProblem p = base.problem();
    const ForwardExpectation expect = ForwardExpectation::of(p, cfg.dtype);
    expect_split_counts_agree(base, expect, cfg.dtype, {1, 2, 7, 0, 16},
                              [&](KVCacheCase& c) { return check_fp8(c, &expect); });
  }
}

// Appended values beyond the e4m3 range saturate at +-448 * scale; the cache bytes equal
// the semantics encoder's at the destination block's scale, and the result uses them.
TEST(CpuKVCacheFp8, AppendQuantizesAndSaturates) {
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    for (int block_size : {0, 1, 7}) {
      KVCacheConfig cfg;
      cfg.fp8 = true;
      cfg.per_block_scales = coin(rng);
      cfg.batch = 2;
      cfg.s_q = 5;
      cfg.s_new = 5;
      cfg.h_q = 2;
      cfg.h_k = 2;
      cfg.d = 8;
      cfg.dtype = dtype;
      cfg.block_size = block_size;
      cfg.cache_lens = {uniform_int(rng, 0, 20), uniform_int(rng, 0, 20)};
      cfg.scale_lo = 0.001;  // N(0, 1) / 0.001 exceeds 448 for |x| > 0.448: saturation is common
      cfg.scale_hi = 0.004;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      int saturated = 0;
      for (int b = 0; b < cfg.batch; ++b)
        for (int r = 0; r < cfg.s_new; ++r) {
          const auto [slot, row] = c.locate(b, c.cache_lens[b] + r);
          for (int e = 0; e < cfg.h_k * cfg.d; ++e) {
            const std::int64_t at = (std::int64_t(slot) * c.k_cache.size(1) + row) * cfg.h_k * cfg.d + e;
            const std::uint8_t byte = c.k_cache_expected.as<std::uint8_t>()[at];
            saturated += (byte & 0x7F) == 0x7E;
            // Independent of the encoder: the stored value is the nearest e4m3 value (or
            // +-448) to x / scale.
            const double x = c.k_new.get((std::int64_t(b) * cfg.s_new + r) * cfg.h_k * cfg.d + e);
            const float q = static_cast<float>(x) / c.k_scale_of(slot, e / cfg.d);
            const double stored = e4m3_reference(byte);
            const double clamped = std::fmax(-448.0, std::fmin(448.0, double(q)));
            EXPECT_LE(std::fabs(stored - clamped), std::ldexp(std::fabs(clamped), -4) + std::ldexp(1.0, -10))
                << "x=" << x << " byte=" << int(byte);
          }
        }
      EXPECT_GT(saturated, 0) << "no saturated element: the test does not test saturation";
      check_fp8(c);
    }
  }
}

// Every slot no sequence uses holds an e4m3 NaN (0x7F / 0xFF) and every unused block a
// NaN scale; none of it may reach the result.
TEST(CpuKVCacheFp8, NaNSlotsAndScalesNeverRead) {
  FA_SEEDED_RNG(rng);
  for (int block_size : {0, 5, 64}) {
    KVCacheConfig cfg;
    cfg.fp8 = true;
    cfg.per_block_scales = true;
    cfg.batch = 3;
    cfg.s_q = 4;
    cfg.s_new = 3;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 16;
    cfg.dtype = DType::kBFloat16;
    cfg.block_size = block_size;
    cfg.extra_blocks = 3;
    cfg.use_batch_idx = block_size == 0;
    cfg.cache_rows = block_size == 0 ? 5 : 0;
    cfg.s_cache = block_size == 0 ? 200 : 0;
    cfg.cache_lens = {uniform_int(rng, 1, 60) * 2 + 1, 0, uniform_int(rng, 30, 120)};
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    std::int64_t nan_bytes = 0, nan_scales = 0;
    for (std::int64_t i = 0; i < c.k_cache.numel(); ++i) {
      const std::uint8_t byte = c.k_cache.as<std::uint8_t>()[i];
      nan_bytes += (byte & 0x7F) == 0x7F;
    }
    for (std::int64_t i = 0; i < c.k_scale.numel(); ++i) nan_scales += std::isnan(c.k_scale.as<float>()[i]);
    ASSERT_GT(nan_bytes, 0);
    ASSERT_GT(nan_scales, 0) << "no unused block or row";
    for (int splits : {1, 3}) {
      KVCacheCase run = c;
      run.num_splits = splits;
      run.opts.causal = true;
      const ForwardResults got = check_fp8(run);
      EXPECT_TRUE(fully_written("out", got.out));
      EXPECT_TRUE(all_finite("out", got.out));
      for (int h = 0; h < cfg.h_q; ++h)
        for (int i = 1; i < cfg.s_q; ++i) EXPECT_TRUE(std::isfinite(run.lse.at({1, h, i})));  // query 0 of 4 sees none of 3 keys
    }
  }
}

// ------------------------------------------------------------------ error vs a bf16 cache

// The fp8 cache against the bf16 cache it was quantized from: keys and values N(0, 1)
// in bf16, q N(0, 1) in bf16, per-head scales amax / 448 (amax over the head's whole
// cache) or per-block ones (amax of the block), decode (s_q = 1) over s_k keys. The
// error is max |out_fp8 - out_ref| where out_ref is the fp64 oracle on the bf16 cache;
// the bf16 cache's own error max |out_bf16 - out_ref| is printed beside it.
struct Fp8Error {
  double fp8 = 0, bf16 = 0, max_out = 0;
  double fp8_over_bound = 0;  // max over elements of |out_fp8 - out_ref| / fp8_cache_bound
};

// What quantizing the cache can do to each output element, from the data (no mask, no
// modifiers): with score errors |s'_j - s_j| <= delta (s = scale q . k on the exact cache,
// s' on the dequantized one) every probability moves by a factor in [e^-2delta, e^2delta],
// so |out'_c - out_c| <= (e^2delta - 1) sum_j P_j |v'_jc| + sum_j P_j |v'_jc - v_jc|, plus
// the output's rounding to bf16 (2^-8 of its magnitude, fp32 sums inside it). P and out
// are the oracle's on the exact cache.
std::vector<double> fp8_cache_bound(const RefProblem& exact, const RefProblem& quantized,
                                    const std::vector<RefOutput>& ref) {
  std::vector<double> bound;
  const int g_size = exact.h_q / exact.h_k;
  for (std::size_t b = 0; b < exact.seqs.size(); ++b) {
    const RefSeq& e = exact.seqs[b];
    const RefSeq& qz = quantized.seqs[b];
    for (int i = 0; i < e.s_q; ++i)
      for (int h = 0; h < exact.h_q; ++h) {
        const int g = h / g_size;
        const double* qi = &e.q[(std::size_t(i) * exact.h_q + h) * exact.d];
        const double* p = &ref[b].probs[(std::size_t(h) * e.s_q + i) * e.s_k];
        double delta = 0;
        for (int j = 0; j < e.s_k; ++j) {
          double diff = 0;
          for (int c = 0; c < exact.d; ++c) {
            const std::size_t at = (std::size_t(j) * exact.h_k + g) * exact.d + c;
            diff += qi[c] * (qz.k[at] - e.k[at]);
          }
          delta = std::fmax(delta, exact.scale * std::fabs(diff));
        }
        const double spread = std::expm1(2 * delta);
        for (int c = 0; c < exact.d_v; ++c) {
          double mag = 0, moved = 0;
          for (int j = 0; j < e.s_k; ++j) {
            const std::size_t at = (std::size_t(j) * exact.h_k + g) * exact.d_v + c;
            mag += p[j] * std::fabs(qz.v[at]);
            moved += p[j] * std::fabs(qz.v[at] - e.v[at]);
          }
          const double out = ref[b].out[(std::size_t(i) * exact.h_q + h) * exact.d_v + c];
          const double quant = spread * mag + moved;
          bound.push_back(quant + std::ldexp(std::fabs(out) + quant + 1e-3 * mag, -8) + 1e-12);
        }
      }
  }
  return bound;
}

Fp8Error measure_fp8_error(Rng& rng, int s_k, int d, bool per_block, int block_size) {
  const int B = 4, h_q = 8, h_k = 2;
  KVCacheConfig cfg;
  cfg.batch = B;
  cfg.s_q = 1;
  cfg.h_q = h_q;
  cfg.h_k = h_k;
  cfg.d = d;
  cfg.dtype = DType::kBFloat16;
  cfg.block_size = block_size;
  cfg.cache_lens.assign(B, s_k);
  KVCacheCase bf = KVCacheCase::make(rng, cfg);  // the bf16 cache, N(0, 1)
  cfg.fp8 = true;
  cfg.per_block_scales = per_block;
  KVCacheCase f8 = KVCacheCase::make(rng, cfg);  // same layout; cache re-quantized below
  f8.q = bf.q;
  f8.block_table = bf.block_table;
  f8.block_table_t = bf.block_table_t;
  // Scales: amax / 448 of each (slot or whole cache, head), then the quantized bytes.
  const std::int64_t slots = bf.k_cache.size(0), rows = bf.k_cache.size(1);
  for (HostTensor* scale : {&f8.k_scale, &f8.v_scale}) {
    const bool is_k = scale == &f8.k_scale;
    const HostTensor& src = is_k ? bf.k_cache : bf.v_cache;
    HostTensor& dst = is_k ? f8.k_cache : f8.v_cache;
    std::vector<double> amax(static_cast<std::size_t>(slots * h_k), 0.0);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < s_k; ++j) {
        const auto [slot, row] = bf.locate(b, j);
        for (int g = 0; g < h_k; ++g)
          for (int c = 0; c < d; ++c) {
            const double x = src.at({slot, row, g, c});
            double& m = amax[static_cast<std::size_t>((per_block ? slot : 0) * h_k + g)];
            m = std::fmax(m, std::fabs(x));
          }
      }
    float* sc = scale->as<float>();
    for (std::int64_t r = 0; r < (per_block ? slots : 1); ++r)
      for (int g = 0; g < h_k; ++g) {
        const double m = amax[static_cast<std::size_t>(r * h_k + g)];
        sc[r * h_k + g] = m > 0 ? static_cast<float>(m / 448.0) : 1.0f;
      }
    for (std::int64_t slot = 0; slot < slots; ++slot)
      for (std::int64_t row = 0; row < rows; ++row)
        for (int g = 0; g < h_k; ++g)
          for (int c = 0; c < d; ++c) {
            const std::int64_t at = dst.index({slot, row, g, c});
            const float s = sc[(per_block ? slot : 0) * h_k + g];
            dst.as<std::uint8_t>()[at] = semantics::quantize_e4m3(static_cast<float>(src.get(at)), s);
          }
  }
  f8.k_cache_expected = f8.k_cache;
  f8.v_cache_expected = f8.v_cache;
  bf.run();
  f8.run();
  const std::vector<RefOutput> ref_outputs = reference_forward(bf.problem());
  const std::vector<double> ref = concat_out(ref_outputs);
  Fp8Error e;
  const std::vector<double> got = f8.out.to_double();
  e.fp8 = error_stats(got, ref).max_abs_err;
  const std::vector<double> bound = fp8_cache_bound(bf.problem(), f8.problem(), ref_outputs);
  EXPECT_EQ(bound.size(), got.size());
  for (std::size_t x = 0; x < got.size() && x < bound.size(); ++x)
    e.fp8_over_bound = std::fmax(e.fp8_over_bound, std::fabs(got[x] - ref[x]) / bound[x]);
  const ErrorStats s = error_stats(bf.out.to_double(), ref);
  e.bf16 = s.max_abs_err;
  e.max_out = s.max_abs_ref;
  // The fp8 result against the oracle on its own dequantized cache: the backend is exact
  // up to rounding; the difference above is the quantization.
  expect_forward_matches(f8.problem(), DType::kBFloat16, forward_results(f8));
  return e;
}

// The documented bound (docs/semantics.md): each element of the output stays within
// what the cache's quantization allows, computed from the data (fp8_cache_bound). The
// relative figure max |out_fp8 - out_ref| / max |out_ref| is printed: typically 0.04-0.08
// for N(0, 1) keys and values with amax / 448 scales, 0.127 seen (s_k = 256, seed
// 9184709345532581192: a small max |out_ref|), while the bf16 cache stays below 0.004.
// e4m3 keeps 3 mantissa bits, so each cached value is off by up to 2^-4 relative;
// per-block scales change the range, not that precision.
TEST(CpuKVCacheFp8, ErrorAgainstBf16Cache) {
  FA_SEEDED_RNG(rng);
  for (int s_k : {16, 256, 2048}) {
    for (bool per_block : {false, true}) {
      double worst_fp8 = 0, worst_bf16 = 0, worst_rel = 0, worst_rel_bf16 = 0, worst_over = 0;
      for (int trial = 0; trial < 3; ++trial) {
        const Fp8Error e = measure_fp8_error(rng, s_k, 128, per_block, 64);
        worst_fp8 = std::fmax(worst_fp8, e.fp8);
        worst_bf16 = std::fmax(worst_bf16, e.bf16);
        worst_rel = std::fmax(worst_rel, e.fp8 / e.max_out);
        worst_rel_bf16 = std::fmax(worst_rel_bf16, e.bf16 / e.max_out);
        worst_over = std::fmax(worst_over, e.fp8_over_bound);
      }
      std::printf("fp8 cache error: s_k=%d d=128 %s scales: max|out_fp8 - ref| = %.5f (%.4f of max|ref|), "
                  "max|out_bf16 - ref| = %.5f (%.4f of max|ref|), error / quantization bound <= %.3f\n",
                  s_k, per_block ? "per-block(64)" : "per-head", worst_fp8, worst_rel, worst_bf16, worst_rel_bf16,
                  worst_over);
      RecordProperty("fp8_rel_err_sk" + std::to_string(s_k) + (per_block ? "_block" : "_head"), std::to_string(worst_rel));
      EXPECT_LE(worst_over, 1.0) << "an output element beyond what the quantization allows";
      EXPECT_GT(worst_over, 0.0);
      EXPECT_GT(worst_fp8, worst_bf16) << "the fp8 cache should be the coarser one";
    }
  }
}

}  // namespace
}  // namespace flashattn::test
