// CUDA KV-cache decode path (issue 4) through the public API: randomized paged layouts
// (block sizes 1..256, shuffled and shared blocks, NaN-filled spare blocks and unused
// slots), dense caches with cache_batch_idx, append positions, split counts (1, the
// heuristic 0, and explicit ones beyond the number of key tiles), GQA ratios 1/4/8/32,
// s_q 1..40, causal / window / softcap / ALiBi, draft-tree masks (also at every head dim), fp8 e4m3 caches
// with per-head and per-(block, head) scales. Every case runs on the device and on the
// CPU backend (same call, host tensors; kvcache_runs.hpp: check_case): the caches after
// the append must be bitwise equal (fp8: the same e4m3 bytes), and the outputs are
// checked against the fp64 oracle under the suite's tolerance rule; outputs are
// NaN-poisoned before every call. Splits must agree with no split, a call captured in a
// CUDA graph (caller workspace) must replay to the same bits as the direct call, and the
// split merge must not depend on what the workspace held before.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/kvcache_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

// ---------------------------------------------------------------- randomized layouts

TEST(CudaKVCache, RandomPagedLayouts) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 36; ++it) {
    KVCacheConfig cfg;
    cfg.dtype = it % 2 ? DType::kBFloat16 : DType::kFloat16;
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.h_k = pick(rng, {1, 2});
    cfg.h_q = cfg.h_k * pick(rng, {1, 4, 8, 32});
    cfg.s_q = pick(rng, {1, 1, 2, 5, 13, 40});
    if (cfg.h_q / cfg.h_k == 32) cfg.s_q = std::min(cfg.s_q, 5);
    cfg.s_new = pick(rng, {0, 1, cfg.s_q});
    cfg.d = pick(rng, {64, 128, 40, 72});
    cfg.max_cache_len = pick(rng, {0, 37, 300, 1500});
    cfg.block_size = it % 6 == 5 ? 0 : pick(rng, {1, 3, 8, 16, 32, 64, 256});
    random_cache_layout(cfg, it % 3 == 0);
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = cfg.s_q > 1 && it % 4 != 1;
    if (it % 7 == 3) c.opts.window_left = uniform_int(rng, 0, 200);
    if (it % 5 == 2) c.opts.softcap = 3.0f;
    if (it % 6 == 4) c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, it % 12 == 4), it % 12 == 4);
    c.num_splits = pick(rng, {1, 0, 0, 3, 17});
    check_case(c);
  }
}

// ---------------------------------------------------------------- fp8 caches

TEST(CudaKVCache, Fp8Caches) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 12; ++it) {
    KVCacheConfig cfg;
    cfg.dtype = it % 2 ? DType::kBFloat16 : DType::kFloat16;
    cfg.fp8 = true;
    cfg.per_block_scales = (it / 2) % 2 == 1;
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.h_k = 2;
    cfg.h_q = cfg.h_k * pick(rng, {1, 4, 8});
    cfg.s_q = pick(rng, {1, 3, 9});
    cfg.s_new = pick(rng, {0, 1, cfg.s_q});
    cfg.d = pick(rng, {64, 128, 80});  // fp8 rows: 16-byte multiples
    cfg.max_cache_len = pick(rng, {50, 700});
    cfg.block_size = it % 3 == 2 ? 0 : pick(rng, {1, 16, 256});
    cfg.use_batch_idx = cfg.block_size == 0;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = cfg.s_q > 1;
    if (it % 4 == 3) c.opts.softcap = 5.0f;
    c.num_splits = pick(rng, {1, 0, 4});
    check_case(c);
  }
}

// ---------------------------------------------------------------- draft trees

