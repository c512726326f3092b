// CUDA tensors with a block-sparse mask (Options::block_sparse): the forward and the
// backward run it (the sm80 family; the sm90 family declines and runs sm80), the kinds
// table built on the device from the lists (in the backward's workspace for the backward).
// Against the fp64 oracle, which receives the dense element mask read from the lists by
// support/block_mask.hpp, with outputs poisoned: random masks (shuffled lists, garbage past
// each count), full and partial blocks, causal / window, GQA, broadcast lists, odd lengths,
// document ids and prefix keys, varlen, deterministic mode (bit-identical reruns, several
// tiles per block); keys of unlisted blocks and queries of query blocks that list nothing
// are never read (NaN there changes no bit of out, lse, dq, dk, dv); bad lists give errors
// naming them; block sizes that split a tile are Unsupported naming opts.block_sparse,
// before anything is written.
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_copy.hpp"
#include "cuda/device_mask.hpp"
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

// The device backward of c's out / lse (as they are) with the block mask.
void run_dense_backward(DenseCase& c, const HostBlockMask& m, KernelFamily family) {
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  DeviceMask dm;
  Options o = c.call_options();
  o.kernel_family = family;
  dm.apply(m, o);
  ASSERT_NO_THROW(flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(),
                                      dk.view(), dv.view(), o));
  FA_CUDA_OK(cudaDeviceSynchronize());
  dq.download(c.dq);
  dk.download(c.dk);
  dv.download(c.dv);
}

// The device forward, then the device backward of its out / lse, against the oracle (the
// naive backward reads the same out / lse); every gradient written.
void check_forward_backward(DenseCase& c, const HostBlockMask& m, KernelFamily family) {
  run_dense(c, m, family);
  const RefProblem p = problem_with(c, m);
  const ForwardResults fwd = forward_results(c);
  expect_forward_matches(p, c.dtype, fwd);
  run_dense_backward(c, m, family);
  const BackwardResults got = backward_results(c);
  EXPECT_TRUE(fully_written("dq", got.dq));
  EXPECT_TRUE(fully_written("dk", got.dk));
  EXPECT_TRUE(fully_written("dv", got.dv));
  expect_backward_matches(p, c.dtype, fwd, got);
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

// For each GPU family and 16-bit dtype: a fresh random case of configuration f and its
// random block mask, traced, handed to body(case, mask, family).
template <class Body>
void for_each_case(Rng& rng, const Config& f, Body&& body) {
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, Shape{f.batch, f.s_q, f.s_k, f.h_q, f.h_k, f.d}, dtype);
      c.opts.causal = f.causal;
      c.opts.window_left = f.left;
      const HostBlockMask m = random_mask(rng, f.batch, f.h_q, f.s_q, f.s_k, f.bq, f.bk, f.per_batch,
                                          f.per_head, f.density, f.with_full);
      SCOPED_TRACE(std::string(family_str(family)) + " " + c.shape.str() + " " + dtype_name(dtype) + " " +
                   describe(c.call_options()));
      body(c, m, family);
    }
  }
}

TEST_P(CudaBlockSparse, ForwardMatchesOracle) {
  FA_REQUIRE_GPU();
  const Config& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim not in this build";
  FA_SEEDED_RNG(rng);
  for_each_case(rng, f, [&](DenseCase& c, const HostBlockMask& m, KernelFamily family) {
    run_dense(c, m, family);
    const RefProblem p = problem_with(c, m);
    const ForwardResults fwd = forward_results(c);
    EXPECT_TRUE(fully_written("out", fwd.out));
    EXPECT_TRUE(fully_written("lse", fwd.lse));
    expect_forward_matches(p, c.dtype, fwd);
  });
}

// The backward of the same configurations (the CUDA forward's out / lse): dq, dk, dv
// against the oracle. The sm90 family declines block-sparse calls and runs sm80.
TEST_P(CudaBlockSparse, BackwardMatchesOracle) {
  FA_REQUIRE_GPU();
  const Config& f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim not in this build";
  if (backward_over_cap(f.d)) {  // a 99 KiB part: no backward above d = 160
    expect_backward_declined(f.d);
    return;
  }
  FA_SEEDED_RNG(rng);
  for_each_case(rng, f, [&](DenseCase& c, const HostBlockMask& m, KernelFamily family) {
    check_forward_backward(c, m, family);
  });
}

