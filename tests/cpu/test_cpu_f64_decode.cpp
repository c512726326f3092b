// CPU backend, the AVX-512 fp64 decode kernels of fp32 tensors (src/cpu/f64_kernels.hpp, on the
// avx512bf16 path): the kernels against a scalar chain of std::fma in the documented order
// (exactly), and KV-cache forwards of fp32 tensors (decode rows, packed GQA rows, a few query
// rows, odd head dims, paged / dense / left-padded caches, appends, splits, causal, window,
// softcap, ALiBi, sinks) bit-identical between the avx2 path (converted, transposed blocks
// and the gemm of cpu/tile.hpp) and the avx512bf16 path, and within the fp64 oracle's bounds.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/f64_kernels.hpp"
#include "cpu/isa.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using detail::cpu::Isa;
namespace f64x = detail::cpu::f64x;

bool have_path() {
  return detail::cpu::isa_supported(Isa::kAvx512Bf16) && f64x::built();
}

struct IsaScope {
  explicit IsaScope(Isa isa) { detail::cpu::set_isa_override(isa); }
  ~IsaScope() { detail::cpu::set_isa_override(std::nullopt); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

std::vector<float> normal_floats(Rng& rng, std::size_t n) {
  std::vector<float> x(n);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  return x;
}

TEST(CpuF64Kernels, ScoresAreTheFmaChainInOrder) {
  if (!have_path()) GTEST_SKIP() << "no AVX-512 path on this CPU";
  FA_SEEDED_RNG(rng);
  for (int rows = 1; rows <= f64x::kMaxRows; ++rows) {
    for (int d : {1, 3, 8, 13, 64, 80}) {
      const int n = uniform_int(rng, 1, f64x::kKeys);
      const int ldq = d + 3;
      std::vector<double> q(std::size_t(rows) * ldq);
      for (auto& v : q) v = uniform_real(rng, -2.0, 2.0);
      // Key rows scattered in one buffer (stride 2 d + 1: unaligned, not contiguous).
      const std::vector<float> keys = normal_floats(rng, std::size_t(n) * (2 * d + 1));
      std::vector<const float*> krows(f64x::kKeys, nullptr);
      for (int j = 0; j < n; ++j) krows[j] = keys.data() + std::size_t(n - 1 - j) * (2 * d + 1);
      const int lds = f64x::kKeys + 5;
      std::vector<double> s(std::size_t(rows) * lds, std::nan(""));
      f64x::scores(rows, d, q.data(), ldq, krows.data(), n, s.data(), lds);
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < f64x::kKeys; ++j) {
          double want = 0.0;
          if (j < n)
            for (int c = 0; c < d; ++c) want = std::fma(q[r * ldq + c], double(krows[j][c]), want);
          const double got = s[std::size_t(r) * lds + j];
          ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0)
              << "rows " << rows << " d " << d << " n " << n << " r " << r << " j " << j << ": "
              << got << " vs " << want;
        }
      for (int r = 0; r < rows; ++r)  // past the 64 keys: untouched
        for (int j = f64x::kKeys; j < lds; ++j) ASSERT_TRUE(std::isnan(s[std::size_t(r) * lds + j]));
    }
  }
}

TEST(CpuF64Kernels, PvIsTheFmaChainInOrder) {
  if (!have_path()) GTEST_SKIP() << "no AVX-512 path on this CPU";
  FA_SEEDED_RNG(rng);
  for (int rows = 1; rows <= f64x::kMaxRows; ++rows) {
    for (int dv : {1, 5, 8, 24, 64, 72, 130}) {
      const int cols = (dv + 7) / 8 * 8, n = uniform_int(rng, 1, f64x::kKeys);
      const int ldp = f64x::kKeys + 2, ldacc = cols + 8;
      std::vector<double> p(std::size_t(rows) * ldp), acc(std::size_t(rows) * ldacc);
      for (auto& v : p) v = uniform_real(rng, 0.0, 1.0);
      for (auto& v : acc) v = uniform_real(rng, -1.0, 1.0);
      const std::vector<float> vals = normal_floats(rng, std::size_t(n) * (dv + 1));
      std::vector<const float*> vrows(f64x::kKeys, nullptr);
      for (int j = 0; j < n; ++j) vrows[j] = vals.data() + std::size_t(j) * (dv + 1);
      std::vector<double> want = acc;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
          for (int j = 0; j < n; ++j)
            want[std::size_t(r) * ldacc + c] = std::fma(p[std::size_t(r) * ldp + j], c < dv ? double(vrows[j][c]) : 0.0,
                                                        want[std::size_t(r) * ldacc + c]);
      f64x::pv(rows, n, p.data(), ldp, vrows.data(), dv, cols, acc.data(), ldacc);
      ASSERT_EQ(std::memcmp(acc.data(), want.data(), acc.size() * sizeof(double)), 0)
          << "rows " << rows << " dv " << dv << " n " << n;
    }
  }
}

