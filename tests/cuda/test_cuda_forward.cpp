// CUDA forward (sm80 path) through the public API against the fp64 oracle under the
// suite's tolerance rule: every mask, softcap, ALiBi, dropout (keep decisions checked
// element by element against semantics::DropoutRng, and outputs against the CPU backend
// with the same seed), GQA, odd and unequal lengths (1, 17, 113, 1000), every head-dim
// bucket and non-bucket dims, fp16 and bf16, varlen with empty sequences and seqused_k,
// KV caches (dense with cache_batch_idx, paged), fully masked rows, extreme logits, and
// outputs poisoned with NaN before every call (checked fully written).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

Options with_device_alibi(Options opts, const std::vector<float>& alibi, const HostTensor& t,
                          std::unique_ptr<DeviceCopy>& holder) {
  if (!alibi.empty()) {
    holder = std::make_unique<DeviceCopy>(t);
    opts.alibi_slopes = holder->view();
  }
  return opts;
}

// The CUDA forward of a dense case: out / lse poisoned, run on the device, downloaded.
void run_cuda_forward(DenseCase& c) {
  c.poison_forward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse);
  std::unique_ptr<DeviceCopy> alibi;
  const Options opts = with_device_alibi(c.call_options(), c.alibi, c.alibi_tensor, alibi);
  ASSERT_NO_THROW(flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
}

void check_dense(DenseCase& c) {
  SCOPED_TRACE(c.shape.str() + " " + dtype_name(c.dtype) + " " + describe(c.call_options()));
  run_cuda_forward(c);
  const ForwardResults got = forward_results(c);
  EXPECT_TRUE(fully_written("out", got.out));
  EXPECT_TRUE(fully_written("lse", got.lse));
  expect_forward_matches(c.problem(), c.dtype, got);
}

Shape shape_of(int b, int s_q, int s_k, int h_q, int h_k, int d) { return {b, s_q, s_k, h_q, h_k, d}; }

struct Feature {
  const char* name;
  int b, s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  int alibi;  // 0 off, 1 [h_q], 2 [b, h_q]
  float dropout;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

class CudaForwardFeature : public ::testing::TestWithParam<Feature> {};

TEST_P(CudaForwardFeature, MatchesOracle) {
  FA_REQUIRE_GPU();
  const Feature& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim " << f.d << " not in this build";
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    DenseCase c = DenseCase::random(rng, shape_of(f.b, f.s_q, f.s_k, f.h_q, f.h_k, f.d), dtype);
    c.opts.causal = f.causal;
    c.opts.window_left = f.left;
    c.opts.window_right = f.right;
    c.opts.softcap = f.softcap;
    if (f.alibi) c.set_alibi(random_alibi(rng, f.b, f.h_q, f.alibi == 2), f.alibi == 2);
    c.opts.dropout_p = f.dropout;
    c.opts.seed = rng();
    c.opts.offset = rng();
    check_dense(c);
  }
}

