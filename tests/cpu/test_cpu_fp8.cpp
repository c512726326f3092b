// CPU backend, fp8 (e4m3) q, k, v with FlashAttention-3's descales (Options::q_descale,
// k_descale, v_descale; issue 21): dense and varlen forwards against the fp64 oracle over
// the dequantized inputs (support/cases.hpp quantize_fp8), with causal / window / GQA /
// MQA / softcap / ALiBi / sink / d_v != d / odd lengths / seqused_k / block sparsity,
// bf16 and fp16 outputs, outlier-heavy inputs, descales that differ per (sequence, KV
// head) so that a wrong index shows, undefined descales (= 1), poisoned outputs; and the
// rules: no fp8 backward, descales only with fp8 (the KV-cache entry point with fp8 q:
// test_cpu_kvcache_fp8q.cpp).
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

// Multiplies the heads of each (row-group b, head h) of x [rows, h, d] by factor(b, h):
// inputs whose descales differ widely per (sequence, KV head).
template <class F>
void spread(HostTensor& x, int rows_per_seq, int h, F factor) {
  const std::int64_t rows = x.numel() / (std::int64_t(h) * x.shape().back());
  const std::int64_t d = x.shape().back();
  for (std::int64_t r = 0; r < rows; ++r)
    for (int hh = 0; hh < h; ++hh)
      for (std::int64_t c = 0; c < d; ++c) {
        const std::int64_t at = (r * h + hh) * d + c;
        x.set(at, x.get(at) * factor(static_cast<int>(r / rows_per_seq), hh));
      }
}

// A few channels of every head x50 (the outliers of real activations).
void add_outliers(HostTensor& x, Rng& rng) {
  const std::int64_t d = x.shape().back();
  std::vector<std::int64_t> channels;
  for (int i = 0; i < 3; ++i) channels.push_back(uniform_int(rng, 0, static_cast<int>(d) - 1));
  for (std::int64_t at = 0; at < x.numel(); ++at)
    for (std::int64_t c : channels)
      if (at % d == c) x.set(at, x.get(at) * 50.0);
}

struct Fp8Feature {
  const char* name;
  int batch, s_q, s_k, h_q, h_k, d, d_v;
  bool causal;
  int left, right;
  float softcap;
  bool alibi, sink, outliers;
  DType out_dtype;
};

void PrintTo(const Fp8Feature& f, std::ostream* os) { *os << f.name; }

class CpuFp8Dense : public ::testing::TestWithParam<Fp8Feature> {};

TEST_P(CpuFp8Dense, MatchesOracleOverDequantizedInputs) {
  const Fp8Feature f = GetParam();
  Rng rng(0xF8F8 + static_cast<std::uint64_t>(f.s_q * 131 + f.s_k * 7 + f.d));
  DenseCase c = DenseCase::random(rng, {f.batch, f.s_q, f.s_k, f.h_q, f.h_k, f.d, f.d_v},
                                  DType::kFloat32);
  const int ratio = f.h_q / f.h_k;
  // Descales that differ by powers of two per (sequence, KV head): a descale read for
  // the wrong batch or head is off by >= 2x.
  spread(c.q, f.s_q, f.h_q, [&](int b, int h) { return std::ldexp(1.0, (b * 3 + h / ratio) % 5 - 2); });
  spread(c.k, f.s_k, f.h_k, [&](int b, int g) { return std::ldexp(1.0, (b + 2 * g) % 4 - 1); });
  spread(c.v, f.s_k, f.h_k, [&](int b, int g) { return std::ldexp(1.0, (2 * b + g) % 3); });
  if (f.outliers) {
    add_outliers(c.q, rng);
    add_outliers(c.k, rng);
  }
  const Fp8Inputs q8 = quantize_fp8(c);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  if (f.outliers) c.opts.softmax_scale = 0.02f;  // keep the softmax from saturating
  if (f.alibi) c.set_alibi(random_alibi(rng, f.batch, f.h_q, true), true);
  if (f.sink) c.sink.set(random_sink(rng, f.h_q));
  c.sink.want_grad = false;
  c.out = HostTensor(f.out_dtype, {f.batch, f.s_q, f.h_q, c.shape.dv()});
  c.poison_forward();
  Options opts = c.call_options();
  q8.apply(opts);
  SCOPED_TRACE(c.shape.str() + " out " + dtype_name(f.out_dtype) + " " + describe(opts));
  ASSERT_NO_THROW(forward(q8.q.view(), q8.k.view(), q8.v.view(), c.out.view(), c.lse.view(), opts));
  const RefProblem p = c.problem();
  expect_forward_matches(p, f.out_dtype, forward_results(c));
}

