// CUDA: NaN and inf in the inputs (docs/semantics.md, "Non-finite values"), on every kernel
// family this GPU runs (sm80; sm90 on an H100 / H200, through opts.kernel_family). Each test
// plants a NaN / inf in fresh random inputs and checks, element by element, (1) the rule:
// the named rows / columns NaN, empty or non-finite, every other element bit-identical to
// the same family's run without it, and (2) the NaN / inf pattern of the CPU backend's run
// of the same inputs, wherever the rule specifies it.
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "cuda/device_runs.hpp"
#include "flashattn/semantics.hpp"
#include "support/cases.hpp"
#include "support/describe.hpp"
#include "support/nonfinite.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct MaskCase {
  const char* name;
  bool causal;
  int left, right;
};
// s_q = 203 > s_k = 141 under causal leaves the first 62 rows empty; the lengths straddle
// the 64 / 128-row query tiles and the key tiles of both families.
constexpr MaskCase kMasks[] = {{"none", false, -1, -1}, {"causal", true, -1, -1}, {"window", false, 40, 9}};
constexpr int kSq = 203, kSk = 141, kHq = 4, kHk = 2;

semantics::Mask mask_of(const Options& o) { return semantics::Mask::make(o.causal, o.window_left, o.window_right); }

enum class Plant { kNanQ, kNanK, kNanV, kPosInfQ, kNegInfQ, kNanAlibi };
const char* plant_name(Plant p) {
  switch (p) {
    case Plant::kNanQ: return "NaN in q";
    case Plant::kNanK: return "NaN in k";
    case Plant::kNanV: return "NaN in v";
    case Plant::kPosInfQ: return "+inf in q";
    case Plant::kNegInfQ: return "-inf in q";
    case Plant::kNanAlibi: return "NaN ALiBi slope";
  }
  return "?";
}

// Checks `bad` (a device run) against the rule and `clean` (the same family's run without
// the plant), and against `cpu` (the CPU backend's run of bad's inputs).
void expect_forward(const DenseCase& bad, const DenseCase& clean, const DenseCase& cpu, const ExpectRule& rule) {
  expect_pattern("out", bad.out, clean.out, false, rule);
  expect_pattern("lse", bad.lse, clean.lse, true, rule);
  expect_same_nan_pattern("out vs CPU", bad.out, cpu.out, false, rule);
  expect_same_nan_pattern("lse vs CPU", bad.lse, cpu.lse, true, rule);
}