// Lengths straddle the 128-row query tiles and the 32/64-key tiles.
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaForwardFeature,
    ::testing::Values(Feature{"plain", 2, 131, 197, 2, 2, 64, false, -1, -1, 0, 0, 0},
                      Feature{"len1", 3, 1, 1, 2, 1, 64, false, -1, -1, 0, 0, 0},
                      Feature{"len17", 2, 17, 17, 2, 2, 128, false, -1, -1, 0, 0, 0},
                      Feature{"len113_causal", 1, 113, 113, 2, 1, 128, true, -1, -1, 0, 0, 0},
                      Feature{"len1000", 1, 1000, 1000, 2, 2, 64, false, -1, -1, 0, 0, 0},
                      Feature{"len1000_causal", 1, 1000, 1000, 2, 1, 128, true, -1, -1, 0, 0, 0},
                      Feature{"one_query", 1, 1, 777, 2, 1, 64, false, -1, -1, 0, 0, 0},
                      Feature{"gqa2", 1, 97, 203, 4, 2, 128, false, -1, -1, 0, 0, 0},
                      Feature{"gqa4_causal", 2, 150, 150, 8, 2, 64, true, -1, -1, 0, 0, 0},
                      Feature{"mqa", 1, 70, 259, 4, 1, 128, false, -1, -1, 0, 0, 0},
                      Feature{"causal_sq_gt_sk", 1, 300, 90, 2, 1, 64, true, -1, -1, 0, 0, 0},
                      Feature{"causal_sq_lt_sk", 1, 90, 300, 2, 1, 64, true, -1, -1, 0, 0, 0},
                      Feature{"window_left", 1, 230, 230, 2, 2, 64, false, 37, -1, 0, 0, 0},
                      Feature{"window_right", 1, 230, 230, 2, 2, 64, false, -1, 21, 0, 0, 0},
                      Feature{"window_both", 1, 190, 260, 2, 2, 128, false, 45, 13, 0, 0, 0},
                      Feature{"window_zero", 1, 140, 140, 2, 2, 64, false, 0, 0, 0, 0, 0},
                      Feature{"causal_window", 1, 260, 190, 4, 2, 64, true, 70, -1, 0, 0, 0},
                      Feature{"softcap", 1, 121, 187, 2, 1, 64, false, -1, -1, 2.5f, 0, 0},
                      Feature{"alibi", 1, 121, 187, 4, 2, 64, true, -1, -1, 0, 1, 0},
                      Feature{"alibi_batch", 2, 121, 187, 4, 2, 128, false, 60, 60, 0, 2, 0},
                      Feature{"dropout", 1, 137, 211, 2, 1, 64, false, -1, -1, 0, 0, 0.25f},
                      Feature{"dropout_causal_gqa", 1, 137, 130, 4, 2, 128, true, -1, -1, 0, 0, 0.4f},
                      Feature{"everything", 2, 129, 164, 8, 2, 64, true, 51, -1, 4.0f, 2, 0.2f},
                      // hdim 256 with >= 512 keys per query on average: on sm90 the staggered
                      // 64 x 64 tile (tile_size.hpp), partial last key tile, last batch
                      Feature{"hd256_long", 2, 70, 709, 2, 1, 256, false, -1, -1, 0, 0, 0},
                      Feature{"hd256_long_causal_window", 1, 150, 900, 4, 2, 256, true, 600, -1, 0, 0, 0},
                      Feature{"hd248_long_everything", 2, 129, 611, 4, 2, 248, true, -1, -1, 4.0f, 2, 0.2f}),
    [](const ::testing::TestParamInfo<Feature>& i) { return std::string(i.param.name); });

// Every bucket (those larger than the build's largest are skipped) and non-bucket dims,
// which run in the next bucket with zero-filled loads and masked stores.
TEST(CudaForward, HeadDims) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : {8, 32, 40, 64, 72, 96, 128, 136, 160, 192, 224, 248, 256}) {
    if (!detail::cuda::supports_head_dim(d)) continue;
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, shape_of(2, 83, 141, 2, 1, d), dtype);
      c.opts.causal = d % 64 == 0;
      check_dense(c);
    }
  }
}

// A randomized grid of shapes, masks and features.
TEST(CudaForward, RandomGrid) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  ShapeLimits limits;
  limits.max_seqlen = 300;
  limits.head_dims = {8, 32, 40, 64, 72, 96, 128, 160, 256};
  for (int trial = 0; trial < 24; ++trial) {
    Shape s = random_shape(rng, limits);
    if (!detail::cuda::supports_head_dim(s.d)) continue;
    const DType dtype = coin(rng) ? DType::kFloat16 : DType::kBFloat16;
    DenseCase c = DenseCase::random(rng, s, dtype);
    c.opts.causal = coin(rng);
    if (coin(rng, 0.3)) c.opts.window_left = uniform_int(rng, 0, 100);
    if (!c.opts.causal && coin(rng, 0.3)) c.opts.window_right = uniform_int(rng, 0, 100);
    if (coin(rng, 0.25)) c.opts.softcap = static_cast<float>(uniform_real(rng, 1.0, 20.0));
    if (coin(rng, 0.25)) {
      const bool per_batch = coin(rng);
      c.set_alibi(random_alibi(rng, s.batch, s.h_q, per_batch), per_batch);
    }
    if (coin(rng, 0.25)) {
      c.opts.dropout_p = static_cast<float>(uniform_real(rng, 0.05, 0.6));
      c.opts.seed = rng();
      c.opts.offset = rng();
    }
    check_dense(c);
  }
}

