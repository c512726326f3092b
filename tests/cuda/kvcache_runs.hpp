// What the CUDA KV-cache suites share (test_cuda_kvcache.cpp, test_cuda_smem_cap.cpp,
// test_cuda_kvcache_fp8q.cpp, test_cuda_kvcache_512.cpp, test_cuda_kvcache_head_dim_v.cpp,
// test_cuda_mla.cpp):
// the device copies of a KV-cache case (DeviceCase), its description, and check_case,
// which runs a case on the device and on the CPU backend and checks the appended caches
// bitwise and the device output against the fp64 oracle; the check that a call captured
// in a CUDA graph replays to the direct call's bits (expect_replay_gives_direct_bits);
// whether a forced split count takes the cluster merge (takes_clusters) and the workspace
// that says so (expect_workspace_follows_clusters); a split run against no split's
// (check_case_agrees_with_no_split); the shared memory per block that this process's
// CUDA calls may use (smem_limit_of), for skipping what a capped run (FLASHATTN_SMEM_CAP,
// a 99 KiB GPU) cannot do; a 99 KiB GPU's options on this one (cap_99k) and the 99 KiB
// suites' random cases, same-bits and workspace checks (check_random_case_at_99k,
// check_capped_gives_default_bits, check_capped_workspace_and_replay).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "core/kernel_family.hpp"
#include "cuda/device_copy.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/compare.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {

// The random suites' cache layout, from cfg.block_size (set before): paged, with sequence
// 1 sharing sequence 0's prefix blocks when `share`; or dense through cache_batch_idx over
// batch + 2 cache rows, each 9 rows longer than the longest sequence needs (cache rows
// that no sequence uses, and keys past every sequence's end).
inline void random_cache_layout(KVCacheConfig& cfg, bool share) {
  const bool dense = cfg.block_size == 0;
  cfg.share_blocks = !dense && share;
  cfg.use_batch_idx = dense;
  cfg.cache_rows = dense ? cfg.batch + 2 : 0;
  cfg.s_cache = dense ? cfg.max_cache_len + cfg.s_new + 9 : 0;
}

// All device buffers of one KV-cache case and the API arguments over them.
struct DeviceCase {
  std::unique_ptr<DeviceCopy> q, kc, vc, lens, table, idx, kn, vn, out, lse, ks, vs, tree, alibi, sink, qv;
  std::unique_ptr<DeviceCopy> q_descale, k_descale, v_descale;  // cfg.fp8_q
  KVCacheArgs args;
  Options opts;