TEST(CudaKVCache, TreeMasks) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 10; ++it) {
    KVCacheConfig cfg;
    cfg.dtype = it % 2 ? DType::kBFloat16 : DType::kFloat16;
    cfg.batch = uniform_int(rng, 1, 3);
    cfg.h_k = 2;
    cfg.h_q = cfg.h_k * pick(rng, {1, 4, 8});
    cfg.s_q = pick(rng, {1, 4, 33, 40});
    cfg.s_new = cfg.s_q;  // the drafts are appended by the call
    cfg.d = pick(rng, {64, 128});
    cfg.max_cache_len = pick(rng, {0, 200, 900});
    cfg.block_size = it % 3 == 0 ? 0 : pick(rng, {1, 16, 64});
    cfg.tree = it % 3 == 1 ? KVCacheConfig::Tree::kLinear : KVCacheConfig::Tree::kRandom;
    cfg.fp8 = it % 5 == 4;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = it % 2 == 0;
    c.num_splits = pick(rng, {1, 0, 5});
    check_case(c);
  }
}

// Draft trees at every head dim up to the largest bucket (512 included), 16-bit and fp8
// caches, under the process's kernel family and shared-memory cap (FLASHATTN_KERNEL_FAMILY
// / _SMEM_CAP): where no decode configuration fits (a 16-bit cache at d 160 .. 256 with
// FLASHATTN_SMEM_CAP=101376, as on a 99 KiB GPU) the case skips, saying why
// (test_cuda_smem_cap.cpp checks that error).
class CudaKVCacheTreeHeadDim : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(CudaKVCacheTreeHeadDim, MatchesOracle) {
  FA_REQUIRE_GPU();
  const auto [d, fp8] = GetParam();
  if (!detail::cuda::supports_wide_head_dim(d)) GTEST_SKIP() << "head dim " << d << " above this build's buckets";
  FA_SEEDED_RNG(rng);
  for (int it = 0; it < 2; ++it) {
    KVCacheConfig cfg;
    cfg.dtype = it ? DType::kBFloat16 : DType::kFloat16;
    cfg.fp8 = fp8;
    cfg.batch = 2;
    cfg.h_k = 2;
    cfg.h_q = cfg.h_k * (it ? 4 : 1);
    cfg.s_q = it ? 33 : 4;
    cfg.s_new = cfg.s_q;
    cfg.d = d;
    cfg.max_cache_len = 300;
    cfg.block_size = it ? 16 : 0;
    cfg.tree = it ? KVCacheConfig::Tree::kRandom : KVCacheConfig::Tree::kLinear;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    FA_SKIP_UNLESS_KVCACHE_FITS(d, fp8, true, c.opts);
    c.opts.causal = it == 0;
    c.num_splits = it ? 0 : 3;
    check_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaKVCacheTreeHeadDim,
                         ::testing::Combine(::testing::Values(32, 64, 96, 128, 160, 192, 224, 256, 320, 512),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& i) {
                           return "d" + std::to_string(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) ? "_fp8" : "_16bit");
                         });

// ---------------------------------------------------------------- splits

// Split counts from 1 to more than the key tiles (empty splits) agree with no split; at
// d = 40 (bucket 64, 128-key tiles) the combine's warp covers d with 10 lanes and the
// longer sequence's splits 10..19 are not empty: their merge weights come by shuffle from
// lanes without columns (wrong before the combine ran every lane through the loop).
TEST(CudaKVCache, SplitsAgreeWithNoSplit) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (const auto [dtype, d] : {std::pair{DType::kFloat16, 128}, std::pair{DType::kBFloat16, 128},
                                std::pair{DType::kBFloat16, 40}}) {
    SCOPED_TRACE("d " + std::to_string(d));
    KVCacheConfig cfg;
    cfg.dtype = dtype;
    cfg.batch = 2;
    cfg.h_q = 16;
    cfg.h_k = 4;
    cfg.s_q = 2;
    cfg.s_new = 1;
    cfg.d = d;
    cfg.cache_lens = {d == 40 ? 2500 : 1000, 333};
    cfg.block_size = 16;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = true;
    c.num_splits = 1;
    check_case(c);
    const ForwardResults base = forward_results(c);
    // sm90: up to 8 the cluster merge, 9 and 16 too where the device holds the clusters (8
    // units: 72 and 128 blocks), above 16 the workspace's.
    for (int splits : {2, 7, 8, 0, 9, 16, 17, 31, 64}) {
      c.num_splits = splits;
      check_case_agrees_with_no_split(c, base, false);
    }
  }
}

// ---------------------------------------------------------------- CUDA graphs