// Dropout keeps exactly semantics::DropoutRng's set: with one-hot values (v[j] = e_j,
// s_k <= d) out[i][j] = P(i, j) / (1 - p) when (i, j) is kept and exactly 0 otherwise.
TEST(CudaForward, DropoutKeepsTheSemanticsSet) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const int b = 2, s_q = 77, s_k = 120, h_q = 4, h_k = 2, d = 128;
    DenseCase c = DenseCase::random(rng, shape_of(b, s_q, s_k, h_q, h_k, d), dtype, 0.3);
    for (std::int64_t bb = 0; bb < b; ++bb)
      for (std::int64_t j = 0; j < s_k; ++j)
        for (std::int64_t g = 0; g < h_k; ++g)
          for (std::int64_t e = 0; e < d; ++e) c.v.set(c.v.index({bb, j, g, e}), e == j ? 1.0 : 0.0);
    c.opts.dropout_p = 0.35f;
    c.opts.seed = rng();
    c.opts.offset = rng();
    run_cuda_forward(c);
    semantics::DropoutRng drop;
    drop.seed = c.opts.seed;
    drop.offset = c.opts.offset;
    drop.threshold = semantics::dropout_threshold(c.opts.dropout_p);
    std::int64_t kept = 0, mismatches = 0;
    for (int bb = 0; bb < b; ++bb)
      for (int h = 0; h < h_q; ++h)
        for (int i = 0; i < s_q; ++i)
          for (int j = 0; j < s_k; ++j) {
            const bool keep = drop.keep(static_cast<std::uint32_t>(bb * h_q + h), i, j);
            const double o = c.out.at({bb, i, h, j});
            kept += keep;
            if (keep != (o != 0.0)) ++mismatches;
          }
    EXPECT_EQ(mismatches, 0) << "of " << b * h_q * s_q * s_k << " (kept " << kept << ")";
    expect_forward_matches(c.problem(), c.dtype, forward_results(c));

    // The CPU backend with the same seed: the same kept set, so the same output to rounding.
    DenseCase cpu = c;
    cpu.poison_forward();
    ASSERT_NO_THROW(cpu.run_forward());
    const ForwardResults gpu_r = forward_results(c), cpu_r = forward_results(cpu);
    const ForwardExpectation expectation = ForwardExpectation::of(c.problem(), c.dtype);
    EXPECT_TRUE(close_to_reference("out vs CPU", gpu_r.out, cpu_r.out, concat_out(expectation.naive),
                                   c.dtype));
  }
}

// Rows that see no key (causal with s_q > s_k, a window past the keys) give out 0 and
// lse -inf; never NaN.
TEST(CudaForward, FullyMaskedRows) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, shape_of(1, 200, 70, 2, 1, 64), DType::kBFloat16);
  c.opts.causal = true;  // rows 0..129 see nothing
  check_dense(c);
  for (std::int64_t i = 0; i < 130; ++i)
    for (std::int64_t h = 0; h < 2; ++h) {
      ASSERT_EQ(c.lse.at({0, h, i}), -INFINITY) << "row " << i;
      for (std::int64_t e = 0; e < 64; ++e) ASSERT_EQ(c.out.at({0, i, h, e}), 0.0) << "row " << i;
    }
  // Window (5, 0) with s_q = 100, s_k = 50: row i sees keys [i - 55, i - 50], so rows
  // 0..49 see nothing and 50..99 see up to 6 keys.
  DenseCase w = DenseCase::random(rng, shape_of(2, 100, 50, 2, 2, 128), DType::kFloat16);
  w.opts.window_left = 5;
  w.opts.window_right = 0;
  check_dense(w);
  for (std::int64_t bb = 0; bb < 2; ++bb)
    for (std::int64_t i = 0; i < 50; ++i) ASSERT_EQ(w.lse.at({bb, 1, i}), -INFINITY) << "row " << i;
}

TEST(CudaForward, ExtremeLogits) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    DenseCase c = DenseCase::random(rng, shape_of(1, 190, 333, 2, 1, 128), dtype);
    for (std::int64_t e = 0; e < c.q.numel(); ++e) c.q.set(e, 12.0 * c.q.get(e));
    c.opts.causal = true;
    check_dense(c);
    const ForwardResults r = forward_results(c);
    EXPECT_TRUE(all_finite("out", r.out));
  }
}

