// CUDA tensors with a block-sparse mask (Options::block_sparse): the forward runs it (the
// sm80 family; the sm90 family declines and runs sm80), the kinds table built on the device
// from the lists. Against the fp64 oracle, which receives the dense element mask read from
// the lists by support/block_mask.hpp, with outputs poisoned: random masks (shuffled lists,
// garbage past each count), full and partial blocks, causal / window, GQA, broadcast lists,
// odd lengths, document ids and prefix keys, varlen; keys of unlisted blocks are never read
// (NaN there changes no bit); bad lists give errors naming them; block sizes that split a
// tile, and the backward, are Unsupported naming opts.block_sparse, before anything is
// written.
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "flashattn/error.hpp"
#include "support/block_mask.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

// The mask's tensors on the device, and Options pointing at them.
struct DeviceMask {
  std::vector<std::unique_ptr<DeviceCopy>> held;
  Tensor put(const HostTensor& t) {
    if (t.shape().empty()) return {};
    held.push_back(std::make_unique<DeviceCopy>(t));
    return held.back()->view();
  }
  void apply(const HostBlockMask& m, Options& o) {
    m.apply(o);
    BlockSparseTensors& bs = o.block_sparse;
    bs.mask_block_cnt = put(m.mask_cnt_t);
    bs.mask_block_idx = put(m.mask_idx_t);
    if (!m.full_cnt.empty()) {
      bs.full_block_cnt = put(m.full_cnt_t);
      bs.full_block_idx = put(m.full_idx_t);
    }
    if (!m.docs_q.empty()) {
      bs.q_doc_ids = put(m.docs_q_t);
      bs.k_doc_ids = put(m.docs_k_t);
    }
    if (!m.prefix.empty()) bs.prefix_keys = put(m.prefix_t);
  }
};

void run_dense(DenseCase& c, const HostBlockMask& m, KernelFamily family) {
  c.poison_forward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse);
  DeviceMask dm;
  Options o = c.call_options();
  o.kernel_family = family;
  dm.apply(m, o);
  ASSERT_NO_THROW(flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o));
  FA_CUDA_OK(cudaDeviceSynchronize());
  out.download(c.out);
  lse.download(c.lse);
}

struct Config {
  const char* name;
  int batch, s_q, s_k, h_q, h_k, d;
  int bq, bk;
  bool causal;
  int left;
  bool per_batch, per_head, with_full;
  double density;
};

void PrintTo(const Config& f, std::ostream* os) { *os << f.name; }

class CudaBlockSparse : public ::testing::TestWithParam<Config> {};

TEST_P(CudaBlockSparse, ForwardMatchesOracle) {
  FA_REQUIRE_GPU();
  const Config& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim not in this build";
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, Shape{f.batch, f.s_q, f.s_k, f.h_q, f.h_k, f.d}, dtype);
      c.opts.causal = f.causal;
      c.opts.window_left = f.left;
      const HostBlockMask m = random_mask(rng, f.batch, f.h_q, f.s_q, f.s_k, f.bq, f.bk, f.per_batch,
                                          f.per_head, f.density, f.with_full);
      SCOPED_TRACE(std::string(family_str(family)) + " " + c.shape.str() + " " + dtype_name(dtype) + " " +
                   describe(c.call_options()));
      run_dense(c, m, family);
      const RefProblem p = problem_with(c, m);
      const ForwardResults fwd = forward_results(c);
      EXPECT_TRUE(fully_written("out", fwd.out));
      EXPECT_TRUE(fully_written("lse", fwd.lse));
      expect_forward_matches(p, dtype, fwd);
    }
  }
}

// Block sizes are multiples of every CUDA forward tile (128 x 128 is FlashAttention-4's
// default; 256 x 128 spans two query tiles of 128 rows).
INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaBlockSparse,
    ::testing::Values(
        // name, b, s_q, s_k, h_q, h_k, d, bq, bk, causal, left, per_b, per_h, full, density
        Config{"odd_lengths_d64", 2, 300, 333, 2, 2, 64, 128, 128, false, -1, true, true, true, 0.5},
        Config{"causal_gqa_d128", 2, 517, 517, 4, 2, 128, 128, 128, true, -1, true, false, true, 0.7},
        Config{"window_broadcast_d64", 1, 400, 640, 2, 1, 64, 128, 128, false, 150, false, false, true, 0.6},
        Config{"partial_only_tall_blocks_d128", 1, 390, 700, 2, 2, 128, 256, 128, true, -1, true, true, false, 0.4},
        Config{"sparse_d256", 1, 260, 900, 2, 2, 256, 128, 128, false, -1, true, true, true, 0.2},
        Config{"all_listed_d64", 1, 257, 257, 2, 2, 64, 128, 128, true, -1, true, true, true, 1.0},
        Config{"nearly_empty_d64", 2, 256, 384, 2, 2, 64, 128, 128, false, -1, true, true, true, 0.05}),
    [](const auto& info) { return std::string(info.param.name); });