TEST(CudaNonFinite, DenseForwardEveryFamily) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      for (const MaskCase& m : kMasks) {
        for (Plant plant : {Plant::kNanQ, Plant::kNanK, Plant::kNanV, Plant::kPosInfQ, Plant::kNegInfQ,
                            Plant::kNanAlibi}) {
          DenseCase clean = DenseCase::random(rng, Shape{2, kSq, kSk, kHq, kHk, d}, dtype);
          clean.opts.causal = m.causal;
          clean.opts.window_left = m.left;
          clean.opts.window_right = m.right;
          if (plant == Plant::kNanAlibi) clean.set_alibi(random_alibi(rng, 2, kHq, true), true);
          SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype) + " mask " + m.name + ", " +
                       plant_name(plant));
          const int b0 = uniform_int(rng, 0, 1), i0 = uniform_int(rng, 0, kSq - 1), h0 = uniform_int(rng, 0, kHq - 1),
                    j0 = uniform_int(rng, 0, kSk - 1), c0 = uniform_int(rng, 0, d - 1);
          const int g0 = h0 / (kHq / kHk);
          if (plant == Plant::kPosInfQ || plant == Plant::kNegInfQ) {
            for (std::int64_t e = c0; e < clean.k.numel(); e += d) clean.k.set(e, std::fabs(clean.k.get(e)) + 0.25);
          }
          DenseCase bad = clean;
          switch (plant) {
            case Plant::kNanQ: bad.q.set(bad.q.index({b0, i0, h0, c0}), kNaN); break;
            case Plant::kNanK: bad.k.set(bad.k.index({b0, j0, g0, c0}), kNaN); break;
            case Plant::kNanV: bad.v.set(bad.v.index({b0, j0, g0, c0}), kNaN); break;
            case Plant::kPosInfQ: bad.q.set(bad.q.index({b0, i0, h0, c0}), kInf); break;
            case Plant::kNegInfQ: bad.q.set(bad.q.index({b0, i0, h0, c0}), -kInf); break;
            case Plant::kNanAlibi: {
              std::vector<float> slopes = clean.alibi;
              slopes[std::size_t(b0 * kHq + h0)] = std::numeric_limits<float>::quiet_NaN();
              bad.set_alibi(slopes, true);
              break;
            }
          }
          DenseCase cpu = bad;
          cpu.poison_forward();
          ASSERT_NO_THROW(cpu.run_forward());
          cuda_forward(clean, family);
          cuda_forward(bad, family);
          const semantics::Mask mk = mask_of(clean.opts);
          auto sees = [&](int i) { return !semantics::visible_keys(i, kSq, kSk, mk).empty(); };
          const ExpectRule rule = [&](int b, int i, int h, int c) {
            switch (plant) {
              case Plant::kNanQ:
              case Plant::kPosInfQ:
                if (b == b0 && i == i0 && h == h0) return sees(i) ? Expect::kNan : Expect::kEmpty;
                return Expect::kSame;
              case Plant::kNegInfQ:
                return b == b0 && i == i0 && h == h0 ? Expect::kEmpty : Expect::kSame;
              case Plant::kNanK:
                if (b == b0 && h / (kHq / kHk) == g0 && semantics::key_visible(i, j0, kSq, kSk, mk)) return Expect::kNan;
                return Expect::kSame;
              case Plant::kNanV:
                if (b != b0 || h / (kHq / kHk) != g0) return Expect::kSame;
                if (!semantics::key_visible(i, j0, kSq, kSk, mk)) return m.causal || m.left >= 0 ? Expect::kUnchecked : Expect::kSame;
                return c == c0 ? Expect::kNan : Expect::kSame;
              case Plant::kNanAlibi:
                if (b != b0 || h != h0) return Expect::kSame;
                return sees(i) ? Expect::kNan : Expect::kEmpty;
            }
            return Expect::kUnchecked;
          };
          expect_forward(bad, clean, cpu, rule);
        }
      }
    }
  }
}

// Backward (deterministic, so that untouched elements are bit-identical between runs): a
// NaN in dout[b0, i0, h0, c0], and a NaN row of the forward (q NaN). The forward each
// backward differentiates is that family's own.
TEST(CudaNonFinite, DenseBackward) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      for (const MaskCase& m : kMasks) {
        for (bool nan_q : {false, true}) {
          DenseCase clean = DenseCase::random(rng, Shape{2, kSq, kSk, kHq, kHk, d}, dtype);
          clean.opts.causal = m.causal;
          clean.opts.window_left = m.left;
          clean.opts.window_right = m.right;
          clean.opts.deterministic = true;
          SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype) + " mask " + m.name +
                       (nan_q ? ", NaN in q" : ", NaN in dout"));
          const int b0 = uniform_int(rng, 0, 1), i0 = uniform_int(rng, 0, kSq - 1), h0 = uniform_int(rng, 0, kHq - 1),
                    c0 = uniform_int(rng, 0, d - 1);
          const int g0 = h0 / (kHq / kHk);
          DenseCase bad = clean;
          (nan_q ? bad.q : bad.dout).set(bad.q.index({b0, i0, h0, c0}), kNaN);
          DenseCase cpu = bad;
          ASSERT_NO_THROW(cpu.run_forward());
          cpu.poison_backward();
          ASSERT_NO_THROW(cpu.run_backward());
          for (DenseCase* c : {&clean, &bad}) {
            cuda_forward(*c, family);
            cuda_backward(*c);
          }
          const semantics::Mask mk = mask_of(clean.opts);
          const bool sees = !semantics::visible_keys(i0, kSq, kSk, mk).empty();
          const ExpectRule dq_rule = [&](int b, int i, int h, int) {
            if (b == b0 && i == i0 && h == h0) return sees ? Expect::kNan : Expect::kEmpty;
            return Expect::kSame;
          };
          // dk: NaN where row i0 sees the key; a key it does not see gets dS = 0 (a select),
          // clean when only dout is NaN; with a NaN q_i0, 0 * q_i0 in dS^T Q is not specified.
          const ExpectRule dk_rule = [&](int b, int j, int g, int) {
            if (b != b0 || g != g0) return Expect::kSame;
            if (semantics::key_visible(i0, j, kSq, kSk, mk)) return Expect::kNan;
            return nan_q ? Expect::kUnchecked : Expect::kSame;
          };
          // dv: NaN dout: column c0 of the keys row i0 sees; NaN q: P NaN, every column.
          const ExpectRule dv_rule = [&](int b, int j, int g, int c) {
            if (b != b0 || g != g0) return Expect::kSame;
            if (!semantics::key_visible(i0, j, kSq, kSk, mk)) return Expect::kUnchecked;  // 0 * NaN in P^T dO
            return nan_q || c == c0 ? Expect::kNan : Expect::kSame;
          };
          expect_pattern("dq", bad.dq, clean.dq, false, dq_rule);
          expect_pattern("dk", bad.dk, clean.dk, false, dk_rule);
          expect_pattern("dv", bad.dv, clean.dv, false, dv_rule);
          expect_same_nan_pattern("dq vs CPU", bad.dq, cpu.dq, false, dq_rule);
          expect_same_nan_pattern("dk vs CPU", bad.dk, cpu.dk, false, dk_rule);
          expect_same_nan_pattern("dv vs CPU", bad.dv, cpu.dv, false, dv_rule);
        }
      }
    }
  }
}