// Block sizes are multiples of every CUDA forward and backward tile (128 x 128 is FlashAttention-4's
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
// partial blocks, GQA and a random mask, forward and backward: with softcap (the kernels'
// general copies) and without (the plain copies' masked path), at d 64 and 128 (the
// backward's 128- and 64-row query tiles).
TEST(CudaBlockSparseRule, DocIdsAndPrefixMatchOracle) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int batch = 2, s = 333, h_q = 4, h_k = 2;
  for (const auto& [d, softcap] : {std::pair{64, 5.0f}, std::pair{64, 0.0f}, std::pair{128, 0.0f}}) {
  for (KernelFamily family : gpu_families()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      DenseCase c = DenseCase::random(rng, Shape{batch, s, s, h_q, h_k, d}, dtype);
      c.opts.causal = true;
      c.opts.softcap = softcap;
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
      SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype) + " d " + std::to_string(d) +
                   " softcap " + std::to_string(softcap));
      check_forward_backward(c, m, family);
    }
  }
  }
}

// Keys of blocks that no query tile lists are never loaded, nor the queries (q, dout) of a
// query block that lists nothing: NaN in them leaves out / lse and, in deterministic mode,
// dq / dk / dv bit-identical; the unlisted keys' dk / dv and those queries' dq are 0.
TEST(CudaBlockSparseRule, UnlistedKeysAreNeverRead) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : built_head_dims({64, 128, 256})) {
    SCOPED_TRACE("d " + std::to_string(d));
    if (backward_over_cap(d)) {  // a 99 KiB part: no backward above d = 160
      expect_backward_declined(d);
      continue;
    }
    const int s_q = 384, s_k = 512;
    DenseCase c = DenseCase::random(rng, Shape{1, s_q, s_k, 2, 2, d}, DType::kBFloat16);
    c.opts.deterministic = true;
    HostBlockMask m = random_mask(rng, 1, 2, s_q, s_k, 128, 128, false, false, 0.0, true);
    // Query blocks 0 and 1 both list key blocks 1 (partial) and 3 (full); key blocks 0 and 2
    // unlisted; query block 2 lists nothing.
    m.mask_cnt = {1, 1, 0};
    m.mask_idx = {1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0};
    m.full_cnt = {1, 1, 0};
    m.full_idx = {3, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0};
    m.build_tensors(1, s_q, s_k);
    check_forward_backward(c, m, KernelFamily::kAuto);
    const HostTensor out = c.out, lse = c.lse, dq = c.dq, dk = c.dk, dv = c.dv;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const std::int64_t width = std::int64_t(c.shape.h_k) * c.shape.d;
    const std::vector<int> keys = {0, 127, 128 * 2, 128 * 2 + 77};
    for (int j : keys) {
      for (std::int64_t e = 0; e < width; ++e) {
        c.k.set(j * width + e, nan);
        c.v.set(j * width + e, nan);
      }
    }
    const std::int64_t q_width = std::int64_t(c.shape.h_q) * c.shape.d;
    const std::vector<int> rows = {256, 300, s_q - 1};
    for (int i : rows) {
      for (std::int64_t e = 0; e < q_width; ++e) {
        c.q.set(i * q_width + e, nan);
        c.dout.set(i * q_width + e, nan);
      }
    }
    run_dense(c, m, KernelFamily::kAuto);
    EXPECT_TRUE(c.out.bitwise_equal(out)) << "out changed with NaN in unlisted keys / queries";
    EXPECT_TRUE(c.lse.bitwise_equal(lse)) << "lse changed with NaN in unlisted keys / queries";
    run_dense_backward(c, m, KernelFamily::kAuto);
    EXPECT_TRUE(c.dq.bitwise_equal(dq)) << "dq changed with NaN in unlisted keys / queries";
    EXPECT_TRUE(c.dk.bitwise_equal(dk)) << "dk changed with NaN in unlisted keys / queries";
    EXPECT_TRUE(c.dv.bitwise_equal(dv)) << "dv changed with NaN in unlisted keys / queries";
    for (int j : keys)
      for (std::int64_t e = 0; e < width; ++e) {
        ASSERT_EQ(c.dk.get(j * width + e), 0.0) << "dk of unlisted key " << j;
        ASSERT_EQ(c.dv.get(j * width + e), 0.0) << "dv of unlisted key " << j;
      }
    for (int i : rows)
      for (std::int64_t e = 0; e < q_width; ++e) ASSERT_EQ(c.dq.get(i * q_width + e), 0.0) << "dq of row " << i;
  }
}