// Document ids in packed rows and prefix keys (prefix-LM / sink tokens) with causal
// partial blocks, softcap, and a random mask.
TEST(CudaBlockSparseRule, DocIdsAndPrefixMatchOracle) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int batch = 2, s = 333, h_q = 4, h_k = 2, d = 64;
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, Shape{batch, s, s, h_q, h_k, d}, dtype);
      c.opts.causal = true;
      c.opts.softcap = 5.0f;
      HostBlockMask m = random_mask(rng, batch, h_q, s, s, 128, 128, true, true, 0.8, true);
      m.docs_q.resize(std::size_t(batch) * s);
      for (int b = 0; b < batch; ++b) {
        int doc = 0;
        for (int i = 0; i < s; ++i) {
          if (i > 0 && coin(rng, 0.02)) ++doc;
          m.docs_q[std::size_t(b) * s + i] = doc;
        }
      }
      m.docs_k = m.docs_q;
      m.prefix = {uniform_int(rng, 0, s), uniform_int(rng, 0, 40)};
      m.build_tensors(batch, s, s);
      SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype));
      run_dense(c, m, family);
      const RefProblem p = problem_with(c, m);
      expect_forward_matches(p, dtype, forward_results(c));
    }
  }
}

// Keys of blocks that no query tile lists are never loaded: NaN in them leaves out / lse
// bit-identical.
TEST(CudaBlockSparseRule, UnlistedKeysAreNeverRead) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 256, 512, 2, 2, 64}, DType::kBFloat16);
  HostBlockMask m = random_mask(rng, 1, 2, 256, 512, 128, 128, false, false, 0.0, true);
  // Query blocks 0 and 1 both list key blocks 1 (partial) and 3 (full); 0 and 2 unlisted.
  m.mask_cnt = {1, 1};
  m.mask_idx = {1, 0, 0, 0, 1, 0, 0, 0};
  m.full_cnt = {1, 1};
  m.full_idx = {3, 0, 0, 0, 3, 0, 0, 0};
  m.build_tensors(1, 256, 512);
  run_dense(c, m, KernelFamily::kAuto);
  const HostTensor out = c.out, lse = c.lse;
  expect_forward_matches(problem_with(c, m), c.dtype, forward_results(c));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::int64_t width = std::int64_t(c.shape.h_k) * c.shape.d;
  for (int j : {0, 127, 128 * 2, 128 * 2 + 77}) {
    for (std::int64_t e = 0; e < width; ++e) {
      c.k.set(j * width + e, nan);
      c.v.set(j * width + e, nan);
    }
  }
  run_dense(c, m, KernelFamily::kAuto);
  EXPECT_TRUE(c.out.bitwise_equal(out)) << "out changed with NaN in unlisted keys";
  EXPECT_TRUE(c.lse.bitwise_equal(lse)) << "lse changed with NaN in unlisted keys";
}