  explicit DeviceCase(const KVCacheCase& c) {
    q = std::make_unique<DeviceCopy>(c.q);
    kc = std::make_unique<DeviceCopy>(c.k_cache);
    vc = std::make_unique<DeviceCopy>(c.v_cache);
    lens = std::make_unique<DeviceCopy>(c.cache_lens_t);
    table = std::make_unique<DeviceCopy>(c.block_table_t);
    idx = std::make_unique<DeviceCopy>(c.batch_idx_t);
    kn = std::make_unique<DeviceCopy>(c.k_new);
    vn = std::make_unique<DeviceCopy>(c.v_new);
    out = std::make_unique<DeviceCopy>(c.out);
    lse = std::make_unique<DeviceCopy>(c.lse);
    args = c.args();
    args.q = q->view();
    args.k_cache = kc->view();
    args.v_cache = vc->view();
    args.cache_seqlens = lens->view();
    if (args.block_table.defined()) args.block_table = table->view();
    if (args.cache_batch_idx.defined()) args.cache_batch_idx = idx->view();
    if (args.k_new.defined()) {
      args.k_new = kn->view();
      args.v_new = vn->view();
    }
    if (c.cfg.fp8) {
      ks = std::make_unique<DeviceCopy>(c.k_scale);
      vs = std::make_unique<DeviceCopy>(c.v_scale);
      args.k_scale = ks->view();
      args.v_scale = vs->view();
    }
    if (args.tree_mask.defined()) {
      tree = std::make_unique<DeviceCopy>(c.tree_mask);
      Tensor t = args.tree_mask;
      t.data = tree->data();
      t.device = Device::cuda(0);
      args.tree_mask = t;
    }
    opts = c.call_options();
    if (!c.alibi.empty()) {
      alibi = std::make_unique<DeviceCopy>(c.alibi_tensor);
      opts.alibi_slopes = alibi->view();
    }
    if (c.cfg.fp8_q) {  // FlashAttention-3's descales [b, h_k], contiguous
      q_descale = std::make_unique<DeviceCopy>(c.q_descale);
      k_descale = std::make_unique<DeviceCopy>(c.k_descale);
      v_descale = std::make_unique<DeviceCopy>(c.v_descale);
      opts.q_descale = q_descale->view();
      opts.k_descale = k_descale->view();
      opts.v_descale = v_descale->view();
    }
    opts.learnable_sink_grad = Tensor{};  // a forward: no gradient
    if (!c.sink.logits.empty()) {
      sink = std::make_unique<DeviceCopy>(c.sink.tensor);
      opts.learnable_sink = sink->view();
    }
    if (c.cfg.qv) {
      qv = std::make_unique<DeviceCopy>(c.qv);
      opts.qv = qv->view();
    }
  }
  // Restores the caches (before the append) and poisons out / lse on the device.
  void reset(const KVCacheCase& c) {
    kc->upload(c.k_cache);
    vc->upload(c.v_cache);
    HostTensor o = c.out, l = c.lse;
    o.fill_nan();
    l.fill_nan();
    out->upload(o);
    lse->upload(l);
  }
};

// dev's call captured on stream s into a CUDA graph (the workspace size asked for under
// capture must be ws_bytes, the size asked for eagerly) and replayed once; out and lse of
// the replay downloaded into out / lse.
inline void capture_and_replay(DeviceCase& dev, const Options& opts, void* ws, std::size_t ws_bytes,
                               cudaStream_t s, HostTensor& out, HostTensor& lse) {
  cudaGraph_t graph;
  FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  EXPECT_EQ(kvcache_workspace_size(dev.args, opts), ws_bytes);
  EXPECT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {ws, ws_bytes}));
  FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  FA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  FA_CUDA_OK(cudaGraphLaunch(exec, s));
  FA_CUDA_OK(cudaStreamSynchronize(s));
  dev.out->download(out);
  dev.lse->download(lse);
  FA_CUDA_OK(cudaGraphExecDestroy(exec));
  FA_CUDA_OK(cudaGraphDestroy(graph));
}

// The cache that expect_replay_gives_direct_bits also compares (none, k_cache, v_cache),
// and its contents after the direct call's append and after the replay's.
enum class ReplayCache { kNone, kK, kV };
struct ReplayedCache {
  HostTensor direct, graph;
};