// Any strides with 16-byte aligned rows: q, k, v are slices of one packed [b, s, 3, h, d]
// buffer and out has padded rows; the padding must stay untouched.
TEST(CudaForward, PackedQkvAndPaddedOut) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const std::int64_t b = 2, s = 157, h = 3, d = 64, pad = 24;
    DenseCase c = DenseCase::random(rng, shape_of(2, 157, 157, 3, 3, 64), dtype);
    c.opts.causal = true;
    c.poison_forward();
    const std::int64_t packed_row = 3 * h * d, out_row = h * d + pad;
    std::vector<std::uint16_t> packed(std::size_t(b * s * packed_row));
    const HostTensor* parts[3] = {&c.q, &c.k, &c.v};
    for (std::int64_t t = 0; t < 3; ++t)
      for (std::int64_t r = 0; r < b * s; ++r)
        for (std::int64_t e = 0; e < h * d; ++e)
          packed[std::size_t(r * packed_row + t * h * d + e)] = parts[t]->as<std::uint16_t>()[r * h * d + e];
    // 0xffff is a NaN in both fp16 and bf16
    std::vector<std::uint16_t> out_host(std::size_t(b * s * out_row), 0xffffu);
    std::uint16_t* qkv_dev = nullptr;
    std::uint16_t* out_dev = nullptr;
    FA_CUDA_OK(cudaMalloc(&qkv_dev, packed.size() * 2));
    FA_CUDA_OK(cudaMalloc(&out_dev, out_host.size() * 2));
    FA_CUDA_OK(cudaMemcpy(qkv_dev, packed.data(), packed.size() * 2, cudaMemcpyHostToDevice));
    FA_CUDA_OK(cudaMemcpy(out_dev, out_host.data(), out_host.size() * 2, cudaMemcpyHostToDevice));
    auto slice = [&](std::int64_t t) {
      return Tensor::strided(qkv_dev + t * h * d, dtype, {b, s, h, d}, {s * packed_row, packed_row, d, 1},
                             Device::cuda(0));
    };
    const Tensor out = Tensor::strided(out_dev, dtype, {b, s, h, d}, {s * out_row, out_row, d, 1},
                                       Device::cuda(0));
    DeviceCopy lse(c.lse);
    ASSERT_NO_THROW(flashattn::forward(slice(0), slice(1), slice(2), out, lse.view(), c.call_options()));
    FA_CUDA_OK(cudaDeviceSynchronize());
    FA_CUDA_OK(cudaMemcpy(out_host.data(), out_dev, out_host.size() * 2, cudaMemcpyDeviceToHost));
    lse.download(c.lse);
    cudaFree(qkv_dev);
    cudaFree(out_dev);
    std::int64_t padding_written = 0;
    for (std::int64_t r = 0; r < b * s; ++r) {
      for (std::int64_t e = 0; e < h * d; ++e)
        c.out.as<std::uint16_t>()[r * h * d + e] = out_host[std::size_t(r * out_row + e)];
      for (std::int64_t e = h * d; e < out_row; ++e) padding_written += out_host[std::size_t(r * out_row + e)] != 0xffffu;
    }
    EXPECT_EQ(padding_written, 0) << "elements of the out row padding were written";
    const ForwardResults got = forward_results(c);
    EXPECT_TRUE(fully_written("out", got.out));
    EXPECT_TRUE(fully_written("lse", got.lse));
    expect_forward_matches(c.problem(), c.dtype, got);
  }
}

// ---------------------------------------------------------------- varlen

TEST(CudaForward, VarlenWithEmptySequencesAndSeqused) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (bool causal : {false, true}) {
      VarlenCase c = VarlenCase::make(rng, {0, 17, 17, 250, 251, 400}, {0, 30, 30, 200, 380, 513}, 4,
                                      2, 64, dtype, 3, 5);
      c.set_seqused_k({30, 0, 150, 180, 100});
      c.opts.causal = causal;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (causal ? " causal" : ""));
      c.poison_forward();
      DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), cuq(c.cu_q_t), cuk(c.cu_k_t),
          used(c.seqused_t);
      VarlenArgs a = c.args();
      a.q = q.view();
      a.k = k.view();
      a.v = v.view();
      a.cu_seqlens_q = cuq.view();
      a.cu_seqlens_k = cuk.view();
      a.seqused_k = used.view();
      ASSERT_NO_THROW(varlen_forward(a, out.view(), lse.view(), c.call_options()));
      FA_CUDA_OK(cudaDeviceSynchronize());
      out.download(c.out);
      lse.download(c.lse);
      const ForwardResults got = forward_results(c);
      EXPECT_TRUE(fully_written("out", got.out));
      EXPECT_TRUE(fully_written("lse", got.lse));
      expect_forward_matches(c.problem(), c.dtype, got);
    }
  }
}

// ---------------------------------------------------------------- KV cache