// One decode step of a GQA model: bf16, 3 sequences, 32 query heads over 8 KV heads,
// hdim 128, one new token appended.
KVCacheConfig decode_step_config() {
  KVCacheConfig cfg;
  cfg.dtype = DType::kBFloat16;
  cfg.batch = 3;
  cfg.h_q = 32;
  cfg.h_k = 8;
  cfg.s_q = 1;
  cfg.s_new = 1;
  cfg.d = 128;
  return cfg;
}

// A decode step with splits and a caller workspace, captured and replayed: the same bits
// as the direct call, and the workspace size does not depend on device memory.
TEST(CudaKVCache, GraphCaptureReplaysTheDirectCall) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  for (bool fp8 : {false, true}) {
    KVCacheConfig cfg = decode_step_config();
    cfg.max_cache_len = 2000;
    cfg.block_size = 16;
    cfg.fp8 = fp8;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.num_splits = 0;
    SCOPED_TRACE(describe_case(c));
    expect_replay_gives_direct_bits(c, ReplayCache::kK);
    expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
  }
}

// On Hopper a row chunk's 2..8 splits (9..16 where the device holds all the grid's clusters
// at once: detail::cuda::decode_clusters_fit) are one thread-block cluster and merge through
// each other's shared memory where every block of the grid can have an SM of its own: such
// a call needs no workspace, and gives the oracle's answer with one row chunk and with
// several (GQA rows over 16, causal); a grid larger than the SMs (9 splits of 16 units
// here) takes the workspace merge.
TEST(CudaKVCache, ClusterMergeNeedsNoWorkspace) {
  FA_REQUIRE_GPU();
  int dev = 0, major = 0, sms = 0;
  FA_CUDA_OK(cudaGetDevice(&dev));
  FA_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  FA_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (major < 9) GTEST_SKIP() << "thread-block clusters: compute capability 9.0 and newer";
  FA_SEEDED_RNG(rng);
  for (const int s_q : {1, 5}) {
    KVCacheConfig cfg = decode_step_config();  // 32 query heads over 8 KV heads
    cfg.s_q = s_q;
    cfg.s_new = s_q;
    cfg.batch = s_q == 1 ? 2 : 1;
    cfg.cache_lens = s_q == 1 ? std::vector<int>{1999, 64} : std::vector<int>{700};
    const int units = cfg.batch * cfg.h_k * ((s_q * 4 + 15) / 16);  // sequences x KV heads x row chunks
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = s_q > 1;
    for (const int splits : {2, 8, 9}) {
      c.num_splits = splits;
      SCOPED_TRACE(describe_case(c) + " splits " + std::to_string(splits));
      DeviceCase d(c);
      const std::size_t ws = kvcache_workspace_size(d.args, d.opts);
      const int rows = s_q * cfg.h_q / cfg.h_k;
      if (units * splits <= sms && detail::cuda::decode_clusters_fit(dev, cfg.d, true, false, rows, splits, units, 0)) {
        EXPECT_EQ(ws, 0u);
      } else {
        EXPECT_GT(ws, 0u);
      }
      check_case(c);
    }
  }
}

// ---------------------------------------------------------------- wide clusters

// On the H100 SXM / H200 (132 SMs, sm90) 16-block clusters of the decode kernel must fit
// (the plan would otherwise never take them there).
void expect_wide_clusters_on_h100(const KVCacheCase& c, int splits, int dev, int sms) {
  int major = 0, minor = 0;
  FA_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  FA_CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  const KVCacheConfig& f = c.cfg;
  const int units = f.batch * f.h_k * ((f.s_q * (f.h_q / f.h_k) + 15) / 16);
  if (major == 9 && minor == 0 && sms >= 132 && units * splits <= sms) {
    EXPECT_TRUE(takes_clusters(c, splits, dev, sms)) << splits << "-block clusters do not fit on this sm90 device";
  }
}