// dev's call (c's case) on a non-blocking stream (`stream`, else one of its own) with a
// caller workspace of ws_bytes (kvcache_workspace_size's answer, asked by the caller),
// first directly, then captured into a CUDA graph and replayed once (capture_and_replay),
// each after dev.reset(c) and a device synchronisation (the uploads run on the default
// stream): the replay's out and lse must be the direct call's bits, and so `cache` after
// the append where one is named (its two copies then in *cached, for more checks). Leaves
// the replay's out / lse in c.out / c.lse for the oracle check that follows. A fatal
// failure (the direct call throwing, a CUDA error) ends the check there.
inline void expect_replay_gives_direct_bits(KVCacheCase& c, DeviceCase& dev, std::size_t ws_bytes,
                                            ReplayCache cache = ReplayCache::kNone, ReplayedCache* cached = nullptr,
                                            cudaStream_t stream = nullptr) {
  struct Owned {  // freed on every way out
    void* ws = nullptr;
    cudaStream_t s = nullptr;
    ~Owned() {
      if (s) cudaStreamDestroy(s);
      if (ws) cudaFree(ws);
    }
  } own;
  if (ws_bytes) FA_CUDA_OK(cudaMalloc(&own.ws, ws_bytes));
  if (stream == nullptr) {
    FA_CUDA_OK(cudaStreamCreateWithFlags(&own.s, cudaStreamNonBlocking));
    stream = own.s;
  }
  Options opts = dev.opts;
  opts.stream = stream;
  const DeviceCopy* cache_dev =
      cache == ReplayCache::kK ? dev.kc.get() : cache == ReplayCache::kV ? dev.vc.get() : nullptr;
  const HostTensor& cache_host = cache == ReplayCache::kV ? c.v_cache : c.k_cache;
  const char* cache_name = cache == ReplayCache::kV ? "v_cache" : "k_cache";

  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {own.ws, ws_bytes}));
  FA_CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor out_direct = c.out, lse_direct = c.lse, cache_direct = cache_host;
  dev.out->download(out_direct);
  dev.lse->download(lse_direct);
  if (cache_dev) cache_dev->download(cache_direct);

  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor out_graph = c.out, lse_graph = c.lse, cache_graph = cache_host;
  capture_and_replay(dev, opts, own.ws, ws_bytes, stream, out_graph, lse_graph);
  if (cache_dev) cache_dev->download(cache_graph);
  EXPECT_TRUE(out_graph.bitwise_equal(out_direct)) << "out: graph replay vs direct call";
  EXPECT_TRUE(lse_graph.bitwise_equal(lse_direct)) << "lse: graph replay vs direct call";
  if (cache_dev) EXPECT_TRUE(cache_graph.bitwise_equal(cache_direct)) << cache_name << ": graph replay vs direct call";
  c.out = out_graph;
  c.lse = lse_graph;
  if (cached) *cached = ReplayedCache{cache_direct, cache_graph};
}

// The same over c's own device copies, with the workspace kvcache_workspace_size asks for.
inline void expect_replay_gives_direct_bits(KVCacheCase& c, ReplayCache cache = ReplayCache::kNone,
                                            ReplayedCache* cached = nullptr) {
  DeviceCase dev(c);
  expect_replay_gives_direct_bits(c, dev, kvcache_workspace_size(dev.args, dev.opts), cache, cached);
}

// A call both entry points decline: kvcache_workspace_size and kvcache_forward raise
// Unsupported (checked by `check`), and neither the caches (appends) nor out (poisoned by
// dev.reset) are written. `accepted` says what was accepted, for the failure message.
template <class Check>
void expect_declined(const KVCacheCase& c, DeviceCase& dev, Check&& check, const std::string& accepted) {
  try {
    kvcache_workspace_size(dev.args, dev.opts);
    ADD_FAILURE() << "kvcache_workspace_size accepted " << accepted;
  } catch (const Unsupported& e) {
    check(e);
  }
  try {
    kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), dev.opts);
    ADD_FAILURE() << "kvcache_forward accepted " << accepted;
  } catch (const Unsupported& e) {
    check(e);
  }
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor k_after = c.k_cache, v_after = c.v_cache, out = c.out;
  dev.kc->download(k_after);
  dev.vc->download(v_after);
  dev.out->download(out);
  EXPECT_TRUE(k_after.bitwise_equal(c.k_cache)) << "k_cache appended to by a declined call";
  EXPECT_TRUE(v_after.bitwise_equal(c.v_cache)) << "v_cache appended to by a declined call";
  EXPECT_EQ(out.count_nan(), out.numel()) << "out written by a declined call";
}

// The same for c's call as it is: its device copies made, reset (out poisoned) and
// synchronised here.
template <class Check>
void expect_declined(const KVCacheCase& c, Check&& check, const std::string& accepted) {
  DeviceCase dev(c);
  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  expect_declined(c, dev, std::forward<Check>(check), accepted);
}