void check_kvcache(KVCacheCase& c) {
  SCOPED_TRACE(std::string(dtype_name(c.cfg.dtype)) + " block_size " +
               std::to_string(c.cfg.block_size) + " " + describe(c.call_options()));
  c.num_splits = 1;
  c.poison_outputs();
  DeviceCopy q(c.q), kc(c.k_cache), vc(c.v_cache), lens(c.cache_lens_t), table(c.block_table_t),
      idx(c.batch_idx_t), kn(c.k_new), vn(c.v_new), out(c.out), lse(c.lse);
  KVCacheArgs a = c.args();
  a.q = q.view();
  a.k_cache = kc.view();
  a.v_cache = vc.view();
  a.cache_seqlens = lens.view();
  if (a.block_table.defined()) a.block_table = table.view();
  if (a.cache_batch_idx.defined()) a.cache_batch_idx = idx.view();
  if (a.k_new.defined()) {
    a.k_new = kn.view();
    a.v_new = vn.view();
  }
  std::unique_ptr<DeviceCopy> alibi;
  const Options opts = with_device_alibi(c.call_options(), c.alibi, c.alibi_tensor, alibi);
  ASSERT_NO_THROW(kvcache_forward(a, out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
  HostTensor k_after = c.k_cache, v_after = c.v_cache;
  kc.download(k_after);
  vc.download(v_after);
  EXPECT_TRUE(k_after.bitwise_equal(c.k_cache_expected)) << "k_cache after the append";
  EXPECT_TRUE(v_after.bitwise_equal(c.v_cache_expected)) << "v_cache after the append";
  const ForwardResults got = forward_results(c);
  EXPECT_TRUE(fully_written("out", got.out));
  EXPECT_TRUE(fully_written("lse", got.lse));
  expect_forward_matches(c.problem(), c.cfg.dtype, got);
}

TEST(CudaForward, KVCacheDenseWithBatchIdx) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    KVCacheConfig cfg;
    cfg.batch = 3;
    cfg.s_q = 5;
    cfg.s_new = 3;
    cfg.h_q = 4;
    cfg.h_k = 2;
    cfg.d = 128;
    cfg.dtype = dtype;
    cfg.max_cache_len = 300;
    cfg.cache_rows = 5;
    cfg.use_batch_idx = true;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    check_kvcache(c);
  }
}

TEST(CudaForward, KVCachePaged) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    KVCacheConfig cfg;
    cfg.batch = 3;
    cfg.s_q = 1;
    cfg.s_new = 1;
    cfg.h_q = 8;
    cfg.h_k = 2;
    cfg.d = 64;
    cfg.dtype = dtype;
    cfg.max_cache_len = 400;
    cfg.block_size = 16;
    cfg.share_blocks = true;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    check_kvcache(c);
  }
}

// ---------------------------------------------------------------- what CUDA rejects

TEST(CudaForward, SplitsAndProbsAreUnsupported) {
  FA_REQUIRE_GPU();
  detail::FwdParams p;
  p.dtype = DType::kBFloat16;
  p.d = p.d_v = 64;
  p.num_splits = 2;
  EXPECT_THROW(detail::cuda::forward(p), Unsupported);
  EXPECT_EQ(detail::cuda::forward_workspace_size(p), 0u);
  p.num_splits = 1;
  float probs = 0;
  p.probs = &probs;
  EXPECT_THROW(detail::cuda::forward(p), Unsupported);
}

// The validation copy refuses (returns false, copies nothing) while the stream is captured.
TEST(CudaRuntime, ValidationCopyIsSkippedUnderCapture) {
  FA_REQUIRE_GPU();
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* dev = nullptr;
  FA_CUDA_OK(cudaMalloc(&dev, sizeof(int)));
  // On s itself: a non-blocking stream does not wait for the legacy stream's memset (under
  // load the copy below read the allocation before it: 0 for 0x11111111).
  FA_CUDA_OK(cudaMemsetAsync(dev, 0x11, sizeof(int), s));
  int host = 0;
  EXPECT_TRUE(detail::cuda::copy_to_host_for_validation(&host, dev, sizeof(int), s));
  EXPECT_EQ(host, 0x11111111);
  host = 7;
  FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  EXPECT_FALSE(detail::cuda::copy_to_host_for_validation(&host, dev, sizeof(int), s));
  cudaGraph_t graph;
  FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
  EXPECT_EQ(host, 7);
  cudaGraphDestroy(graph);
  cudaFree(dev);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace flashattn::test
