// CPU backend, instruction-set paths (src/cpu/isa.hpp): every test runs on each path the CPU
// has (avx2, the x86-64-v3 baseline, everywhere; avx512bf16 where cpuid reports AVX-512 +
// AVX512_BF16) and skips the others. The bf16 kernels against a scalar fp64 computation on
// odd sizes; forward, backward and decode (KV cache) against the fp64 oracle on odd shapes,
// mostly bf16 (the dtype whose scores the avx512bf16 path computes differently).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/bf16_kernels.hpp"
#include "cpu/isa.hpp"
#include "flashattn/error.hpp"
#include "flashattn/half.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using detail::cpu::Isa;

// Forces a path for the scope of a test.
struct IsaScope {
  explicit IsaScope(Isa isa) { detail::cpu::set_isa_override(isa); }
  ~IsaScope() { detail::cpu::set_isa_override(std::nullopt); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

class CpuIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!detail::cpu::isa_supported(GetParam()))
      GTEST_SKIP() << "this CPU lacks the " << detail::cpu::isa_name(GetParam()) << " path";
    scope_.emplace(GetParam());
  }
  void TearDown() override { scope_.reset(); }
  std::optional<IsaScope> scope_;
};

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d, int d_v = 0) {
  return {b, s_q, s_k, h_q, h_k, d, d_v};
}

TEST(CpuIsaChoice, BaselineAlwaysSupportedAndOverrideRestores) {
  EXPECT_TRUE(detail::cpu::isa_supported(Isa::kAvx2));
  const Isa before = detail::cpu::active_isa();
  {
    IsaScope scope(Isa::kAvx2);
    EXPECT_EQ(detail::cpu::active_isa(), Isa::kAvx2);
  }
  EXPECT_EQ(detail::cpu::active_isa(), before);
  EXPECT_STREQ(detail::cpu::isa_name(Isa::kAvx512Bf16), "avx512bf16");
  if (!detail::cpu::isa_supported(Isa::kAvx512Bf16)) {
    try {
      detail::cpu::set_isa_override(Isa::kAvx512Bf16);
      ADD_FAILURE() << "forcing a path the CPU lacks did not throw";
    } catch (const Unsupported& e) {
      EXPECT_EQ(e.actual(), "avx512bf16");
    }
  }
}

// pack_block + dot_block against fp64 sums of the same products, on odd element counts,
// partial key blocks, zero (nullptr) rows and every row-strip size.
TEST(CpuIsaKernels, Bf16DotBlockMatchesFp64) {
  if (!detail::cpu::isa_supported(Isa::kAvx512Bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  namespace bx = detail::cpu::bf16x;
  FA_SEEDED_RNG(rng);
  for (int elems : {1, 2, 3, 31, 33, 64, 65, 130}) {
    for (int n : {1, 17, 64}) {
      for (int rows : {1, 2, 5, 7, 13}) {
        SCOPED_TRACE("elems " + std::to_string(elems) + " n " + std::to_string(n) + " rows " +
                     std::to_string(rows));
        const int pairs = (elems + 1) / 2;
        // Keys with a stride larger than the row (poisoned tail: must not be read).
        const int ldk = elems + 3;
        std::vector<std::uint16_t> k(std::size_t(n) * ldk, 0x7fc0);  // NaN poison
        std::vector<const std::uint16_t*> ptr(bx::kKeys, nullptr);
        for (int j = 0; j < n; ++j) {
          for (int c = 0; c < elems; ++c)
            k[std::size_t(j) * ldk + c] = float_to_bf16(static_cast<float>(uniform_real(rng, -2, 2)));
          ptr[j] = (j % 5 == 3) ? nullptr : &k[std::size_t(j) * ldk];
        }
        std::vector<std::uint32_t> packed(std::size_t(pairs) * bx::kKeys, 0xffffffffu);
        bx::pack_block(ptr.data(), n, elems, packed.data());
        std::vector<std::uint16_t> a(std::size_t(rows) * pairs * 2, 0);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < elems; ++c)
            a[std::size_t(r) * pairs * 2 + c] = float_to_bf16(static_cast<float>(uniform_real(rng, -2, 2)));
        std::vector<std::uint32_t> aw(std::size_t(rows) * pairs);
        std::memcpy(aw.data(), a.data(), aw.size() * sizeof(std::uint32_t));
        const int lds = bx::kKeys + 5;
        std::vector<float> s(std::size_t(rows) * lds, NAN);
        bx::dot_block(rows, pairs, aw.data(), pairs, packed.data(), s.data(), lds);
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < bx::kKeys; ++j) {
            double want = 0, mag = 0;
            if (j < n && ptr[j] != nullptr)
              for (int c = 0; c < elems; ++c) {
                const double x = double(bf16_to_float(a[std::size_t(r) * pairs * 2 + c])) *
                                 double(bf16_to_float(ptr[j][c]));
                want += x;
                mag += std::fabs(x);
              }
            const float got = s[std::size_t(r) * lds + j];
            ASSERT_TRUE(std::isfinite(got)) << "r " << r << " j " << j;
            EXPECT_LE(std::fabs(got - want), elems * 0x1p-24 * mag) << "r " << r << " j " << j;
          }
      }
    }
  }
}