constexpr DType kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16;

INSTANTIATE_TEST_SUITE_P(
    Features, CpuFp8Dense,
    ::testing::Values(
        Fp8Feature{"plain", 2, 37, 53, 2, 2, 32, 0, false, -1, -1, 0.f, false, false, false, kBf16},
        Fp8Feature{"plain_fp16_out", 2, 37, 53, 2, 2, 32, 0, false, -1, -1, 0.f, false, false, false, kFp16},
        Fp8Feature{"causal_gqa", 3, 65, 129, 6, 2, 64, 0, true, -1, -1, 0.f, false, false, false, kBf16},
        Fp8Feature{"causal_sq_gt_sk", 2, 70, 33, 4, 1, 16, 0, true, -1, -1, 0.f, false, false, false, kBf16},
        Fp8Feature{"window_mqa", 2, 90, 150, 4, 1, 24, 0, false, 17, 5, 0.f, false, false, false, kBf16},
        Fp8Feature{"softcap", 2, 33, 77, 3, 3, 40, 0, true, -1, -1, 5.f, false, false, false, kFp16},
        Fp8Feature{"alibi_sink", 2, 41, 66, 4, 2, 8, 0, false, -1, -1, 0.f, true, true, false, kBf16},
        Fp8Feature{"dv_ne_d", 1, 29, 45, 2, 1, 48, 24, true, -1, -1, 0.f, false, false, false, kBf16},
        Fp8Feature{"decode_gqa", 3, 1, 200, 8, 2, 64, 0, false, -1, -1, 0.f, false, false, false, kBf16},
        Fp8Feature{"odd_d", 2, 19, 23, 3, 1, 5, 0, false, -1, -1, 0.f, false, false, false, kFp16},
        Fp8Feature{"outliers", 2, 64, 96, 4, 2, 64, 0, true, -1, -1, 0.f, false, false, true, kBf16},
        Fp8Feature{"outliers_window_softcap", 2, 50, 80, 2, 1, 32, 0, false, 20, 0, 8.f, false, false, true,
                   kBf16}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(CpuFp8, UndefinedDescalesAreOne) {
  Rng rng(0xF801);
  DenseCase c = DenseCase::random(rng, {2, 21, 34, 4, 2, 16}, DType::kFloat32);
  Fp8Inputs q8 = quantize_fp8(c);
  // Re-quantize with descale 1 everywhere: bytes of x itself.
  for (HostTensor* x : {&c.q, &c.k, &c.v}) {
    HostTensor& bytes = x == &c.q ? q8.q : x == &c.k ? q8.k : q8.v;
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      bytes.as<std::uint8_t>()[i] = semantics::quantize_e4m3(static_cast<float>(x->get(i)), 1.0f);
      x->set(i, dequantize_e4m3(bytes.as<std::uint8_t>()[i], 1.0f));
    }
  }
  c.out = HostTensor(DType::kBFloat16, {2, 21, 4, 16});
  c.poison_forward();
  Options opts = c.call_options();
  opts.k_descale = q8.k_descale.view();  // one explicit descale of value 1, two undefined
  for (std::int64_t i = 0; i < q8.k_descale.numel(); ++i) q8.k_descale.set(i, 1.0);
  ASSERT_NO_THROW(forward(q8.q.view(), q8.k.view(), q8.v.view(), c.out.view(), c.lse.view(), opts));
  expect_forward_matches(c.problem(), DType::kBFloat16, forward_results(c));
}

TEST(CpuFp8, DropoutAndProbsFollowTheSemantics) {
  // The C++ API (and the Python functions) take every option with fp8 inputs on the CPU,
  // dropout too, which FlashAttention-3 has not: dropout's kept set and the debug
  // probabilities match the oracle on the dequantized values.
  Rng rng(0xF803);
  DenseCase c = DenseCase::random(rng, {2, 23, 41, 4, 2, 16}, DType::kFloat32);
  const Fp8Inputs q8 = quantize_fp8(c);
  c.opts.dropout_p = 0.25f;
  c.opts.seed = 1234;
  c.opts.offset = 77;
  c.opts.causal = true;
  c.want_probs();
  c.out = HostTensor(DType::kFloat16, {2, 23, 4, 16});
  c.poison_forward();
  Options opts = c.call_options();
  q8.apply(opts);
  ASSERT_NO_THROW(forward(q8.q.view(), q8.k.view(), q8.v.view(), c.out.view(), c.lse.view(), opts));
  const ForwardResults got = forward_results(c);
  ASSERT_FALSE(got.probs.empty());
  expect_forward_matches(c.problem(), DType::kFloat16, got);
}

TEST(CpuFp8, BlockSparseReadsNoUnlistedKey) {
  // An fp8 call with a block-sparse mask whose unlisted key blocks hold NaN (0x7F) in v:
  // they must not be read (a NaN times probability 0 would poison the output).
  Rng rng(0xF802);
  DenseCase c = DenseCase::random(rng, {1, 8, 256, 1, 1, 8}, DType::kFloat32);
  Fp8Inputs q8 = quantize_fp8(c);
  for (std::int64_t j = 128; j < 256; ++j)
    for (int e = 0; e < 8; ++e) q8.v.as<std::uint8_t>()[j * 8 + e] = 0x7F;
  HostTensor cnt = int_tensor({1}, {1, 1, 1}), idx = int_tensor({0, 0}, {1, 1, 1, 2});
  c.out = HostTensor(DType::kBFloat16, {1, 8, 1, 8});
  c.poison_forward();
  Options opts = c.call_options();
  q8.apply(opts);
  opts.block_sparse.mask_block_cnt = cnt.view();
  opts.block_sparse.mask_block_idx = idx.view();
  opts.block_sparse.block_size_q = 128;
  opts.block_sparse.block_size_k = 128;
  ASSERT_NO_THROW(forward(q8.q.view(), q8.k.view(), q8.v.view(), c.out.view(), c.lse.view(), opts));
  // Expected: attention over the first 128 keys only.
  RefProblem ref = c.problem();
  ref.seqs[0].s_k = 128;
  ref.seqs[0].k.resize(128 * 8);
  ref.seqs[0].v.resize(128 * 8);
  expect_forward_matches(ref, DType::kBFloat16, forward_results(c));
}

struct Fp8Varlen {
  const char* name;
  std::vector<int> len_q, len_k;
  int h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  bool seqused;
};

void PrintTo(const Fp8Varlen& f, std::ostream* os) { *os << f.name; }

class CpuFp8VarlenTest : public ::testing::TestWithParam<Fp8Varlen> {};

TEST_P(CpuFp8VarlenTest, MatchesOracleOverDequantizedInputs) {
  const Fp8Varlen f = GetParam();
  Rng rng(0xF810 + f.len_q.size() * 17 + static_cast<std::uint64_t>(f.d));
  VarlenCase c = VarlenCase::make(rng, offsets(f.len_q), offsets(f.len_k), f.h_q, f.h_k, f.d,
                                  DType::kFloat32, /*pad_q=*/3, /*pad_k=*/5);
  if (f.seqused) {
    std::vector<int> used;
    for (int b = 0; b < c.batch(); ++b) used.push_back(c.len_k(b) / 2 + 1 > c.len_k(b) ? c.len_k(b) : c.len_k(b) / 2 + 1);
    c.set_seqused_k(used);
  }
  const Fp8Inputs q8 = quantize_fp8(c);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  c.out = HostTensor(DType::kBFloat16, {c.total_q, f.h_q, f.d});
  c.poison_forward();
  Options opts = c.call_options();
  q8.apply(opts);
  VarlenArgs a = c.args();
  a.q = q8.q.view();
  a.k = q8.k.view();
  a.v = q8.v.view();
  SCOPED_TRACE(std::string(f.name) + " " + describe(opts));
  ASSERT_NO_THROW(varlen_forward(a, c.out.view(), c.lse.view(), opts));
  expect_forward_matches(c.problem(), DType::kBFloat16, forward_results(c));
}

INSTANTIATE_TEST_SUITE_P(
    Packs, CpuFp8VarlenTest,
    ::testing::Values(Fp8Varlen{"plain", {17, 1, 40}, {23, 9, 40}, 2, 2, 32, false, -1, -1, 0.f, false},
                      Fp8Varlen{"causal_gqa_empty", {30, 0, 65}, {50, 7, 129}, 6, 3, 64, true, -1, -1, 0.f, false},
                      Fp8Varlen{"window_softcap_mqa", {33, 12}, {70, 12}, 4, 1, 16, false, 8, 3, 4.f, false},
                      Fp8Varlen{"seqused_k", {9, 20, 31}, {40, 21, 60}, 2, 1, 8, true, -1, -1, 0.f, true}),
    [](const auto& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------ rules

template <class F>
std::string unsupported_message(F&& call) {
  try {
    call();
  } catch (const Unsupported& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

template <class F>
std::string invalid_message(F&& call) {
  try {
    call();
  } catch (const Unsupported& e) {
    return std::string("Unsupported, expected InvalidArgument: ") + e.what();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no exception";
}

TEST(CpuFp8, BackwardIsUnsupported) {
  Rng rng(0xF820);
  DenseCase c = DenseCase::random(rng, {1, 8, 8, 2, 1, 8}, DType::kFloat32);
  Fp8Inputs q8 = quantize_fp8(c);
  HostTensor out(DType::kBFloat16, {1, 8, 2, 8}), dout(DType::kBFloat16, {1, 8, 2, 8});
  HostTensor dq(DType::kFloat8E4M3, {1, 8, 2, 8}), dk(DType::kFloat8E4M3, {1, 8, 1, 8}),
      dv(DType::kFloat8E4M3, {1, 8, 1, 8});
  Options opts;
  q8.apply(opts);
  const std::string m = unsupported_message([&] {
    backward(dout.view(), q8.q.view(), q8.k.view(), q8.v.view(), out.view(), c.lse.view(),
             dq.view(), dk.view(), dv.view(), opts);
  });
  EXPECT_NE(m.find("'q'"), std::string::npos) << m;
  EXPECT_NE(m.find("no backward for float8_e4m3"), std::string::npos) << m;
  EXPECT_NE(unsupported_message([&] { backward_workspace_size(q8.q.view(), q8.k.view(), q8.v.view(), opts); })
                .find("no backward for float8_e4m3"),
            std::string::npos);
}

TEST(CpuFp8, BadArguments) {
  Rng rng(0xF830);
  DenseCase c = DenseCase::random(rng, {2, 8, 8, 4, 2, 8}, DType::kFloat32);
  Fp8Inputs q8 = quantize_fp8(c);
  HostTensor out(DType::kBFloat16, {2, 8, 4, 8});
  auto fwd = [&](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Options& opts) {
    return invalid_message([&] { forward(q, k, v, o, c.lse.view(), opts); });
  };
  Options ok;
  q8.apply(ok);
  // out fp32 / fp8.
  HostTensor out32(DType::kFloat32, {2, 8, 4, 8});
  std::string m = fwd(q8.q.view(), q8.k.view(), q8.v.view(), out32.view(), ok);
  EXPECT_NE(m.find("'out'"), std::string::npos) << m;
  EXPECT_NE(m.find("bfloat16 or float16"), std::string::npos) << m;
  // k of another dtype.
  HostTensor k16(DType::kBFloat16, {2, 8, 2, 8});
  m = fwd(q8.q.view(), k16.view(), q8.v.view(), out.view(), ok);
  EXPECT_NE(m.find("'k'"), std::string::npos) << m;
  EXPECT_NE(m.find("float8_e4m3"), std::string::npos) << m;
  // descale shapes [b, h_q] instead of [b, h_k], fp16 dtype.
  HostTensor wrong(DType::kFloat32, {2, 4}), half(DType::kFloat16, {2, 2});
  Options bad = ok;
  bad.q_descale = wrong.view();
  m = fwd(q8.q.view(), q8.k.view(), q8.v.view(), out.view(), bad);
  EXPECT_NE(m.find("'opts.q_descale'"), std::string::npos) << m;
  EXPECT_NE(m.find("[2, 2]"), std::string::npos) << m;
  bad = ok;
  bad.v_descale = half.view();
  m = fwd(q8.q.view(), q8.k.view(), q8.v.view(), out.view(), bad);
  EXPECT_NE(m.find("'opts.v_descale'"), std::string::npos) << m;
  EXPECT_NE(m.find("float32"), std::string::npos) << m;
  // descales without fp8 inputs.
  HostTensor out16(DType::kBFloat16, {2, 8, 4, 8});
  m = fwd(c.q.view(), c.k.view(), c.v.view(), c.out.view(), ok);
  EXPECT_NE(m.find("'opts.q_descale'"), std::string::npos) << m;
  EXPECT_NE(m.find("float8_e4m3"), std::string::npos) << m;
  // qv with fp8: Unsupported.
  HostTensor qv(DType::kFloat8E4M3, {2, 8, 4, 8});
  Options with_qv = ok;
  with_qv.qv = qv.view();
  m = unsupported_message([&] { forward(q8.q.view(), q8.k.view(), q8.v.view(), out.view(), c.lse.view(), with_qv); });
  EXPECT_NE(m.find("'opts.qv'"), std::string::npos) << m;
  // Nothing was written by the failed calls: out is still its poison.
  out.fill_nan();
  fwd(q8.q.view(), q8.k.view(), q8.v.view(), out32.view(), ok);
  EXPECT_EQ(out.count_nan(), out.numel());
}

}  // namespace
}  // namespace flashattn::test