inline std::string describe_case(const KVCacheCase& c) {
  const KVCacheConfig& f = c.cfg;
  return std::string(dtype_name(f.dtype)) + " b " + std::to_string(f.batch) + " s_q " +
         std::to_string(f.s_q) + " s_new " + std::to_string(f.s_new) + " h " + std::to_string(f.h_q) +
         "/" + std::to_string(f.h_k) + " d " + std::to_string(f.d) +
         (f.dv() != f.d ? " d_v " + std::to_string(f.dv()) : "") + " block_size " +
         std::to_string(f.block_size) + (f.fp8 ? (f.per_block_scales ? " fp8/block" : " fp8/head") : "") +
         (f.fp8_q ? " fp8 q (descales [b, h_k])" : "") +
         (f.tree != KVCacheConfig::Tree::kNone ? " tree" : "") + (c.sink.logits.empty() ? "" : " sink") +
         (f.qv ? " qv" : "") +
         " splits " + std::to_string(c.num_splits) +
         " " + describe(c.call_options());
}

// c's out and lse (a device call's, downloaded into c) fully written (no NaN of the
// poisoning left) and against the fp64 oracle of prob (c.problem()) under the suite's
// tolerance rule (expect_forward_matches; `expect`, where given, is prob's).
inline void expect_written_and_matching(const KVCacheCase& c, const RefProblem& prob,
                                        const ForwardExpectation* expect = nullptr) {
  const ForwardResults got = forward_results(c);
  EXPECT_TRUE(fully_written("out", got.out));
  EXPECT_TRUE(fully_written("lse", got.lse));
  expect_forward_matches(prob, c.cfg.dtype, got, expect);
}

// Runs c on the device (num_splits = c.num_splits) and on the CPU backend; checks the
// appended caches bitwise and the device output against the oracle. Leaves the device
// results in c.out / c.lse.
inline void check_case(KVCacheCase& c) {
  SCOPED_TRACE(describe_case(c));
  DeviceCase dev(c);
  dev.reset(c);
  ASSERT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), dev.opts));
  FA_CUDA_OK(cudaDeviceSynchronize());

  // The CPU backend: the same call on host tensors.
  KVCacheCase cpu = c;
  cpu.poison_outputs();
  ASSERT_NO_THROW(cpu.run());
  EXPECT_TRUE(cpu.k_cache.bitwise_equal(c.k_cache_expected)) << "CPU k_cache after the append";

  HostTensor k_after = c.k_cache, v_after = c.v_cache;
  dev.kc->download(k_after);
  dev.vc->download(v_after);
  EXPECT_TRUE(k_after.bitwise_equal(cpu.k_cache)) << "k_cache after the append (device vs CPU)";
  EXPECT_TRUE(v_after.bitwise_equal(cpu.v_cache)) << "v_cache after the append (device vs CPU)";
  dev.out->download(c.out);
  dev.lse->download(c.lse);
  const RefProblem prob = c.problem();
  const ForwardExpectation expect = ForwardExpectation::of(prob, c.cfg.dtype);
  expect_written_and_matching(c, prob, &expect);
  // The CPU backend's own result under the same rule (the two backends agree through it).
  expect_forward_matches(prob, c.cfg.dtype, forward_results(cpu), &expect);
}

// sm90 and newer, else skips; the device's index and SM count.
#define FA_REQUIRE_CLUSTERS(dev, sms)                                                                \
  int dev = 0, sms = 0;                                                                             \
  do {                                                                                              \
    int major_ = 0;                                                                                 \
    FA_CUDA_OK(cudaGetDevice(&dev));                                                                \
    FA_CUDA_OK(cudaDeviceGetAttribute(&major_, cudaDevAttrComputeCapabilityMajor, dev));            \
    FA_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));                  \
    if (major_ < 9) GTEST_SKIP() << "thread-block clusters: compute capability 9.0 and newer";      \
  } while (0)