// Varlen: NaN in every row that belongs to no sequence (q / dout padding, keys past
// seqused_k, k / v padding between and after the sequences' used keys) changes nothing,
// forward or backward; one NaN query element poisons its row only (and, backward, the dk /
// dv rows of the keys that row sees).
TEST(CudaNonFinite, VarlenPaddingAndSeqused) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  const std::vector<int> cu_q = {0, 70, 70, 273, 274, 400}, cu_k = {0, 90, 130, 330, 480, 681};
  const std::vector<int> used = {77, 40, 150, 0, 190};
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      for (bool causal : {false, true}) {
        VarlenCase clean = VarlenCase::make(rng, cu_q, cu_k, kHq, kHk, d, dtype, 9, 13);
        clean.set_seqused_k(used);
        clean.opts.causal = causal;
        clean.opts.deterministic = true;
        SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype) + (causal ? " causal" : ""));
        VarlenCase bad = clean;
        const std::int64_t qw = std::int64_t(kHq) * d, kw = std::int64_t(kHk) * d;
        for (int r = cu_q.back(); r < clean.total_q; ++r)
          for (std::int64_t e = 0; e < qw; ++e) {
            bad.q.set(r * qw + e, kNaN);
            bad.dout.set(r * qw + e, kNaN);
          }
        auto key_seq = [&](int r) {
          for (int b = 0; b < clean.batch(); ++b)
            if (r >= cu_k[b] && r < cu_k[b + 1]) return b;
          return -1;
        };
        for (int r = 0; r < clean.total_k; ++r) {
          const int b = key_seq(r);
          if (b >= 0 && r - cu_k[b] < used[b]) continue;
          for (std::int64_t e = 0; e < kw; ++e) {
            bad.k.set(r * kw + e, kNaN);
            bad.v.set(r * kw + e, kNaN);
          }
        }
        // One NaN query element in sequence 2 (rows 70 .. 272: 203 queries, 150 used keys).
        const int i0 = uniform_int(rng, 0, 202), h0 = uniform_int(rng, 0, kHq - 1);
        bad.q.set((std::int64_t(70 + i0) * kHq + h0) * d + uniform_int(rng, 0, d - 1), kNaN);
        VarlenCase cpu = bad;
        ASSERT_NO_THROW(cpu.run_forward());
        ASSERT_NO_THROW(cpu.run_backward());
        for (VarlenCase* c : {&clean, &bad}) {
          cuda_varlen_forward(*c, family);
          cuda_varlen_backward(*c);
        }
        const semantics::Mask mk = mask_of(clean.opts);
        const bool sees = !semantics::visible_keys(i0, 203, 150, mk).empty();
        auto q_seq = [&](int r) {
          for (int b = 0; b < clean.batch(); ++b)
            if (r >= cu_q[b] && r < cu_q[b + 1]) return b;
          return -1;
        };
        const ExpectRule rows = [&](int, int r, int h, int) {
          if (q_seq(r) < 0) return Expect::kUnchecked;  // padding: never written
          if (r == 70 + i0 && h == h0) return sees ? Expect::kNan : Expect::kEmpty;
          return Expect::kSame;
        };
        const ExpectRule keys = [&](int, int r, int g, int) {
          const int b = key_seq(r);
          if (b < 0) return Expect::kUnchecked;
          const int j = r - cu_k[b];
          if (j >= used[b]) return Expect::kEmpty;
          if (b == 2 && g == h0 / (kHq / kHk)) {
            return semantics::key_visible(i0, j, 203, 150, mk) ? Expect::kNan : Expect::kUnchecked;
          }
          return Expect::kSame;
        };
        expect_pattern("out", bad.out, clean.out, false, rows);
        expect_pattern("lse", bad.lse, clean.lse, true, rows);
        expect_pattern("dq", bad.dq, clean.dq, false, rows);
        expect_pattern("dk", bad.dk, clean.dk, false, keys);
        expect_pattern("dv", bad.dv, clean.dv, false, keys);
        expect_same_nan_pattern("out vs CPU", bad.out, cpu.out, false, rows);
        expect_same_nan_pattern("lse vs CPU", bad.lse, cpu.lse, true, rows);
        expect_same_nan_pattern("dq vs CPU", bad.dq, cpu.dq, false, rows);
        expect_same_nan_pattern("dk vs CPU", bad.dk, cpu.dk, false, keys);
        expect_same_nan_pattern("dv vs CPU", bad.dv, cpu.dv, false, keys);
      }
    }
  }
}