// Every cluster size 2..16 (Hopper's non-portable sizes above 8: merge_cluster_rows takes
// the splits' O in groups of 8) agrees with no split and gives the oracle's answer, with no
// workspace wherever the plan takes clusters: the decode step's shape at batch 1 (bf16, 32
// query heads over 8 KV heads: 8 clusters, 128 blocks at 16 splits) with an odd context, a
// learnable sink and lse; fp16 at d 64 (128-key tiles) with 2 row chunks per KV head (GQA
// 8, 3 queries, causal); an fp8 cache over two sequences of odd lengths, one so short that
// most splits see no key.
TEST(CudaKVCache, WideClusterSplitsAgreeWithNoSplit) {
  FA_REQUIRE_GPU();
  FA_REQUIRE_CLUSTERS(dev, sms);
  FA_SEEDED_RNG(rng);
  struct Shape {
    DType dtype;
    int h_q, h_k, s_q, d;
    std::vector<int> lens;
    bool fp8, sink;
  };
  const Shape shapes[] = {
      {DType::kBFloat16, 32, 8, 1, 128, {4001}, false, true},
      {DType::kFloat16, 16, 2, 3, 64, {1333}, false, false},
      {DType::kBFloat16, 8, 2, 1, 128, {2999, 77}, true, true},
  };
  for (const Shape& sh : shapes) {
    KVCacheConfig cfg;
    cfg.dtype = sh.dtype;
    cfg.batch = static_cast<int>(sh.lens.size());
    cfg.h_q = sh.h_q;
    cfg.h_k = sh.h_k;
    cfg.s_q = sh.s_q;
    cfg.s_new = sh.s_q;
    cfg.d = sh.d;
    cfg.fp8 = sh.fp8;
    cfg.cache_lens = sh.lens;
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.opts.causal = sh.s_q > 1;
    if (sh.sink) c.sink.set(random_sink(rng, sh.h_q));
    c.num_splits = 1;
    check_case(c);
    const ForwardResults base = forward_results(c);
    for (int splits = 2; splits <= 16; ++splits) {
      c.num_splits = splits;
      SCOPED_TRACE(describe_case(c));
      expect_workspace_follows_clusters(c, dev, sms);
      if (splits == 16) expect_wide_clusters_on_h100(c, splits, dev, sms);
      check_case_agrees_with_no_split(c, base);
    }
  }
}

// One decode step at 16 cluster splits (batch 1, bf16, 32 / 8 heads, a sink, lse): the
// oracle's answer and no split's, no workspace where the device holds 8 clusters of 16.
// Small enough for compute-sanitizer racecheck (scripts/decode_cl16_gpu.sh).
TEST(CudaKVCache, Cluster16Step) {
  FA_REQUIRE_GPU();
  FA_REQUIRE_CLUSTERS(dev, sms);
  FA_SEEDED_RNG(rng);
  KVCacheConfig cfg = decode_step_config();
  cfg.batch = 1;
  cfg.cache_lens = {1499};
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.sink.set(random_sink(rng, cfg.h_q));
  c.num_splits = 1;
  check_case(c);
  const ForwardResults base = forward_results(c);
  c.num_splits = 16;
  SCOPED_TRACE(describe_case(c));
  expect_workspace_follows_clusters(c, dev, sms);
  expect_wide_clusters_on_h100(c, 16, dev, sms);
  check_case_agrees_with_no_split(c, base, false);
}