// The same fp32 KV-cache case on both paths: the same bits, and the oracle's bounds.
TEST(CpuF64Decode, Fp32KVCacheBitIdenticalAcrossPaths) {
  if (!have_path()) GTEST_SKIP() << "no AVX-512 path on this CPU";
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 24; ++trial) {
    KVCacheConfig cfg;
    cfg.dtype = DType::kFloat32;
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.s_q = std::vector<int>{1, 1, 1, 2, 5, 8, 9}[static_cast<std::size_t>(uniform_int(rng, 0, 6))];
    cfg.s_new = coin(rng) ? uniform_int(rng, 1, cfg.s_q) : 0;
    cfg.h_k = uniform_int(rng, 1, 3);
    cfg.h_q = cfg.h_k * std::vector<int>{1, 2, 3, 4, 7, 8, 12}[static_cast<std::size_t>(uniform_int(rng, 0, 6))];
    cfg.d = std::vector<int>{1, 3, 17, 64, 80, 130}[static_cast<std::size_t>(uniform_int(rng, 0, 5))];
    if (coin(rng, 0.3)) cfg.d_v = std::vector<int>{5, 24, 72}[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    cfg.block_size = std::vector<int>{0, 0, 7, 16, 64}[static_cast<std::size_t>(uniform_int(rng, 0, 4))];
    cfg.leftpad = cfg.block_size == 0 && coin(rng, 0.3);
    cfg.max_cache_len = uniform_int(rng, 0, 300);
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 100);
    if (coin(rng, 0.3)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 8.0));
    if (coin(rng, 0.3)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, per_batch), per_batch);
    }
    if (coin(rng, 0.3)) c.sink.set(random_sink(rng, cfg.h_q));
    c.num_splits = std::vector<int>{1, 0, 3}[static_cast<std::size_t>(uniform_int(rng, 0, 2))];
    SCOPED_TRACE("trial " + std::to_string(trial) + " b " + std::to_string(cfg.batch) + " s_q " +
                 std::to_string(cfg.s_q) + " h " + std::to_string(cfg.h_q) + "/" + std::to_string(cfg.h_k) +
                 " d " + std::to_string(cfg.d) + "/" + std::to_string(cfg.dv()) + " block " +
                 std::to_string(cfg.block_size) + " splits " + std::to_string(c.num_splits));
    std::vector<unsigned char> out2, lse2;
    {
      IsaScope scope(Isa::kAvx2);
      c.poison_outputs();
      c.run();  // the append writes the same rows both times
      out2.assign(static_cast<const unsigned char*>(c.out.data()),
                  static_cast<const unsigned char*>(c.out.data()) + c.out.bytes());
      lse2.assign(static_cast<const unsigned char*>(c.lse.data()),
                  static_cast<const unsigned char*>(c.lse.data()) + c.lse.bytes());
    }
    IsaScope scope(Isa::kAvx512Bf16);
    run_and_check_kvcache(c);  // poisons, runs and checks against the fp64 oracle
    ASSERT_EQ(std::memcmp(c.out.data(), out2.data(), out2.size()), 0) << "out differs between paths";
    ASSERT_EQ(std::memcmp(c.lse.data(), lse2.data(), lse2.size()), 0) << "lse differs between paths";
  }
}

}  // namespace
}  // namespace flashattn::test