// KV cache (decode and a short chunk; split-KV 1, 3 and the heuristic; dense and paged;
// unused slots NaN throughout, as in every KVCacheCase): a NaN query row is NaN after the
// split merge (every split NaN: not an empty row), a NaN in one sequence's k_new reaches
// that sequence's rows of its group only.
TEST(CudaNonFinite, KVCacheDecodeSplitsAndAppend) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  for (KernelFamily family : gpu_families()) {
    for (int s_q : {1, 3}) {
      for (int splits : {1, 3, 0}) {
        for (int block_size : {0, 64}) {
          KVCacheConfig cfg;
          cfg.batch = 3;
          cfg.s_q = s_q;
          cfg.s_new = 2;
          cfg.h_q = 8;
          cfg.h_k = 2;
          cfg.d = d;
          cfg.dtype = coin(rng) ? DType::kFloat16 : DType::kBFloat16;
          cfg.cache_lens = {uniform_int(rng, 300, 700), uniform_int(rng, 0, 90), uniform_int(rng, 500, 1100)};
          cfg.block_size = block_size;
          KVCacheCase clean = KVCacheCase::make(rng, cfg);
          clean.num_splits = splits;
          SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(cfg.dtype) + " s_q " + std::to_string(s_q) +
                       " splits " + std::to_string(splits) + " block_size " + std::to_string(block_size));
          KVCacheCase bad = clean;
          const int h0 = uniform_int(rng, 0, 7), g1 = uniform_int(rng, 0, 1), i0 = uniform_int(rng, 0, s_q - 1);
          bad.q.set(bad.q.index({0, i0, h0, uniform_int(rng, 0, d - 1)}), kNaN);
          bad.k_new.set(bad.k_new.index({2, uniform_int(rng, 0, 1), g1, uniform_int(rng, 0, d - 1)}), kNaN);
          KVCacheCase cpu = bad;
          cpu.poison_outputs();
          ASSERT_NO_THROW(cpu.run());
          cuda_kvcache(clean, family);
          cuda_kvcache(bad, family);
          const ExpectRule rule = [&](int b, int i, int h, int) {
            if (b == 0 && i == i0 && h == h0) return Expect::kNan;
            if (b == 2 && h / 4 == g1) return Expect::kNan;  // no mask: every row sees k_new
            return Expect::kSame;
          };
          expect_pattern("out", bad.out, clean.out, false, rule);
          expect_pattern("lse", bad.lse, clean.lse, true, rule);
          expect_same_nan_pattern("out vs CPU", bad.out, cpu.out, false, rule);
          expect_same_nan_pattern("lse vs CPU", bad.lse, cpu.lse, true, rule);
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashattn::test