// Whether c's call with `splits` forced takes the cluster merge (plan_decode's rule: a
// block per SM, and the device holding all units clusters of that size at once) on device
// `dev` with `sms` SMs, the decode configuration chosen within smem_limit (0: no cap).
inline bool takes_clusters(const KVCacheCase& c, int splits, int dev, int sms, int smem_limit = 0) {
  const KVCacheConfig& f = c.cfg;
  const int rows = f.s_q * (f.h_q / f.h_k);
  const int units = f.batch * f.h_k * ((rows + 15) / 16);
  return units * splits <= sms && detail::cuda::decode_clusters_fit(dev, f.d, f.dtype == DType::kBFloat16, f.fp8,
                                                                    rows, splits, units, smem_limit);
}

// c's call at its split count asks for a workspace of at most no_merge_bytes (none, or
// the append check's verdict where the call appends to blocks) exactly where the plan
// takes the cluster merge (takes_clusters, within smem_limit) on device `dev` with `sms` SMs.
inline void expect_workspace_follows_clusters(const KVCacheCase& c, int dev, int sms, std::size_t no_merge_bytes = 0,
                                              int smem_limit = 0) {
  DeviceCase d(c);
  const std::size_t ws = kvcache_workspace_size(d.args, d.opts);
  EXPECT_EQ(ws <= no_merge_bytes, takes_clusters(c, c.num_splits, dev, sms, smem_limit)) << "workspace " << ws;
}

// Runs c at its split count (check_case) and checks its out against no split's (base: c
// run with num_splits 1) within 4 eps of c's dtype times max(1, max |out|), and, where
// `lse`, its lse within 1e-4 times max(1, max |lse|).
inline void check_case_agrees_with_no_split(KVCacheCase& c, const ForwardResults& base, bool lse = true) {
  check_case(c);
  const ForwardResults r = forward_results(c);
  const ErrorStats e = error_stats(r.out, base.out);
  EXPECT_LE(e.max_abs_err, 4 * dtype_epsilon(c.cfg.dtype) * std::max(1.0, e.max_abs_ref))
      << "splits " << c.num_splits << " vs no split";
  if (!lse) return;
  const ErrorStats el = error_stats(r.lse, base.lse);
  EXPECT_LE(el.max_abs_err, 1e-4 * std::max(1.0, el.max_abs_ref)) << "lse, splits " << c.num_splits << " vs no split";
}

inline int pick(Rng& rng, std::initializer_list<int> v) {
  return *(v.begin() + uniform_int(rng, 0, static_cast<int>(v.size()) - 1));
}

// The shared memory per block a CUDA call with options o may use on device 0: the
// device's opt-in limit, capped by o.smem_cap or, where that is 0, FLASHATTN_SMEM_CAP
// (what the dispatch resolves; core/kernel_family.hpp).
inline int smem_limit_of(const Options& o) {
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) != cudaSuccess) {
    cudaGetLastError();
    optin = 0;
  }
  int cap = o.smem_cap;
  if (cap == 0) {
    const detail::KernelEnv& env = detail::kernel_env();
    if (env.smem_cap.ok) cap = env.request.smem_cap;
  }
  return cap > 0 && (optin == 0 || cap < optin) ? cap : optin;
}

constexpr int kCap99KiB = 101376;  // sm86 / sm89: 99 KiB per block

// The options of a 99 KiB GPU's run on this one (opts.smem_cap, the sm80 family forced).
inline void cap_99k(Options& o) {
  o.smem_cap = kCap99KiB;
  o.kernel_family = KernelFamily::kSm80;
}