// CUDA graph capture of wide-cluster decode steps. (1) The heuristic at batch 1 and an
// 8k context (32 / 8 heads, bf16) plans 16 cluster splits where the device holds them (no
// workspace; else the workspace merge), captured and replayed to the direct call's bits.
// (2) A call whose first plan, and so the device's first cluster-occupancy query for its
// kernel and size (fp16, 16 GQA rows: the 16-row kernel, 12 splits), happens while the
// stream is being captured (kvcache_workspace_size under capture, then the call): the
// capture stays valid, and the replay gives the direct call's bits and the oracle's answer.
TEST(CudaKVCache, WideClusterGraphCapture) {
  FA_REQUIRE_GPU();
  FA_REQUIRE_CLUSTERS(dev, sms);
  FA_SEEDED_RNG(rng);
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    KVCacheConfig cfg = decode_step_config();
    cfg.batch = 1;
    cfg.cache_lens = {8191};
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.num_splits = 0;
    SCOPED_TRACE(describe_case(c));
    DeviceCase d(c);
    const std::size_t ws_bytes = kvcache_workspace_size(d.args, d.opts);
    if (sms >= 128 && takes_clusters(c, 16, dev, sms)) EXPECT_EQ(ws_bytes, 0u) << "the heuristic's 16 cluster splits";
    expect_replay_gives_direct_bits(c, d, ws_bytes, ReplayCache::kNone, nullptr, s);
    expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
  }
  {
    KVCacheConfig cfg;
    cfg.dtype = DType::kFloat16;
    cfg.batch = 1;
    cfg.h_q = 32;
    cfg.h_k = 2;
    cfg.s_q = 1;
    cfg.s_new = 1;
    cfg.d = 128;
    cfg.cache_lens = {2345};
    KVCacheCase c = KVCacheCase::make(rng, cfg);
    c.num_splits = 12;
    SCOPED_TRACE(describe_case(c));
    DeviceCase d(c);
    // A workspace ahead of the capture, larger than the plan can ask (12 splits' fp32
    // partials of 32 rows and their counters), without asking the plan.
    const std::size_t ws_bytes = std::size_t(1) << 20;
    void* ws = nullptr;
    FA_CUDA_OK(cudaMalloc(&ws, ws_bytes));
    Options opts = d.opts;
    opts.stream = s;
    d.reset(c);
    FA_CUDA_OK(cudaDeviceSynchronize());
    cudaGraph_t graph = nullptr;
    FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    std::size_t ws_captured = 0;
    EXPECT_NO_THROW(ws_captured = kvcache_workspace_size(d.args, opts));
    EXPECT_NO_THROW(kvcache_forward(d.args, d.out->view(), d.lse->view(), opts, {ws, ws_bytes}));
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FA_CUDA_OK(cudaStreamIsCapturing(s, &status));
    EXPECT_EQ(status, cudaStreamCaptureStatusActive) << "the capture was invalidated";
    FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
    EXPECT_LE(ws_captured, ws_bytes);
    EXPECT_EQ(ws_captured == 0, takes_clusters(c, 12, dev, sms)) << "workspace " << ws_captured;
    cudaGraphExec_t exec;
    FA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    FA_CUDA_OK(cudaGraphLaunch(exec, s));
    FA_CUDA_OK(cudaStreamSynchronize(s));
    HostTensor out_graph = c.out, lse_graph = c.lse;
    d.out->download(out_graph);
    d.lse->download(lse_graph);
    d.reset(c);
    FA_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_NO_THROW(kvcache_forward(d.args, d.out->view(), d.lse->view(), opts, {ws, ws_bytes}));
    FA_CUDA_OK(cudaStreamSynchronize(s));
    HostTensor out_direct = c.out, lse_direct = c.lse;
    d.out->download(out_direct);
    d.lse->download(lse_direct);
    EXPECT_TRUE(out_graph.bitwise_equal(out_direct)) << "out: graph replay vs direct call";
    EXPECT_TRUE(lse_graph.bitwise_equal(lse_direct)) << "lse: graph replay vs direct call";
    c.out = out_graph;
    c.lse = lse_graph;
    expect_forward_matches(c.problem(), c.cfg.dtype, forward_results(c));
    FA_CUDA_OK(cudaGraphExecDestroy(exec));
    FA_CUDA_OK(cudaGraphDestroy(graph));
    cudaFree(ws);
  }
  cudaStreamDestroy(s);
}