// pack_transposed_pairs: word (row 2c, row 2c + 1) of column col at dst[col * kKeys / 2 + c],
// exact; zero rows past n and for nullptr rows; more than 256 columns (two chunks).
TEST(CpuIsaKernels, Bf16PackTransposedPairsExact) {
  if (!detail::cpu::isa_supported(Isa::kAvx512Bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  namespace bx = detail::cpu::bf16x;
  FA_SEEDED_RNG(rng);
  for (int cols : {1, 24, 64, 300}) {
    for (int n : {1, 17, 64}) {
      SCOPED_TRACE("cols " + std::to_string(cols) + " n " + std::to_string(n));
      const int ldv = cols + 3;
      std::vector<std::uint16_t> v(std::size_t(n) * ldv, 0x7fc0);  // NaN past each row
      std::vector<const std::uint16_t*> ptr(bx::kKeys, nullptr);
      for (int j = 0; j < n; ++j) {
        for (int c = 0; c < cols; ++c)
          v[std::size_t(j) * ldv + c] = static_cast<std::uint16_t>(rng() & 0xffffu);
        ptr[j] = (j % 5 == 3) ? nullptr : &v[std::size_t(j) * ldv];
      }
      std::vector<std::uint32_t> dst(std::size_t(cols) * (bx::kKeys / 2) + 7, 0xdeadbeefu);
      bx::pack_transposed_pairs(ptr.data(), n, cols, dst.data());
      auto elem = [&](int row, int col) -> std::uint32_t {
        return row < n && ptr[row] ? ptr[row][col] : 0u;
      };
      for (int col = 0; col < cols; ++col)
        for (int c = 0; c < bx::kKeys / 2; ++c)
          ASSERT_EQ(dst[std::size_t(col) * (bx::kKeys / 2) + c], elem(2 * c, col) | (elem(2 * c + 1, col) << 16))
              << "col " << col << " c " << c;
      for (std::size_t i = std::size_t(cols) * (bx::kKeys / 2); i < dst.size(); ++i)
        ASSERT_EQ(dst[i], 0xdeadbeefu) << "written past the end";
    }
  }
}

// softmax_grad_rows against the scalar formula in fp64 from the same fp32 argument: P within
// 4 fp32 ulps of exp, dS = P (dP - D) within as much; masked keys (outside [lo, hi), score
// -inf) and rows with lse = -inf exactly 0; a NaN score of a visible key gives NaN, of a
// masked key 0. pack_probs then rounds P and dS to bf16 words exactly as float_to_bf16 (after
// flushing subnormals to zero, as the instruction does).
TEST(CpuIsaKernels, Bf16SoftmaxGradRowsAndPackProbs) {
  if (!detail::cpu::isa_supported(Isa::kAvx512Bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  namespace bx = detail::cpu::bf16x;
  constexpr int kN = bx::kKeys;
  FA_SEEDED_RNG(rng);
  for (int rows : {1, 7, 64}) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    const int ld = kN + 4;
    std::vector<float> s(std::size_t(rows) * ld), dp(s.size()), lse(rows), delta(rows);
    std::vector<int> lo(rows), hi(rows);
    const float scale = 0.3f;
    for (int r = 0; r < rows; ++r) {
      lse[r] = r == 2 ? -INFINITY : static_cast<float>(uniform_real(rng, 2, 9));
      delta[r] = static_cast<float>(uniform_real(rng, -1, 1));
      lo[r] = static_cast<int>(rng() % 20);
      hi[r] = r % 3 == 0 ? kN : lo[r] + static_cast<int>(rng() % (kN - lo[r] + 1));
      for (int j = 0; j < kN; ++j) {
        s[std::size_t(r) * ld + j] = static_cast<float>(uniform_real(rng, -400, 30));
        dp[std::size_t(r) * ld + j] = static_cast<float>(uniform_real(rng, -2, 2));
      }
    }
    s[0 * ld + 40] = NAN;    // visible in row 0 (hi = kN) when lo <= 40
    s[0 * ld + 63] = -INFINITY;
    const std::vector<float> s0 = s, dp0 = dp;
    bx::softmax_grad_rows(rows, s.data(), dp.data(), ld, scale, lse.data(), delta.data(), lo.data(), hi.data());
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < kN; ++j) {
        const std::size_t e = std::size_t(r) * ld + j;
        const float x = s0[e] * scale;
        const bool visible = j >= lo[r] && j < hi[r] && x != -INFINITY && lse[r] != -INFINITY;
        if (!visible) {
          ASSERT_EQ(s[e], 0.0f) << "P, r " << r << " j " << j;
          ASSERT_EQ(dp[e], 0.0f) << "dS, r " << r << " j " << j;
          continue;
        }
        if (std::isnan(x)) {
          ASSERT_TRUE(std::isnan(s[e])) << "NaN score, r " << r << " j " << j;
          continue;
        }
        const float arg = std::min(x - lse[r], 0.0f);
        const double want = arg < -87.33f ? 0.0 : std::exp(double(arg));
        ASSERT_LE(std::fabs(s[e] - want), 4 * 0x1p-24 * want) << "P, r " << r << " j " << j;
        const double g = double(s[e]) * (double(dp0[e]) - delta[r]);
        ASSERT_LE(std::fabs(dp[e] - g), 4 * 0x1p-24 * std::fabs(g) + 1e-30) << "dS, r " << r << " j " << j;
      }
    std::vector<std::uint32_t> pt(std::size_t(kN / 2) * kN), dst(pt.size()), ds16(std::size_t(kN) * (kN / 2));
    bx::pack_probs(rows, s.data(), dp.data(), ld, pt.data(), dst.data(), ds16.data());
    // The instruction reads subnormal fp32 inputs as zero (docs/semantics.md).
    auto flush = [](float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; };
    auto word = [&](float a, float b) -> std::uint32_t {
      return std::uint32_t(float_to_bf16(flush(a))) | (std::uint32_t(float_to_bf16(flush(b))) << 16);
    };
    for (int c = 0; c < (rows + 1) / 2; ++c)
      for (int j = 0; j < kN; ++j) {
        const float p1 = 2 * c + 1 < rows ? s[std::size_t(2 * c + 1) * ld + j] : 0.0f;
        const float d1 = 2 * c + 1 < rows ? dp[std::size_t(2 * c + 1) * ld + j] : 0.0f;
        ASSERT_EQ(pt[std::size_t(c) * kN + j], word(s[std::size_t(2 * c) * ld + j], p1)) << "c " << c << " j " << j;
        ASSERT_EQ(dst[std::size_t(c) * kN + j], word(dp[std::size_t(2 * c) * ld + j], d1)) << "c " << c << " j " << j;
      }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kN / 2; ++c)
        ASSERT_EQ(ds16[std::size_t(r) * (kN / 2) + c],
                  word(dp[std::size_t(r) * ld + 2 * c], dp[std::size_t(r) * ld + 2 * c + 1]))
            << "r " << r << " c " << c;
  }
}

// pack_value_pairs + pv_block against fp64 sums of bf16(P) times V: P rounded to bf16 (round
// to nearest even) is the only rounding before the fp32 sums; odd key counts, zero rows,
// column counts that are not multiples of 16 (the padding columns stay 0 + acc).
TEST(CpuIsaKernels, Bf16PvBlockMatchesFp64) {
  if (!detail::cpu::isa_supported(Isa::kAvx512Bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  namespace bx = detail::cpu::bf16x;
  FA_SEEDED_RNG(rng);
  for (int cols : {1, 16, 24, 64, 80, 130}) {
    for (int n : {1, 17, 64}) {
      for (int rows : {1, 3, 6, 11}) {
        SCOPED_TRACE("cols " + std::to_string(cols) + " n " + std::to_string(n) + " rows " +
                     std::to_string(rows));
        const int ldw = (cols + 15) / 16 * 16, ldv = cols + 5;
        std::vector<std::uint16_t> v(std::size_t(n) * ldv, 0x7fc0);  // NaN past each row
        std::vector<const std::uint16_t*> ptr(bx::kKeys, nullptr);
        for (int j = 0; j < n; ++j) {
          for (int c = 0; c < cols; ++c)
            v[std::size_t(j) * ldv + c] = float_to_bf16(static_cast<float>(uniform_real(rng, -3, 3)));
          ptr[j] = (j % 7 == 4) ? nullptr : &v[std::size_t(j) * ldv];
        }
        const int pairs = (n + 1) / 2;
        std::vector<std::uint32_t> vp(std::size_t(pairs) * ldw, 0xffffffffu);
        bx::pack_value_pairs(ptr.data(), n, cols, vp.data(), ldw);
        const int ldp = bx::kKeys;
        std::vector<float> p(std::size_t(rows) * ldp, 0.0f);
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < n; ++j) p[std::size_t(r) * ldp + j] = static_cast<float>(uniform_real(rng, 0, 1));
        const int lda = ldw + 3;
        std::vector<float> acc(std::size_t(rows) * lda), init(acc.size());
        for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = init[i] = static_cast<float>(uniform_real(rng, -1, 1));
        bx::pv_block(rows, pairs, p.data(), ldp, vp.data(), ldw, ldw, acc.data(), lda);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < lda; ++c) {
            const float got = acc[std::size_t(r) * lda + c];
            if (c >= ldw) {
              EXPECT_EQ(got, init[std::size_t(r) * lda + c]) << "written past the columns, r " << r << " c " << c;
              continue;
            }
            double want = init[std::size_t(r) * lda + c], mag = std::fabs(want);
            if (c < cols)
              for (int j = 0; j < n; ++j) {
                if (ptr[j] == nullptr) continue;
                const double x = double(bf16_to_float(float_to_bf16(p[std::size_t(r) * ldp + j]))) *
                                 double(bf16_to_float(ptr[j][c]));
                want += x;
                mag += std::fabs(x);
              }
            ASSERT_TRUE(std::isfinite(got)) << "r " << r << " c " << c;
            EXPECT_LE(std::fabs(got - want), (n + 1) * 0x1p-24 * mag) << "r " << r << " c " << c;
          }
      }
    }
  }
}

TEST(CpuIsaKernels, Bf16WidenIsExact) {
  if (!detail::cpu::isa_supported(Isa::kAvx512Bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  FA_SEEDED_RNG(rng);
  for (int n : {1, 15, 16, 17, 100}) {
    std::vector<std::uint16_t> x(std::size_t(n) + 1);
    for (auto& e : x) e = static_cast<std::uint16_t>(uniform_int(rng, 0, 0xffff));
    std::vector<float> got(std::size_t(n) + 1, 12345.0f);
    detail::cpu::bf16x::widen(x.data(), n, got.data());
    for (int c = 0; c < n; ++c) {
      std::uint32_t bits;
      std::memcpy(&bits, &got[c], 4);
      EXPECT_EQ(bits, std::uint32_t(x[c]) << 16) << c;
    }
    EXPECT_EQ(got[n], 12345.0f);  // nothing written past n
  }
}

void check_dense_forward(DenseCase& c) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  expect_forward_matches(c.problem(), c.dtype, forward_results(c));
}

TEST_P(CpuIsa, ForwardOddShapesBf16) {
  FA_SEEDED_RNG(rng);
  int n = 0;
  for (int d : {1, 3, 17, 64, 80, 128}) {
    for (bool causal : {false, true}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, 37, 131, 4, 2, d), DType::kBFloat16);
      c.opts.causal = causal;
      if (n % 3 == 1) c.opts.softcap = 5.0f;
      if (n % 4 == 2) c.opts.window_left = 40;
      ++n;
      check_dense_forward(c);
    }
  }
  // fp16 (always the fp32 GEMM) and a long odd key length with few rows.
  DenseCase h = DenseCase::random(rng, shape_of(1, 5, 1000, 2, 1, 72), DType::kFloat16);
  check_dense_forward(h);
  DenseCase l = DenseCase::random(rng, shape_of(1, 3, 1001, 3, 1, 64), DType::kBFloat16);
  check_dense_forward(l);
}