// Deterministic mode: dq added in key-tile order behind per-query-tile counters, which with
// a block mask count the listed key tiles (blocks of 256 x 256: several query and key tiles
// per block at every head dim); reruns bit-identical, and against the oracle.
TEST(CudaBlockSparseRule, DeterministicBackwardIsReproducible) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int d : built_head_dims({64, 128, 256})) {
    if (backward_over_cap(d)) {  // a 99 KiB part: no backward above d = 160
      expect_backward_declined(d);
      continue;
    }
    for (bool causal : {false, true}) {
      DenseCase c = DenseCase::random(rng, Shape{2, 600, 777, 4, 2, d}, DType::kBFloat16);
      c.opts.causal = causal;
      c.opts.deterministic = true;
      const HostBlockMask m = random_mask(rng, 2, 4, 600, 777, 256, 256, true, true, 0.6, true);
      SCOPED_TRACE("d " + std::to_string(d) + " causal " + std::to_string(causal));
      check_forward_backward(c, m, KernelFamily::kAuto);
      const HostTensor dq = c.dq, dk = c.dk, dv = c.dv;
      run_dense_backward(c, m, KernelFamily::kAuto);
      EXPECT_TRUE(c.dq.bitwise_equal(dq)) << "dq differs between deterministic runs";
      EXPECT_TRUE(c.dk.bitwise_equal(dk)) << "dk differs between deterministic runs";
      EXPECT_TRUE(c.dv.bitwise_equal(dv)) << "dv differs between deterministic runs";
    }
  }
}

// Varlen: positions within each sequence on the grid of max_seqlen_q x max_seqlen_k, packed
// doc ids and prefix keys; forward, then the backward of its out / lse.
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
    m.prefix = {0, 37, 200, 5};
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
    const ForwardResults fwd = forward_results(c);
    expect_forward_matches(p, c.dtype, fwd);

    c.poison_backward();
    DeviceCopy dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
    ASSERT_NO_THROW(flashattn::varlen_backward(d.args, dout.view(), out.view(), lse.view(), dq.view(), dk.view(),
                                               dv.view(), o));
    FA_CUDA_OK(cudaDeviceSynchronize());
    dq.download(c.dq);
    dk.download(c.dk);
    dv.download(c.dv);
    const BackwardResults got = backward_results(c);
    EXPECT_TRUE(fully_written("dq", got.dq));
    EXPECT_TRUE(fully_written("dk", got.dk));
    EXPECT_TRUE(fully_written("dv", got.dv));
    expect_backward_matches(p, c.dtype, fwd, got);
  }
}

HostTensor int32_tensor(std::vector<std::int64_t> shape, const std::vector<int>& values) {
  HostTensor t(DType::kInt32, std::move(shape));
  for (std::size_t i = 0; i < values.size(); ++i) t.as<std::int32_t>()[i] = values[i];
  return t;
}

// With the host check of eager calls (FLASHATTN_DEVICE_INDEX_CHECKS=0): bad lists are
// InvalidArgument of the call, naming them (the backward's device-built table too); block
// sizes that split a tile are Unsupported naming opts.block_sparse, in the forward and the
// backward; out, dq, dk, dv keep their poison.
TEST(CudaBlockSparseRule, ErrorsNameTheArgument) {
  FA_REQUIRE_GPU();
  const IndexCheckPathScope host(detail::cuda::IndexCheckPath::kHost);
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
  auto backward_with = [&](const HostTensor& cnt, const HostTensor& idx, int bq, int bk, KernelFamily family) {
    DeviceCopy dcnt(cnt), didx(idx);
    Options o;
    o.kernel_family = family;
    o.block_sparse.mask_block_cnt = dcnt.view();
    o.block_sparse.mask_block_idx = didx.view();
    o.block_sparse.block_size_q = bq;
    o.block_sparse.block_size_k = bk;
    flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                        dv.view(), o);
  };
  for (KernelFamily family : gpu_families()) {
    SCOPED_TRACE(family_str(family));
    // The backward: bad lists name them; 32 x 32 blocks split its tiles (every head dim's
    // tile has at least 64 rows and 64 keys).
    try {
      backward_with(int32_tensor({1, 1, 2}, {1, 1}), int32_tensor({1, 1, 2, 2}, {0, 0, 2, 0}), 128, 128, family);
      FAIL() << "no error for an index out of range in the backward";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("opts.block_sparse.mask_block_idx"), std::string::npos) << e.what();
    }
    try {
      std::vector<int> cnt(5, 1), idx(25, 0);
      backward_with(int32_tensor({1, 1, 5}, cnt), int32_tensor({1, 1, 5, 5}, idx), 32, 32, family);
      FAIL() << "no error for 32 x 32 blocks in the backward";
    } catch (const Unsupported& e) {
      EXPECT_EQ(e.argument(), "opts.block_sparse") << e.what();
      EXPECT_NE(std::string(e.what()).find("a multiple of"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("block sizes 32 x 32"), std::string::npos) << e.what();
    }
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor got = c.out;
  out.download(got);
  EXPECT_EQ(got.count_nan(), got.numel()) << "out was written";
  for (auto [t, dev, name] : {std::tuple{&c.dq, &dq, "dq"}, std::tuple{&c.dk, &dk, "dk"}, std::tuple{&c.dv, &dv, "dv"}}) {
    HostTensor g = *t;
    dev->download(g);
    EXPECT_EQ(g.count_nan(), g.numel()) << name << " was written";
  }
}