// The split merge counts the splits' arrivals in the caller's workspace (decode_launch.hpp:
// tag and count words, no zeroing asked of the caller). Whatever the workspace held
// before (random bytes, all ones, another call's partials and words), and over replays of
// one captured call with another call between them on the same workspace, a call gives
// the same bits as on a zeroed workspace.
TEST(CudaKVCache, SplitMergeIgnoresWhatTheWorkspaceHeld) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  KVCacheConfig fa = decode_step_config();
  fa.cache_lens = {2999, 1500, 1};
  KVCacheCase a = KVCacheCase::make(rng, fa);
  a.num_splits = 11;  // 24 units x 11 splits: more blocks than SMs, the workspace merge on sm90 too
  KVCacheConfig fb = fa;  // another shape over the same workspace: 2 row chunks per KV head
  fb.dtype = DType::kFloat16;
  fb.batch = 2;
  fb.h_q = 16;
  fb.h_k = 2;
  fb.s_q = 3;
  fb.cache_lens = {2000, 777};
  fb.block_size = 16;
  KVCacheCase bc = KVCacheCase::make(rng, fb);
  bc.num_splits = 17;  // above kMaxClusterSplits (16): the workspace merge on sm90 too
  SCOPED_TRACE(describe_case(a) + " / " + describe_case(bc));
  DeviceCase da(a), db(bc);
  const std::size_t wa = kvcache_workspace_size(da.args, da.opts), wb = kvcache_workspace_size(db.args, db.opts);
  ASSERT_GT(wa, 0u);
  ASSERT_GT(wb, 0u);
  const std::size_t ws_bytes = std::max(wa, wb);
  void* ws = nullptr;
  FA_CUDA_OK(cudaMalloc(&ws, ws_bytes));
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Options oa = da.opts, ob = db.opts;
  oa.stream = ob.stream = s;
  auto run_a = [&] {
    da.reset(a);
    FA_CUDA_OK(cudaDeviceSynchronize());  // the uploads (default stream) before s uses them
    EXPECT_NO_THROW(kvcache_forward(da.args, da.out->view(), da.lse->view(), oa, {ws, ws_bytes}));
  };
  auto run_b = [&] {
    db.reset(bc);
    FA_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_NO_THROW(kvcache_forward(db.args, db.out->view(), db.lse->view(), ob, {ws, ws_bytes}));
  };
  HostTensor out_a = a.out, lse_a = a.lse;
  auto expect_as_ref = [&](const char* what) {
    FA_CUDA_OK(cudaStreamSynchronize(s));
    HostTensor o = a.out, l = a.lse;
    da.out->download(o);
    da.lse->download(l);
    EXPECT_TRUE(o.bitwise_equal(out_a)) << "out: " << what;
    EXPECT_TRUE(l.bitwise_equal(lse_a)) << "lse: " << what;
  };

  FA_CUDA_OK(cudaMemsetAsync(ws, 0, ws_bytes, s));
  run_a();
  FA_CUDA_OK(cudaStreamSynchronize(s));
  da.out->download(out_a);
  da.lse->download(lse_a);
  a.out = out_a;
  a.lse = lse_a;
  expect_forward_matches(a.problem(), a.cfg.dtype, forward_results(a));

  std::vector<unsigned char> noise(ws_bytes);
  for (auto& x : noise) x = static_cast<unsigned char>(uniform_int(rng, 0, 255));
  FA_CUDA_OK(cudaMemcpy(ws, noise.data(), ws_bytes, cudaMemcpyHostToDevice));
  run_a();
  expect_as_ref("workspace of random bytes");
  FA_CUDA_OK(cudaMemsetAsync(ws, 0xff, ws_bytes, s));
  run_a();
  expect_as_ref("workspace of 0xff bytes");
  run_a();
  expect_as_ref("second call on the same workspace");
  run_b();
  run_a();
  expect_as_ref("after another call on the workspace");

  cudaGraph_t graph;
  FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  EXPECT_NO_THROW(kvcache_forward(da.args, da.out->view(), da.lse->view(), oa, {ws, ws_bytes}));
  FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  FA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 4; ++replay) {
    if (replay == 2) run_b();  // another call's words between two replays
    if (replay == 3) FA_CUDA_OK(cudaMemcpy(ws, noise.data(), ws_bytes, cudaMemcpyHostToDevice));
    da.reset(a);
    FA_CUDA_OK(cudaDeviceSynchronize());
    FA_CUDA_OK(cudaGraphLaunch(exec, s));
    expect_as_ref(("graph replay " + std::to_string(replay)).c_str());
  }
  // b's own result, from the last call of it above.
  FA_CUDA_OK(cudaStreamSynchronize(s));
  db.out->download(bc.out);
  db.lse->download(bc.lse);
  expect_forward_matches(bc.problem(), bc.cfg.dtype, forward_results(bc));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  cudaFree(ws);
}

}  // namespace
}  // namespace flashattn::test