TEST_P(CpuIsa, ForwardQvAndProbsBf16) {
  FA_SEEDED_RNG(rng);
  // qv: the score row [q | qv] . [k | v] over d + d_v = 17 + 48 (odd).
  DenseCase c = DenseCase::random(rng, shape_of(2, 21, 67, 8, 1, 17, 48), DType::kBFloat16);
  c.set_qv(rng);
  c.opts.causal = true;
  check_dense_forward(c);
  DenseCase p = DenseCase::random(rng, shape_of(1, 19, 71, 2, 2, 33), DType::kBFloat16);
  p.want_probs();
  check_dense_forward(p);
}

TEST_P(CpuIsa, ForwardVarlenSplitsBf16) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {0, 5, 17, 1, 70}, lk = {7, 0, 23, 300, 129};
  std::vector<int> cq{0}, ck{0};
  for (int x : lq) cq.push_back(cq.back() + x);
  for (int x : lk) ck.push_back(ck.back() + x);
  VarlenCase v = VarlenCase::make(rng, cq, ck, 4, 2, 40, DType::kBFloat16, 2, 1);
  v.opts.causal = true;
  v.poison_forward();
  ASSERT_NO_THROW(v.run_forward());
  expect_forward_matches(v.problem(), DType::kBFloat16, forward_results(v));
}