// Case `it` of the random 99 KiB suites (test_cuda_smem_cap.cpp, test_cuda_kvcache_512.cpp)
// from cfg, whose shape the caller drew: paged (sharing prefix blocks at it % 4 == 1) or
// dense (random_cache_layout), causal where s_q > 1 but at it % 4 == 1, a random window
// (it % 5 == 3), softcap 4 (it % 5 == 2), ALiBi (it % 6 == 4), a learnable sink (it % 4 ==
// 3), a split count drawn from {1, 0, 0, 3, 17}; run under cap_99k through check_case.
inline void check_random_case_at_99k(Rng& rng, KVCacheConfig& cfg, int it) {
  random_cache_layout(cfg, it % 4 == 1);
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = cfg.s_q > 1 && it % 4 != 1;
  if (it % 5 == 3) c.opts.window_left = uniform_int(rng, 0, 200);
  if (it % 5 == 2) c.opts.softcap = 4.0f;
  if (it % 6 == 4) c.set_alibi(random_alibi(rng, cfg.batch, cfg.h_q, false), false);
  if (it % 4 == 3) {
    c.sink.want_grad = false;
    c.sink.set(random_sink(rng, cfg.h_q));
  }
  c.num_splits = pick(rng, {1, 0, 0, 3, 17});
  cap_99k(c.opts);
  check_case(c);
}

// The 99 KiB suites' same-bits check: c's call (sm80) with the device's whole shared
// memory per block (optin, whatever FLASHATTN_SMEM_CAP says) and again under cap_99k, each
// through check_case; the capped call's out and lse must be the default's bits.
inline void check_capped_gives_default_bits(KVCacheCase& c, int optin) {
  c.opts.kernel_family = KernelFamily::kSm80;
  c.opts.smem_cap = optin;
  check_case(c);
  const HostTensor out_default = c.out, lse_default = c.lse;
  cap_99k(c.opts);
  check_case(c);
  EXPECT_TRUE(c.out.bitwise_equal(out_default)) << "out: small configuration vs default";
  EXPECT_TRUE(c.lse.bitwise_equal(lse_default)) << "lse: small configuration vs default";
}

// The 99 KiB suites' workspace and graph check: cfg's case, causal, at `splits` under
// cap_99k; expect_workspace(bytes) on the workspace kvcache_workspace_size asks for, then
// expect_replay_gives_direct_bits with it, the replay's out and lse fully written and
// against the oracle.
template <class ExpectWorkspace>
void check_capped_workspace_and_replay(Rng& rng, const KVCacheConfig& cfg, int splits,
                                       ExpectWorkspace&& expect_workspace) {
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.opts.causal = true;
  c.num_splits = splits;
  cap_99k(c.opts);
  SCOPED_TRACE(describe_case(c));
  DeviceCase dev(c);
  const std::size_t ws_bytes = kvcache_workspace_size(dev.args, dev.opts);
  expect_workspace(ws_bytes);
  expect_replay_gives_direct_bits(c, dev, ws_bytes);
  expect_written_and_matching(c, c.problem());
}

// Skips the current test where a KV-cache call of head dim d (fp8 cache, tree mask) cannot
// run within the shared memory the process's calls may use (a tree mask over a 16-bit
// cache at d >= 160 on a 99 KiB GPU or under FLASHATTN_SMEM_CAP=101376), saying why.
#define FA_SKIP_UNLESS_KVCACHE_FITS(d, fp8, tree, opts)                                                     \
  do {                                                                                                     \
    const int fa_limit_ = smem_limit_of(opts);                                                             \
    if (!detail::cuda::kvcache_fits((d), (fp8), (tree), fa_limit_))                                       \
      GTEST_SKIP() << "a KV-cache call of head dim " << (d) << ((fp8) ? " (fp8 cache)" : " (16-bit cache)") \
                   << ((tree) ? " with a tree mask" : "") << " needs more than " << fa_limit_              \
                   << " bytes of shared memory per block (FLASHATTN_SMEM_CAP or the device's limit)";    \
  } while (0)

}  // namespace flashattn::test