// Varlen: positions within each sequence on the grid of max_seqlen_q x max_seqlen_k, packed
// doc ids.
TEST(CudaBlockSparseRule, VarlenMatchesOracle) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (KernelFamily family : gpu_families()) {
    VarlenCase c = VarlenCase::make(rng, {0, 300, 300, 557, 700}, {0, 260, 400, 700, 777}, 4, 2, 64,
                                    DType::kBFloat16, 3, 5);
    c.opts.causal = true;
    const int max_q = c.max_q(), max_k = c.max_k();
    HostBlockMask m = random_mask(rng, c.batch(), 4, max_q, max_k, 128, 128, true, true, 0.6, true);
    m.packed_docs = true;
    m.docs_q.resize(std::size_t(c.q.shape()[0]));
    m.docs_k.resize(std::size_t(c.k.shape()[0]));
    for (std::size_t i = 0; i < m.docs_q.size(); ++i) m.docs_q[i] = int(i / 97);
    for (std::size_t j = 0; j < m.docs_k.size(); ++j) m.docs_k[j] = int(j / 89);
    m.build_tensors(c.batch(), max_q, max_k);
    SCOPED_TRACE(family_str(family));
    c.poison_forward();
    DeviceVarlen d(c);
    DeviceCopy out(c.out), lse(c.lse);
    DeviceMask dm;
    Options o = c.call_options();
    o.kernel_family = family;
    dm.apply(m, o);
    ASSERT_NO_THROW(flashattn::varlen_forward(d.args, out.view(), lse.view(), o));
    FA_CUDA_OK(cudaDeviceSynchronize());
    out.download(c.out);
    lse.download(c.lse);
    RefProblem p = c.problem();
    for (int b = 0; b < c.batch(); ++b)
      p.seqs[std::size_t(b)].element_mask =
          m.element_mask(b, 4, c.len_q(b), c.len_k(b), p.mask, c.cu_q[b], c.cu_k[b]);
    expect_forward_matches(p, c.dtype, forward_results(c));
  }
}

HostTensor int32_tensor(std::vector<std::int64_t> shape, const std::vector<int>& values) {
  HostTensor t(DType::kInt32, std::move(shape));
  for (std::size_t i = 0; i < values.size(); ++i) t.as<std::int32_t>()[i] = values[i];
  return t;
}

// Bad lists are InvalidArgument naming them; block sizes that split a tile and the backward
// are Unsupported naming opts.block_sparse; out keeps its poison.
TEST(CudaBlockSparseRule, ErrorsNameTheArgument) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 130, 130, 2, 2, 64}, DType::kFloat16);
  c.poison_forward();
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  auto forward_with = [&](const HostTensor& cnt, const HostTensor& idx, int bq, int bk) {
    DeviceCopy dcnt(cnt), didx(idx);
    Options o;
    o.block_sparse.mask_block_cnt = dcnt.view();
    o.block_sparse.mask_block_idx = didx.view();
    o.block_sparse.block_size_q = bq;
    o.block_sparse.block_size_k = bk;
    flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
  };
  // Two 128 x 128 query blocks; an index out of range; a block listed twice; a count above N.
  for (auto [cnt, idx, what] :
       {std::tuple{std::vector<int>{1, 1}, std::vector<int>{0, 0, 2, 0}, "in [0, N)"},
        std::tuple{std::vector<int>{2, 1}, std::vector<int>{1, 1, 0, 0}, "listed again"},
        std::tuple{std::vector<int>{3, 1}, std::vector<int>{0, 1, 0, 0}, "counts in [0"}}) {
    try {
      forward_with(int32_tensor({1, 1, 2}, cnt), int32_tensor({1, 1, 2, 2}, idx), 128, 128);
      FAIL() << "no error for " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("opts.block_sparse.mask_block_"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  // 32 x 32 blocks split the forward's tiles.
  try {
    std::vector<int> cnt(5, 1), idx(25, 0);
    forward_with(int32_tensor({1, 1, 5}, cnt), int32_tensor({1, 1, 5, 5}, idx), 32, 32);
    FAIL() << "no error for 32 x 32 blocks";
  } catch (const Unsupported& e) {
    EXPECT_EQ(e.argument(), "opts.block_sparse") << e.what();
    EXPECT_NE(std::string(e.what()).find("a multiple of"), std::string::npos) << e.what();
  }
  // The backward: Unsupported.
  try {
    DeviceCopy dcnt(int32_tensor({1, 1, 2}, {1, 1})), didx(int32_tensor({1, 1, 2, 2}, {0, 0, 0, 0}));
    Options o;
    o.block_sparse.mask_block_cnt = dcnt.view();
    o.block_sparse.mask_block_idx = didx.view();
    flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                        dv.view(), o);
    FAIL() << "no error for the backward";
  } catch (const Unsupported& e) {
    EXPECT_EQ(e.argument(), "opts.block_sparse") << e.what();
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor got = c.out;
  out.download(got);
  EXPECT_EQ(got.count_nan(), got.numel()) << "out was written";
}

}  // namespace
}  // namespace flashattn::test