void check_dense_backward(DenseCase& c) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  c.poison_forward();
  ASSERT_NO_THROW(c.run_forward());
  const RefProblem p = c.problem();
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  c.poison_backward();
  ASSERT_NO_THROW(c.run_backward());
  expect_backward_matches(p, c.dtype, fwd, backward_results(c));
}

TEST_P(CpuIsa, BackwardOddShapesBf16) {
  FA_SEEDED_RNG(rng);
  int n = 0;
  for (int d : {1, 3, 17, 64, 80, 128}) {
    for (bool causal : {false, true}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, 37, 97, 4, 2, d), DType::kBFloat16);
      c.opts.causal = causal;
      if (n % 3 == 1) c.opts.softcap = 5.0f;
      if (n % 4 == 2) c.opts.window_left = 40;
      if (n % 5 == 3) c.opts.dropout_p = 0.25f;
      ++n;
      check_dense_backward(c);
    }
  }
  // d_v != d (dO V^T over d_v = 24, Q K^T over d = 40), and s_q > s_k.
  DenseCase v = DenseCase::random(rng, shape_of(1, 130, 67, 2, 1, 40, 24), DType::kBFloat16);
  check_dense_backward(v);
  DenseCase h = DenseCase::random(rng, shape_of(1, 70, 70, 2, 2, 48), DType::kFloat16);
  h.opts.causal = true;
  check_dense_backward(h);
}