// By default (the device check of eager calls) the same bad lists are not errors of the
// call: the call runs with each bad entry skipped, and check_errors() raises the first one,
// naming the list, the (b, h, m) row and the value, once; the forward's and the backward's
// table builds both check. Fresh random inputs; out, dq, dk, dv poisoned first.
TEST(CudaBlockSparseRule, EagerBadListsRaisedByCheckErrors) {
  FA_REQUIRE_GPU();
  const IndexCheckPathScope device(detail::cuda::IndexCheckPath::kDevice);
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, Shape{1, 130, 130, 2, 2, 64}, DType::kFloat16);
  c.poison_forward();
  c.poison_backward();
  DeviceCopy q(c.q), k(c.k), v(c.v), out(c.out), lse(c.lse), dout(c.dout), dq(c.dq), dk(c.dk), dv(c.dv);
  EXPECT_NO_THROW(check_errors(0)) << "an error left pending before this test";
  auto with_lists = [&](bool backward, const HostTensor& cnt, const HostTensor& idx) {
    DeviceCopy dcnt(cnt), didx(idx);
    Options o;
    o.block_sparse.mask_block_cnt = dcnt.view();
    o.block_sparse.mask_block_idx = didx.view();
    if (backward) {
      flashattn::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
                          dv.view(), o);
    } else {
      flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the lists are freed
  };
  // Two 128 x 128 query blocks over N = 2 key blocks (rows 0 and 1 of the table).
  struct Bad {
    std::vector<int> cnt, idx;
    const char* argument;
    std::string text;
  };
  const Bad bads[] = {
      {{1, 1}, {0, 0, 2, 0}, "opts.block_sparse.mask_block_idx", "expected values in [0, 1] (opts.block_sparse.mask_block_idx at (b, h, m) row 1, position 0), got 2"},
      {{2, 1}, {1, 1, 0, 0}, "opts.block_sparse.mask_block_idx", "got key block 1 listed again (opts.block_sparse.mask_block_idx at (b, h, m) row 0, position 1)"},
      {{1, 3}, {0, 0, 0, 1}, "opts.block_sparse.mask_block_cnt", "expected values in [0, 2] (opts.block_sparse.mask_block_cnt at (b, h, m) row 1), got 3"},
  };
  for (bool backward : {false, true}) {
    for (const Bad& bad : bads) {
      SCOPED_TRACE(std::string(backward ? "backward, " : "forward, ") + bad.text);
      EXPECT_NO_THROW(with_lists(backward, int32_tensor({1, 1, 2}, bad.cnt), int32_tensor({1, 1, 2, 2}, bad.idx)))
          << "the call raised its own bad list (the host check)";
      std::string what;
      try {
        check_errors(0);
      } catch (const InvalidArgument& e) {
        what = e.what();
        EXPECT_EQ(e.argument(), bad.argument) << what;
        EXPECT_EQ(e.function(), backward ? "backward" : "forward") << what;
      }
      EXPECT_NE(what.find(bad.text), std::string::npos) << (what.empty() ? "check_errors() raised nothing" : what);
      EXPECT_NO_THROW(check_errors(0)) << "raised once";
    }
  }
  // Valid lists: nothing to raise.
  EXPECT_NO_THROW(with_lists(false, int32_tensor({1, 1, 2}, {1, 2}), int32_tensor({1, 1, 2, 2}, {0, 0, 1, 0})));
  EXPECT_NO_THROW(check_errors(0));
  HostTensor got = c.out;
  out.download(got);
  EXPECT_EQ(got.count_nan(), 0) << "the valid call wrote out";
}

}  // namespace
}  // namespace flashattn::test