TEST_P(CpuIsa, BackwardVarlenBf16) {
  FA_SEEDED_RNG(rng);
  const std::vector<int> lq = {0, 5, 77, 1}, lk = {7, 0, 130, 65};
  std::vector<int> cq{0}, ck{0};
  for (int x : lq) cq.push_back(cq.back() + x);
  for (int x : lk) ck.push_back(ck.back() + x);
  VarlenCase v = VarlenCase::make(rng, cq, ck, 6, 2, 33, DType::kBFloat16, 1, 2);
  v.opts.causal = true;
  v.poison_forward();
  ASSERT_NO_THROW(v.run_forward());
  const ForwardResults fwd = forward_results(v);
  expect_forward_matches(v.problem(), DType::kBFloat16, fwd);
  v.poison_backward();
  ASSERT_NO_THROW(v.run_backward());
  expect_backward_matches(v.problem(), DType::kBFloat16, fwd, backward_results(v));
}

// Decode: one query row (packed GQA rows), paged and dense caches, odd lengths, splits.
TEST_P(CpuIsa, DecodeOddShapesBf16) {
  FA_SEEDED_RNG(rng);
  int n = 0;
  for (int d : {3, 64, 80, 128}) {
    for (int block_size : {0, 16}) {
      KVCacheConfig cfg;
      cfg.batch = 3;
      cfg.s_q = 1;
      cfg.s_new = n % 2;
      cfg.h_q = 8;
      cfg.h_k = 2;
      cfg.d = d;
      cfg.dtype = DType::kBFloat16;
      cfg.block_size = block_size;
      cfg.max_cache_len = 700;
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.num_splits = n % 3 == 2 ? 4 : 0;
      ++n;
      SCOPED_TRACE("d " + std::to_string(d) + " block_size " + std::to_string(block_size) +
                   " splits " + std::to_string(c.num_splits));
      run_and_check_kvcache(c);
    }
  }
  // Several query rows (prefill chunk against the cache) with qv.
  KVCacheConfig cfg;
  cfg.batch = 2;
  cfg.s_q = 5;
  cfg.s_new = 5;
  cfg.h_q = 4;
  cfg.h_k = 4;
  cfg.d = 24;
  cfg.d_v = 40;
  cfg.qv = true;
  cfg.dtype = DType::kBFloat16;
  cfg.max_cache_len = 200;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = true;
  run_and_check_kvcache(c);
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuIsa, ::testing::Values(Isa::kAvx2, Isa::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<Isa>& i) {
                           return std::string(detail::cpu::isa_name(i.param));
                         });

}  // namespace
}  // namespace flashattn::test
