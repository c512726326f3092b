// Decode throughput of the CUDA KV-cache path (issue 4): bf16, batch 8, 32 query heads
// over 8 KV heads, hdim 128 (BENCH_HEAD_DIM), one query token, contexts 4k / 32k / 128k; dense, paged
// (block sizes 16 and 256, shuffled block tables) and an fp8 e4m3 cache (per-head scales);
// then one 200k-token sequence: prefill through kvcache_forward (the whole sequence
// appended into an empty cache, causal) and a decode step at 200k keys (time, memory).
//
// Each call goes through the public API with num_splits = 0 (heuristic) and a caller
// workspace, captured once per cache into a CUDA graph (as a serving loop runs it); a
// timing is CUDA events around 8 back-to-back launches rotating over several caches
// (>= 512 MiB of KV in all, so L2 does not hold one call's keys for the next), per call,
// median of 15 such repeats after a warm-up of at least 50 ms. Bandwidth counts the KV bytes stored and read:
// b * s * h_k * d * 2 (K and V) * element size. Each configuration is also timed as a
// streaming read of the same K / V buffers by a kernel that computes nothing
// (stream_read.cu): the practical bound of a decode step, reported beside it.
//
//   flashattn_cuda_decode_bench [csv path|-]
// Environment: BENCH_ONLY ("grid": the grid without the long context; a configuration
// name, or a comma list of names / name:context run in that order, e.g.
// "paged16:4096,dense:4096"), BENCH_SPLITS (num_splits for every call; default 0),
// BENCH_BATCH (sequences per call, default 8; 64 with BENCH_MLA), BENCH_HEAD_DIM (the head
// dim of every mode but BENCH_MLA, default 128; e.g. 512), BENCH_MLA=1 (instead of the
// grid: MLA decode with qv, DeepSeek-V3's shape, run_mla), BENCH_SWEEP=1 (instead of the grid: dense
// bf16 decode at batch 1 / 8 / 64 x contexts 1k .. 128k; BENCH_SWEEP_BATCHES, a comma list,
// narrows the batches, BENCH_SWEEP_CONTEXTS the contexts; BENCH_SWEEP_SPLITS, a comma list of
// num_splits, times each point at each count in BENCH_SWEEP_ROUNDS alternating rounds, e.g.
// "0,32,8,16": the heuristic, 32 workspace splits (above 16 never a cluster), 8 and 16
// cluster splits where the plan allows them), BENCH_SPEC=1 (instead of the grid: speculative decoding, 1 / 4 / 8
// drafts in one causal call, chain and tree, dense bf16 4k / 32k), BENCH_SINK=1 (a learnable sink of 0.5 per query head on every decode call: the cost of
// the sink's epilogue / merge terms against the same grid without one).
//
// BENCH_VERIFY=1: instead, the split path against one split on random data (batch 1 and
// 8, contexts 1000 and 4096, eager and replayed from a graph, the workspace filled with 0x3c
// bytes so that counters left unzeroed show): prints "verify ... max_diff" per case and
// exits 1 on a difference above 2e-2, else 0.
//
// BENCH_EAGER=1: instead, the eager decode-step latency (issue 25): a serving loop without
// graphs, BENCH_EAGER_STEPS (default 200) direct kvcache_forward calls on one stream, each a
// decode step that appends one new token (k_new / v_new) at the next position of every
// sequence (a dense and a paged-16 cache, contexts 4k and 32k; BENCH_ONLY narrows them as
// above), the host clock around the loop with one stream synchronisation at its end; the
// mean per step, median of 5 loops after a warm-up. One line per configuration:
//   eager <config> ctx <n> host_us_per_step <x> enqueue_us_per_step <y> steps <N> index_checks <device|host>
// host_us_per_step: loop wall time / steps (the steady step rate of an eager loop);
// enqueue_us_per_step: the part before the final synchronisation (the calls' host time).
// FLASHATTN_DEVICE_INDEX_CHECKS=0 runs the host copy + synchronisation path of the index
// checks (main's before issue 25's change): run both for the before / after comparison.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/half.hpp"
#include "stream_read.hpp"

namespace {

#define BENCH_CHECK(expr)                                                     \
  do {                                                                        \
    const cudaError_t e_ = (expr);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

using flashattn::Device;
using flashattn::DType;
using flashattn::Tensor;

constexpr int kHq = 32, kHk = 8;
// Head dim of q, K and V: 128, or BENCH_HEAD_DIM (a multiple of 16 up to 512; above 256 the
// decode kernel's 512 bucket).
int g_d = 128;
// Sequences per call: 8, or BENCH_BATCH; the sweep (BENCH_SWEEP=1) sets it per point.
int g_batch = 8;
// Query tokens per call (BENCH_SPEC: 1, or the drafts verified in one call, causal) and
// whether they form a draft tree (a tree_mask) rather than a chain.
int g_sq = 1;
bool g_tree = false;
// num_splits of run_decode's calls: >= 0 set by the sweep's BENCH_SWEEP_SPLITS, else
// BENCH_SPLITS (default 0, the heuristic).
int g_splits = -1;
int decode_splits() {
  if (g_splits >= 0) return g_splits;
  return std::getenv("BENCH_SPLITS") ? std::atoi(std::getenv("BENCH_SPLITS")) : 0;
}

struct Buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n, int fill = 0x3c) : bytes(n) {
    if (n) {
      BENCH_CHECK(cudaMalloc(&p, n));
      BENCH_CHECK(cudaMemset(p, fill, n));
    }
  }
  ~Buffer() {
    if (p) cudaFree(p);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void upload_ints(const Buffer& b, const std::vector<int>& v) {
  BENCH_CHECK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice));
}

// One decode configuration over n_caches independent caches.
struct Config {
  const char* name;
  int ctx;
  int block_size;  // 0 = dense
  bool fp8;
};

struct Result {
  double us = 0, tbps = 0, tokens_per_s = 0;
  double stream_us = 0, stream_tbps = 0;  // the streaming read of the same bytes
  std::size_t kv_bytes = 0;
  std::size_t ws_bytes = 0;  // the call's workspace (0: one split, or the cluster split merge)
};

// Caches a configuration rotates over: enough that one call's keys are not in L2 for the
// next (>= 512 MiB of K and V in all; 64 at most: the smallest sweep point, batch 1 at 1k,
// is 4 MiB).
int cache_count(std::size_t kv_bytes) {
  return static_cast<int>(std::clamp<std::size_t>((std::size_t(512) << 20) / kv_bytes + 1, 1, 64));
}

// Median microseconds per launch of one graph per cache, each capturing record(cache) on
// `stream`: launched 8 at a time in turn, 15 repeats after a warm-up of at least 3 x 8
// launches and 50 ms: after a long-context configuration the next one's first milliseconds
// ran slower (dense 4k right after dense 128k: 45.4 us against 41.2 with the old 24-launch
// warm-up; docs/performance.md), so a short configuration replays until the state settles.
template <class Caches, class Record>
double time_captured(Caches& caches, cudaStream_t stream, Record record) {
  std::vector<cudaGraphExec_t> execs;
  for (auto& c : caches) {
    cudaGraph_t g;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    record(c);
    BENCH_CHECK(cudaStreamEndCapture(stream, &g));
    cudaGraphExec_t e;
    BENCH_CHECK(cudaGraphInstantiate(&e, g, 0));
    cudaGraphDestroy(g);
    execs.push_back(e);
  }
  constexpr int kCalls = 8, kRepeats = 15;
  const std::size_t n = execs.size();
  cudaEvent_t t0, t1;
  BENCH_CHECK(cudaEventCreate(&t0));
  BENCH_CHECK(cudaEventCreate(&t1));
  for (float warm_ms = 0; warm_ms < 50.0f;) {
    BENCH_CHECK(cudaEventRecord(t0, stream));
    for (int w = 0; w < 3 * kCalls; ++w) BENCH_CHECK(cudaGraphLaunch(execs[w % n], stream));
    BENCH_CHECK(cudaEventRecord(t1, stream));
    BENCH_CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    warm_ms += ms;
  }
  std::vector<double> times;
  std::size_t next = 0;
  for (int r = 0; r < kRepeats; ++r) {
    BENCH_CHECK(cudaEventRecord(t0, stream));
    for (int i = 0; i < kCalls; ++i) BENCH_CHECK(cudaGraphLaunch(execs[next++ % n], stream));
    BENCH_CHECK(cudaEventRecord(t1, stream));
    BENCH_CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    times.push_back(1e3 * ms / kCalls);
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  for (auto e : execs) cudaGraphExecDestroy(e);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The rates of a result whose us and stream_us are set: bytes read per second and sequences
// (one token each) per second.
Result with_rates(Result r, std::size_t kv_bytes) {
  r.kv_bytes = kv_bytes;
  r.tbps = kv_bytes / (r.us * 1e-6) / 1e12;
  r.tokens_per_s = double(g_batch) * g_sq / (r.us * 1e-6);
  r.stream_tbps = kv_bytes / (r.stream_us * 1e-6) / 1e12;
  return r;
}

int sm_count() {
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}

// BENCH_VERIFY: heuristic splits (eager, then one graph replay) against num_splits = 1 on
// random bf16 q / K / V; returns false on a difference above 2e-2.
bool verify_splits(cudaStream_t stream) {
  bool ok = true;
  const Device dev = Device::cuda(0);
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (int b : {1, 8}) {
    for (int ctx : {1000, 4096}) {
      const std::size_t n_q = std::size_t(b) * kHq * g_d, n_kv = std::size_t(b) * ctx * kHk * g_d;
      std::vector<std::uint16_t> hq(n_q), hk(n_kv), hv(n_kv);
      for (auto& x : hq) x = flashattn::float_to_bf16(uni(rng));
      for (auto& x : hk) x = flashattn::float_to_bf16(uni(rng));
      for (auto& x : hv) x = flashattn::float_to_bf16(uni(rng));
      Buffer q(n_q * 2), k(n_kv * 2), v(n_kv * 2), o_split(n_q * 2), o_one(n_q * 2), lens(b * sizeof(int));
      BENCH_CHECK(cudaMemcpy(q.p, hq.data(), n_q * 2, cudaMemcpyHostToDevice));
      BENCH_CHECK(cudaMemcpy(k.p, hk.data(), n_kv * 2, cudaMemcpyHostToDevice));
      BENCH_CHECK(cudaMemcpy(v.p, hv.data(), n_kv * 2, cudaMemcpyHostToDevice));
      std::vector<int> hl(b);
      for (int i = 0; i < b; ++i) hl[i] = ctx - 37 * i;  // unequal lengths
      upload_ints(lens, hl);
      flashattn::KVCacheArgs a;
      a.q = Tensor::contiguous(q.p, DType::kBFloat16, {b, 1, kHq, g_d}, dev);
      a.k_cache = Tensor::contiguous(k.p, DType::kBFloat16, {b, ctx, kHk, g_d}, dev);
      a.v_cache = Tensor::contiguous(v.p, DType::kBFloat16, {b, ctx, kHk, g_d}, dev);
      a.cache_seqlens = Tensor::contiguous(lens.p, DType::kInt32, {b}, dev);
      flashattn::Options opts;
      opts.stream = stream;
      const Tensor ts = Tensor::contiguous(o_split.p, DType::kBFloat16, {b, 1, kHq, g_d}, dev);
      const Tensor t1 = Tensor::contiguous(o_one.p, DType::kBFloat16, {b, 1, kHq, g_d}, dev);
      a.num_splits = 0;
      Buffer ws(flashattn::kvcache_workspace_size(a, opts));
      a.num_splits = 1;
      flashattn::kvcache_forward(a, t1, Tensor{}, opts, {});
      a.num_splits = 0;
      std::vector<std::uint16_t> h1(n_q), hs(n_q);
      BENCH_CHECK(cudaStreamSynchronize(stream));
      BENCH_CHECK(cudaMemcpy(h1.data(), o_one.p, n_q * 2, cudaMemcpyDeviceToHost));
      for (int mode = 0; mode < 2; ++mode) {
        BENCH_CHECK(cudaMemset(o_split.p, 0xff, n_q * 2));
        BENCH_CHECK(cudaMemset(ws.p, 0x3c, ws.bytes));
        BENCH_CHECK(cudaDeviceSynchronize());
        if (mode == 0) {
          flashattn::kvcache_forward(a, ts, Tensor{}, opts, {ws.p, ws.bytes});
        } else {
          cudaGraph_t g;
          BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
          flashattn::kvcache_forward(a, ts, Tensor{}, opts, {ws.p, ws.bytes});
          BENCH_CHECK(cudaStreamEndCapture(stream, &g));
          cudaGraphExec_t e;
          BENCH_CHECK(cudaGraphInstantiate(&e, g, 0));
          for (int r = 0; r < 3; ++r) BENCH_CHECK(cudaGraphLaunch(e, stream));
          BENCH_CHECK(cudaStreamSynchronize(stream));
          cudaGraphExecDestroy(e);
          cudaGraphDestroy(g);
        }
        BENCH_CHECK(cudaStreamSynchronize(stream));
        BENCH_CHECK(cudaMemcpy(hs.data(), o_split.p, n_q * 2, cudaMemcpyDeviceToHost));
        float worst = 0.0f;
        for (std::size_t i = 0; i < n_q; ++i) {
          const float d = std::fabs(flashattn::bf16_to_float(hs[i]) - flashattn::bf16_to_float(h1[i]));
          worst = std::isnan(d) ? INFINITY : std::max(worst, d);
        }
        const bool pass = worst <= 2e-2f;
        ok = ok && pass;
        std::printf("verify b %d ctx %d %s max_diff %.3g %s\n", b, ctx, mode == 0 ? "eager" : "graph", worst,
                    pass ? "ok" : "FAIL");
      }
    }
  }
  std::fflush(stdout);
  return ok;
}

Result run_decode(const Config& cfg, cudaStream_t stream) {
  const std::size_t elem = cfg.fp8 ? 1 : 2;
  const std::size_t kv_bytes = std::size_t(g_batch) * cfg.ctx * kHk * g_d * 2 * elem;
  const int n_caches = cache_count(kv_bytes);
  struct Cache {
    std::unique_ptr<Buffer> k, v, table;
    flashattn::KVCacheArgs args;
  };
  Buffer q(std::size_t(g_batch) * g_sq * kHq * g_d * 2), out(std::size_t(g_batch) * g_sq * kHq * g_d * 2);
  Buffer lens(g_batch * sizeof(int)), scales(kHk * sizeof(float));
  upload_ints(lens, std::vector<int>(g_batch, cfg.ctx));
  // A draft tree (g_tree): draft t hangs under a random earlier draft or the context; query
  // i sees draft t when t is i or one of its ancestors. The same tree for every sequence.
  const int mask_words = (g_sq + 31) / 32;
  Buffer tree(g_tree ? std::size_t(g_batch) * g_sq * mask_words * sizeof(int) : 0);
  if (g_tree) {
    std::mt19937 tree_rng(7);
    std::vector<int> parent(g_sq, -1);
    for (int t = 1; t < g_sq; ++t) parent[t] = std::uniform_int_distribution<int>(-1, t - 1)(tree_rng);
    std::vector<int> bits(std::size_t(g_batch) * g_sq * mask_words, 0);
    for (int bi = 0; bi < g_batch; ++bi) {
      for (int i = 0; i < g_sq; ++i) {
        for (int t = i; t >= 0; t = parent[t]) {
          bits[(std::size_t(bi) * g_sq + i) * mask_words + t / 32] |= int(1u << (t % 32));
        }
      }
    }
    upload_ints(tree, bits);
  }
  {
    std::vector<float> s(kHk, 0.02f);
    BENCH_CHECK(cudaMemcpy(scales.p, s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  const DType kv_dtype = cfg.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  const Device dev = Device::cuda(0);
  std::mt19937 rng(1234);
  std::vector<Cache> caches(n_caches);
  for (auto& c : caches) {
    c.k = std::make_unique<Buffer>(kv_bytes / 2);
    c.v = std::make_unique<Buffer>(kv_bytes / 2);
    auto& a = c.args;
    a.q = Tensor::contiguous(q.p, DType::kBFloat16, {g_batch, g_sq, kHq, g_d}, dev);
    a.cache_seqlens = Tensor::contiguous(lens.p, DType::kInt32, {g_batch}, dev);
    if (g_tree) a.tree_mask = Tensor::contiguous(tree.p, DType::kInt32, {g_batch, g_sq, mask_words}, dev);
    if (cfg.block_size > 0) {
      const int per_seq = cfg.ctx / cfg.block_size, blocks = per_seq * g_batch;
      std::vector<int> ids(blocks);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      c.table = std::make_unique<Buffer>(ids.size() * sizeof(int));
      upload_ints(*c.table, ids);
      a.k_cache = Tensor::contiguous(c.k->p, kv_dtype, {blocks, cfg.block_size, kHk, g_d}, dev);
      a.v_cache = Tensor::contiguous(c.v->p, kv_dtype, {blocks, cfg.block_size, kHk, g_d}, dev);
      a.block_table = Tensor::contiguous(c.table->p, DType::kInt32, {g_batch, per_seq}, dev);
    } else {
      a.k_cache = Tensor::contiguous(c.k->p, kv_dtype, {g_batch, cfg.ctx, kHk, g_d}, dev);
      a.v_cache = Tensor::contiguous(c.v->p, kv_dtype, {g_batch, cfg.ctx, kHk, g_d}, dev);
    }
    if (cfg.fp8) {
      a.k_scale = Tensor::contiguous(scales.p, DType::kFloat32, {kHk}, dev);
      a.v_scale = Tensor::contiguous(scales.p, DType::kFloat32, {kHk}, dev);
    }
    a.num_splits = decode_splits();
  }
  flashattn::Options opts;
  opts.stream = stream;
  opts.causal = g_sq > 1;  // the drafts are the cache's last g_sq keys
  Buffer sink(std::getenv("BENCH_SINK") != nullptr ? kHq * sizeof(float) : 0, 0);
  if (sink.p != nullptr) {
    const std::vector<float> host(kHq, 0.5f);
    BENCH_CHECK(cudaMemcpy(sink.p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    opts.learnable_sink = Tensor::contiguous(sink.p, DType::kFloat32, {kHq}, dev);
  }
  const Tensor out_t = Tensor::contiguous(out.p, DType::kBFloat16, {g_batch, g_sq, kHq, g_d}, dev);
  BENCH_CHECK(cudaDeviceSynchronize());  // memsets / uploads on the legacy stream before `stream` reads
  const std::size_t ws_bytes = flashattn::kvcache_workspace_size(caches[0].args, opts);
  Buffer ws(ws_bytes);
  // Direct calls first (validation on), then one graph per cache.
  for (auto& c : caches) flashattn::kvcache_forward(c.args, out_t, Tensor{}, opts, {ws.p, ws.bytes});
  BENCH_CHECK(cudaStreamSynchronize(stream));
  Result res;
  res.ws_bytes = ws_bytes;
  res.us = time_captured(caches, stream, [&](Cache& c) {
    flashattn::kvcache_forward(c.args, out_t, Tensor{}, opts, {ws.p, ws.bytes});
  });
  // The bound: the same caches' K and V bytes streamed by a kernel that only reads them
  // (stream_read.cu), timed the same way.
  const int sms = sm_count();
  Buffer sink_word(sizeof(std::uint32_t), 0);
  res.stream_us = time_captured(caches, stream, [&](Cache& c) {
    bench::stream_read(c.k->p, c.v->p, kv_bytes / 2, static_cast<std::uint32_t*>(sink_word.p), sms, stream);
  });
  return with_rates(res, kv_bytes);
}

// BENCH_MLA=1: multi-head latent attention decode (Options::qv, DeepSeek-V3's shape): batch
// g_batch (BENCH_BATCH, default 64 here), 128 query heads over one latent head, rope keys d
// 64 (k_cache) and the latent d_v 512 (v_cache, read once for the score and the value), a
// paged cache of 64-row blocks (shuffled table), one query token; bytes read b * s * (64 +
// 512) * 2, beside the streaming read of the same two buffers. The kernel is the process's
// family's (auto on an H100 / H200: the sm90 MLA kernel; FLASHATTN_KERNEL_FAMILY=sm80: the
// sm80 one, for the comparison).
Result run_mla(int ctx, cudaStream_t stream) {
  constexpr int kMlaHq = 128, kRope = 64, kLatent = 512, kBlock = 64;
  const std::size_t k_bytes = std::size_t(g_batch) * ctx * kRope * 2, v_bytes = std::size_t(g_batch) * ctx * kLatent * 2;
  const std::size_t kv_bytes = k_bytes + v_bytes;
  const int n_caches = cache_count(kv_bytes);
  const Device dev = Device::cuda(0);
  Buffer q(std::size_t(g_batch) * kMlaHq * kRope * 2), qv(std::size_t(g_batch) * kMlaHq * kLatent * 2);
  Buffer out(std::size_t(g_batch) * kMlaHq * kLatent * 2), lens(g_batch * sizeof(int));
  upload_ints(lens, std::vector<int>(g_batch, ctx));
  const int per_seq = ctx / kBlock, blocks = per_seq * g_batch;
  struct Cache {
    std::unique_ptr<Buffer> k, v, table;
    flashattn::KVCacheArgs args;
  };
  std::vector<Cache> caches(n_caches);
  std::mt19937 rng(1234);
  for (auto& c : caches) {
    c.k = std::make_unique<Buffer>(k_bytes);
    c.v = std::make_unique<Buffer>(v_bytes);
    std::vector<int> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    c.table = std::make_unique<Buffer>(ids.size() * sizeof(int));
    upload_ints(*c.table, ids);
    auto& a = c.args;
    a.q = Tensor::contiguous(q.p, DType::kBFloat16, {g_batch, 1, kMlaHq, kRope}, dev);
    a.k_cache = Tensor::contiguous(c.k->p, DType::kBFloat16, {blocks, kBlock, 1, kRope}, dev);
    a.v_cache = Tensor::contiguous(c.v->p, DType::kBFloat16, {blocks, kBlock, 1, kLatent}, dev);
    a.block_table = Tensor::contiguous(c.table->p, DType::kInt32, {g_batch, per_seq}, dev);
    a.cache_seqlens = Tensor::contiguous(lens.p, DType::kInt32, {g_batch}, dev);
    a.num_splits = std::getenv("BENCH_SPLITS") ? std::atoi(std::getenv("BENCH_SPLITS")) : 0;
  }
  flashattn::Options opts;
  opts.stream = stream;
  opts.qv = Tensor::contiguous(qv.p, DType::kBFloat16, {g_batch, 1, kMlaHq, kLatent}, dev);
  const Tensor out_t = Tensor::contiguous(out.p, DType::kBFloat16, {g_batch, 1, kMlaHq, kLatent}, dev);
  BENCH_CHECK(cudaDeviceSynchronize());
  Buffer ws(flashattn::kvcache_workspace_size(caches[0].args, opts));
  for (auto& c : caches) flashattn::kvcache_forward(c.args, out_t, Tensor{}, opts, {ws.p, ws.bytes});
  BENCH_CHECK(cudaStreamSynchronize(stream));
  Result res;
  res.us = time_captured(caches, stream, [&](Cache& c) {
    flashattn::kvcache_forward(c.args, out_t, Tensor{}, opts, {ws.p, ws.bytes});
  });
  // The two buffers differ in size: each read whole (its two halves as stream_read's pair),
  // one launch each.
  const int sms = sm_count();
  Buffer sink_word(sizeof(std::uint32_t), 0);
  auto* sink = static_cast<std::uint32_t*>(sink_word.p);
  res.stream_us = time_captured(caches, stream, [&](Cache& c) {
    bench::stream_read(c.v->p, static_cast<char*>(c.v->p) + v_bytes / 2, v_bytes / 2, sink, sms, stream);
    bench::stream_read(c.k->p, static_cast<char*>(c.k->p) + k_bytes / 2, k_bytes / 2, sink, sms, stream);
  });
  return with_rates(res, kv_bytes);
}

// BENCH_EAGER=1: `steps` direct decode steps of cfg (one new token appended per sequence
// and step, cache_seqlens advancing by one: step i's lengths are their own device buffer,
// uploaded before the loop), timed on the host.
struct EagerResult {
  double host_us = 0, enqueue_us = 0;
};

EagerResult run_eager(const Config& cfg, cudaStream_t stream, int steps) {
  const std::size_t elem = cfg.fp8 ? 1 : 2;
  const std::size_t kv_bytes = std::size_t(g_batch) * cfg.ctx * kHk * g_d * 2 * elem;
  const DType kv_dtype = cfg.fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  const Device dev = Device::cuda(0);
  Buffer q(std::size_t(g_batch) * kHq * g_d * 2), out(std::size_t(g_batch) * kHq * g_d * 2);
  Buffer kn(std::size_t(g_batch) * kHk * g_d * 2), vn(std::size_t(g_batch) * kHk * g_d * 2);
  Buffer k(kv_bytes / 2), v(kv_bytes / 2), scales(kHk * sizeof(float));
  {
    std::vector<float> s(kHk, 0.02f);
    BENCH_CHECK(cudaMemcpy(scales.p, s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  // Lengths of step i: ctx - steps + i for every sequence (the last step appends at ctx - 1).
  Buffer lens(std::size_t(steps) * g_batch * sizeof(int));
  {
    std::vector<int> all(std::size_t(steps) * g_batch);
    for (int i = 0; i < steps; ++i)
      for (int b = 0; b < g_batch; ++b) all[std::size_t(i) * g_batch + b] = cfg.ctx - steps + i;
    upload_ints(lens, all);
  }
  std::unique_ptr<Buffer> table;
  flashattn::KVCacheArgs a;
  a.q = Tensor::contiguous(q.p, DType::kBFloat16, {g_batch, 1, kHq, g_d}, dev);
  a.k_new = Tensor::contiguous(kn.p, DType::kBFloat16, {g_batch, 1, kHk, g_d}, dev);
  a.v_new = Tensor::contiguous(vn.p, DType::kBFloat16, {g_batch, 1, kHk, g_d}, dev);
  if (cfg.block_size > 0) {
    const int per_seq = cfg.ctx / cfg.block_size, blocks = per_seq * g_batch;
    std::vector<int> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(1234);
    std::shuffle(ids.begin(), ids.end(), rng);
    table = std::make_unique<Buffer>(ids.size() * sizeof(int));
    upload_ints(*table, ids);
    a.k_cache = Tensor::contiguous(k.p, kv_dtype, {blocks, cfg.block_size, kHk, g_d}, dev);
    a.v_cache = Tensor::contiguous(v.p, kv_dtype, {blocks, cfg.block_size, kHk, g_d}, dev);
    a.block_table = Tensor::contiguous(table->p, DType::kInt32, {g_batch, per_seq}, dev);
  } else {
    a.k_cache = Tensor::contiguous(k.p, kv_dtype, {g_batch, cfg.ctx, kHk, g_d}, dev);
    a.v_cache = Tensor::contiguous(v.p, kv_dtype, {g_batch, cfg.ctx, kHk, g_d}, dev);
  }
  if (cfg.fp8) {
    a.k_scale = Tensor::contiguous(scales.p, DType::kFloat32, {kHk}, dev);
    a.v_scale = Tensor::contiguous(scales.p, DType::kFloat32, {kHk}, dev);
  }
  a.num_splits = std::getenv("BENCH_SPLITS") ? std::atoi(std::getenv("BENCH_SPLITS")) : 0;
  auto step_args = [&](int i) {
    flashattn::KVCacheArgs s = a;
    s.cache_seqlens =
        Tensor::contiguous(static_cast<int*>(lens.p) + std::size_t(i) * g_batch, DType::kInt32, {g_batch}, dev);
    return s;
  };
  flashattn::Options opts;
  opts.stream = stream;
  const Tensor out_t = Tensor::contiguous(out.p, DType::kBFloat16, {g_batch, 1, kHq, g_d}, dev);
  BENCH_CHECK(cudaDeviceSynchronize());  // memsets / uploads on the legacy stream before `stream` reads
  // One workspace for every step (the size does not depend on the lengths), as a serving
  // loop keeps one.
  const std::size_t ws_bytes = flashattn::kvcache_workspace_size(step_args(0), opts);
  Buffer ws(ws_bytes);
  std::vector<flashattn::KVCacheArgs> per_step;
  for (int i = 0; i < steps; ++i) per_step.push_back(step_args(i));
  auto loop = [&](EagerResult& r) {
    BENCH_CHECK(cudaStreamSynchronize(stream));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) flashattn::kvcache_forward(per_step[std::size_t(i)], out_t, Tensor{}, opts, {ws.p, ws.bytes});
    const auto t1 = std::chrono::steady_clock::now();
    BENCH_CHECK(cudaStreamSynchronize(stream));
    const auto t2 = std::chrono::steady_clock::now();
    r.enqueue_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / steps;
    r.host_us = std::chrono::duration<double, std::micro>(t2 - t0).count() / steps;
  };
  EagerResult warm;
  loop(warm);  // loads the kernels, fills the caches' positions once
  std::vector<EagerResult> runs(5);
  for (auto& r : runs) loop(r);
  flashattn::check_errors(0);  // valid indices: nothing to raise (it would throw)
  std::sort(runs.begin(), runs.end(), [](const EagerResult& x, const EagerResult& y) { return x.host_us < y.host_us; });
  return runs[runs.size() / 2];
}

// One 200k-token sequence: prefill (append into an empty cache + causal attention of
// all its tokens) and one decode step at 200k keys.
void long_context(FILE* csv, cudaStream_t stream) {
  constexpr int kS = 200000;
  std::size_t free0 = 0, total = 0;
  BENCH_CHECK(cudaMemGetInfo(&free0, &total));
  const Device dev = Device::cuda(0);
  {
    Buffer q(std::size_t(kS) * kHq * g_d * 2, 0x3c), out(std::size_t(kS) * kHq * g_d * 2);
    Buffer kn(std::size_t(kS) * kHk * g_d * 2, 0x3c), vn(std::size_t(kS) * kHk * g_d * 2, 0x3c);
    Buffer kc(std::size_t(kS + 64) * kHk * g_d * 2), vc(std::size_t(kS + 64) * kHk * g_d * 2);
    Buffer lens(sizeof(int)), q1(std::size_t(kHq) * g_d * 2), out1(std::size_t(kHq) * g_d * 2);
    upload_ints(lens, {0});
    BENCH_CHECK(cudaDeviceSynchronize());
    flashattn::KVCacheArgs a;
    a.q = Tensor::contiguous(q.p, DType::kBFloat16, {1, kS, kHq, g_d}, dev);
    a.k_cache = Tensor::contiguous(kc.p, DType::kBFloat16, {1, kS + 64, kHk, g_d}, dev);
    a.v_cache = Tensor::contiguous(vc.p, DType::kBFloat16, {1, kS + 64, kHk, g_d}, dev);
    a.cache_seqlens = Tensor::contiguous(lens.p, DType::kInt32, {1}, dev);
    a.k_new = Tensor::contiguous(kn.p, DType::kBFloat16, {1, kS, kHk, g_d}, dev);
    a.v_new = Tensor::contiguous(vn.p, DType::kBFloat16, {1, kS, kHk, g_d}, dev);
    a.num_splits = 0;
    flashattn::Options opts;
    opts.stream = stream;
    opts.causal = true;
    const Tensor out_t = Tensor::contiguous(out.p, DType::kBFloat16, {1, kS, kHq, g_d}, dev);
    cudaEvent_t t0, t1;
    BENCH_CHECK(cudaEventCreate(&t0));
    BENCH_CHECK(cudaEventCreate(&t1));
    BENCH_CHECK(cudaEventRecord(t0, stream));
    flashattn::kvcache_forward(a, out_t, Tensor{}, opts);
    BENCH_CHECK(cudaEventRecord(t1, stream));
    BENCH_CHECK(cudaEventSynchronize(t1));
    float prefill_ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&prefill_ms, t0, t1));
    std::size_t free1 = 0;
    BENCH_CHECK(cudaMemGetInfo(&free1, &total));
    // Decode at 200k keys (the cache now holds the sequence): one token.
    BENCH_CHECK(cudaStreamSynchronize(stream));
    upload_ints(lens, {kS});
    BENCH_CHECK(cudaDeviceSynchronize());
    flashattn::KVCacheArgs d = a;
    d.q = Tensor::contiguous(q1.p, DType::kBFloat16, {1, 1, kHq, g_d}, dev);
    d.k_new = Tensor{};
    d.v_new = Tensor{};
    flashattn::Options dopts;
    dopts.stream = stream;
    const Tensor out1_t = Tensor::contiguous(out1.p, DType::kBFloat16, {1, 1, kHq, g_d}, dev);
    const std::size_t ws_bytes = flashattn::kvcache_workspace_size(d, dopts);
    Buffer ws(ws_bytes);
    for (int w = 0; w < 3; ++w) flashattn::kvcache_forward(d, out1_t, Tensor{}, dopts, {ws.p, ws.bytes});
    std::vector<double> times;
    for (int r = 0; r < 9; ++r) {
      BENCH_CHECK(cudaEventRecord(t0, stream));
      flashattn::kvcache_forward(d, out1_t, Tensor{}, dopts, {ws.p, ws.bytes});
      BENCH_CHECK(cudaEventRecord(t1, stream));
      BENCH_CHECK(cudaEventSynchronize(t1));
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, t0, t1));
      times.push_back(1e3 * ms);
    }
    std::sort(times.begin(), times.end());
    const double dec_us = times[times.size() / 2];
    const double kv = double(kS) * kHk * g_d * 2 * 2;
    const double used_gib = double(free0 - free1) / (1 << 30);
    std::printf("| 200k single sequence | prefill %.1f ms | decode %.1f us (%.2f TB/s, direct call) | "
                "device memory %.2f GiB |\n",
                prefill_ms, dec_us, kv / (dec_us * 1e-6) / 1e12, used_gib);
    if (csv) std::fprintf(csv, "long200k,%d,0,0,%.3f,%.1f,%.3f\n", kS, prefill_ms * 1e3, dec_us, used_gib);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!flashattn::cuda_available()) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  FILE* csv = argc > 1 && std::string(argv[1]) != "-" ? std::fopen(argv[1], "w") : nullptr;
  auto env_on = [](const char* name) { return std::getenv(name) != nullptr && std::string(std::getenv(name)) == "1"; };
  const bool eager = env_on("BENCH_EAGER"), sweep = env_on("BENCH_SWEEP"), mla = env_on("BENCH_MLA");
  const bool spec = env_on("BENCH_SPEC");
  if (const char* d = std::getenv("BENCH_HEAD_DIM")) {
    g_d = std::atoi(d);
    if (g_d < 16 || g_d > 512 || g_d % 16 != 0) {
      std::fprintf(stderr, "BENCH_HEAD_DIM: expected a multiple of 16 in [16, 512], got '%s'\n", d);
      return 2;
    }
  }
  if (const char* b = std::getenv("BENCH_BATCH")) {
    g_batch = std::atoi(b);
    if (g_batch < 1) {
      std::fprintf(stderr, "BENCH_BATCH: expected a batch >= 1, got '%s'\n", b);
      return 2;
    }
  }
  if (csv) {
    std::fprintf(csv, eager ? "config,ctx,block_size,fp8,host_us_per_step,enqueue_us_per_step,index_checks\n"
                            : "config,batch,ctx,block_size,fp8,us,tbps,tokens_per_s,stream_us,stream_tbps\n");
  }
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (env_on("BENCH_VERIFY")) return verify_splits(stream) ? 0 : 1;
  const std::vector<Config> grid = {
      {"dense", 4096, 0, false},       {"dense", 32768, 0, false},       {"dense", 131072, 0, false},
      {"paged16", 4096, 16, false},    {"paged16", 32768, 16, false},    {"paged16", 131072, 16, false},
      {"paged256", 4096, 256, false},  {"paged256", 32768, 256, false},  {"paged256", 131072, 256, false},
      {"fp8", 4096, 0, true},          {"fp8", 32768, 0, true},          {"fp8", 131072, 0, true},
  };
  if (!eager && !sweep && !mla && !spec) {  // (the other modes print tables of their own)
    std::printf("bf16 decode, b %d, h %d/%d, d %d, s_q 1 (graph launches, median per call); stream: a kernel\n"
                "that only reads the same K / V bytes (the bound)\n", g_batch, kHq, kHk, g_d);
    std::printf("| cache | context | us | KV TB/s | tokens/s | stream TB/s | / stream |\n|---|---|---|---|---|---|---|\n");
  }
  // BENCH_ONLY: "grid" (no long context), a name ("dense"), or a comma list of names or
  // name:context, run in the list's order ("dense:131072,paged16:4096,dense:4096").
  const char* only = std::getenv("BENCH_ONLY");
  std::vector<Config> order;
  if (only && std::string(only) != "grid") {
    std::string list = only;
    for (std::size_t pos = 0; pos <= list.size();) {
      const std::size_t end = std::min(list.find(',', pos), list.size());
      const std::string tok = list.substr(pos, end - pos);
      const std::size_t before = order.size();
      for (const Config& c : grid) {
        if (tok == c.name || tok == std::string(c.name) + ":" + std::to_string(c.ctx)) order.push_back(c);
      }
      if (order.size() == before) {
        std::fprintf(stderr, "BENCH_ONLY: '%s' names no configuration (expected grid, a name or name:context)\n",
                     tok.c_str());
        if (csv) std::fclose(csv);
        cudaStreamDestroy(stream);
        return 2;
      }
      pos = end + 1;
    }
  } else if (eager) {
    order = {grid[0], grid[1], grid[3], grid[4]};  // dense and paged16 at 4k and 32k
  } else {
    order = grid;
  }
  if (mla) {
    if (std::getenv("BENCH_BATCH") == nullptr) g_batch = 64;
    std::printf("MLA decode (qv): b %d, 128 query heads over one latent head, d 64 + d_v 512, paged 64, bf16, s_q 1\n",
                g_batch);
    std::printf("| context | us | KV TB/s | tokens/s | stream TB/s | / stream |\n|---|---|---|---|---|---|\n");
    for (int ctx : {4096, 32768}) {
      const Result r = run_mla(ctx, stream);
      std::printf("| %d | %.1f | %.2f | %.0f | %.2f | %.3f |\n", ctx, r.us, r.tbps, r.tokens_per_s, r.stream_tbps,
                  r.tbps / r.stream_tbps);
      std::fflush(stdout);
      if (csv) std::fprintf(csv, "mla,%d,%d,64,0,%.2f,%.3f,%.0f,%.2f,%.3f\n", g_batch, ctx, r.us, r.tbps, r.tokens_per_s,
                            r.stream_us, r.stream_tbps);
    }
    if (csv) std::fclose(csv);
    cudaStreamDestroy(stream);
    return 0;
  }
  if (spec) {
    // Issue 23's speculative decoding: 1, 4 and 8 query tokens verified in one call (the
    // cache's last keys are the drafts, causal), as a chain and as a draft tree, against
    // one-token decode: us per call and per token, dense bf16 cache, batch g_batch.
    std::printf("speculative decoding: bf16 dense cache, b %d, h %d/%d, d %d (graph launches, median per call)\n",
                g_batch, kHq, kHk, g_d);
    std::printf("| context | drafts | us | us / token | tokens/s | per-token cost / one-token |\n|---|---|---|---|---|---|\n");
    const struct { int n; bool tree; } kinds[] = {{1, false}, {4, false}, {4, true}, {8, false}, {8, true}};
    for (int ctx : {4096, 32768}) {
      double one = 0;
      for (const auto& k : kinds) {
        g_sq = k.n;
        g_tree = k.tree;
        const Result r = run_decode(Config{"dense", ctx, 0, false}, stream);
        if (k.n == 1) one = r.us;
        std::printf("| %d | %d %s | %.1f | %.2f | %.0f | %.3f |\n", ctx, k.n, k.tree ? "tree" : "linear", r.us,
                    r.us / k.n, r.tokens_per_s, r.us / k.n / one);
        std::fflush(stdout);
        if (csv) {
          std::fprintf(csv, "spec_%s%d,%d,%d,0,0,%.2f,%.3f,%.0f,%.2f,%.3f\n", k.tree ? "tree" : "linear", k.n, g_batch,
                       ctx, r.us, r.tbps, r.tokens_per_s, r.stream_us, r.stream_tbps);
        }
      }
    }
    g_sq = 1;
    g_tree = false;
    if (csv) std::fclose(csv);
    cudaStreamDestroy(stream);
    return 0;
  }
  if (sweep) {
    // Issue 23's sweep: dense bf16 caches, batch 1 / 8 / 64 x contexts 1k .. 128k, each
    // against the streaming read of its own bytes.
    std::printf("decode sweep: bf16 dense cache, h %d/%d, d %d, s_q 1 (graph launches, median per call)\n", kHq, kHk, g_d);
    std::printf("| batch | context | us | KV TB/s | stream us | stream TB/s | / stream |\n|---|---|---|---|---|---|---|\n");
    std::vector<int> batches = {1, 8, 64};
    if (const char* list = std::getenv("BENCH_SWEEP_BATCHES")) {
      batches.clear();
      for (const char* c = list; *c != '\0';) {
        char* end = nullptr;
        const long v = std::strtol(c, &end, 10);
        if (end == c || v < 1) {
          std::fprintf(stderr, "BENCH_SWEEP_BATCHES: expected a comma list of batches >= 1, got '%s'\n", list);
          return 2;
        }
        batches.push_back(static_cast<int>(v));
        c = *end == ',' ? end + 1 : end;
      }
    }
    // BENCH_SWEEP_CONTEXTS / BENCH_SWEEP_SPLITS: comma lists narrowing the contexts and
    // giving num_splits per point (0: the heuristic), BENCH_SWEEP_ROUNDS (default 1) rounds
    // over the whole list, alternating: an A/B of split plans in one process. With
    // BENCH_SWEEP_SPLITS each row also names num_splits, the round and the call's workspace
    // bytes (0 with splits: the cluster split merge).
    auto int_list = [](const char* name, std::vector<int> dflt, int min) -> std::vector<int> {
      const char* list = std::getenv(name);
      if (list == nullptr) return dflt;
      std::vector<int> out;
      for (const char* c = list; *c != '\0';) {
        char* end = nullptr;
        const long v = std::strtol(c, &end, 10);
        if (end == c || v < min) {
          std::fprintf(stderr, "%s: expected a comma list of integers >= %d, got '%s'\n", name, min, list);
          std::exit(2);
        }
        out.push_back(static_cast<int>(v));
        c = *end == ',' ? end + 1 : end;
      }
      return out;
    };
    std::vector<int> contexts;
    for (int ctx = 1024; ctx <= 131072; ctx *= 2) contexts.push_back(ctx);
    contexts = int_list("BENCH_SWEEP_CONTEXTS", contexts, 1);
    const bool ab = std::getenv("BENCH_SWEEP_SPLITS") != nullptr;
    const std::vector<int> splits_list = int_list("BENCH_SWEEP_SPLITS", {-1}, 0);
    const int rounds = std::max(1, std::getenv("BENCH_SWEEP_ROUNDS") ? std::atoi(std::getenv("BENCH_SWEEP_ROUNDS")) : 1);
    if (ab) {
      std::printf("| round | batch | context | num_splits | workspace B | us | KV TB/s | / stream |\n"
                  "|---|---|---|---|---|---|---|---|\n");
    }
    for (int round = 0; round < rounds; ++round) {
      for (int b : batches) {
        g_batch = b;
        for (int ctx : contexts) {
          for (int sp : splits_list) {
            g_splits = sp;
            const Config c{"dense", ctx, 0, false};
            const Result r = run_decode(c, stream);
            if (ab) {
              std::printf("| %d | %d | %d | %d | %zu | %.1f | %.2f | %.3f |\n", round, b, ctx, sp, r.ws_bytes, r.us,
                          r.tbps, r.tbps / r.stream_tbps);
            } else {
              std::printf("| %d | %d | %.1f | %.2f | %.1f | %.2f | %.3f |\n", b, ctx, r.us, r.tbps, r.stream_us,
                          r.stream_tbps, r.tbps / r.stream_tbps);
            }
            std::fflush(stdout);
            if (csv) {
              std::fprintf(csv, "sweep%s,%d,%d,0,0,%.2f,%.3f,%.0f,%.2f,%.3f\n",
                           ab ? ("_splits" + std::to_string(sp)).c_str() : "", b, ctx, r.us, r.tbps, r.tokens_per_s,
                           r.stream_us, r.stream_tbps);
            }
          }
        }
      }
    }
    g_splits = -1;
    if (csv) std::fclose(csv);
    cudaStreamDestroy(stream);
    return 0;
  }
  if (eager) {
    const char* checks_env = std::getenv("FLASHATTN_DEVICE_INDEX_CHECKS");
    const char* checks = checks_env != nullptr && std::string(checks_env) == "0" ? "host" : "device";
    const int steps = std::getenv("BENCH_EAGER_STEPS") ? std::max(1, std::atoi(std::getenv("BENCH_EAGER_STEPS"))) : 200;
    std::printf("eager decode steps (append 1 token + attend), bf16, b %d, h %d/%d, d %d, index checks on the %s\n",
                g_batch, kHq, kHk, g_d, checks);
    for (const Config& c : order) {
      const EagerResult r = run_eager(c, stream, steps);
      std::printf("eager %s ctx %d host_us_per_step %.1f enqueue_us_per_step %.1f steps %d index_checks %s\n", c.name,
                  c.ctx, r.host_us, r.enqueue_us, steps, checks);
      std::fflush(stdout);
      if (csv) std::fprintf(csv, "eager_%s,%d,%d,%d,%.2f,%.2f,%s\n", c.name, c.ctx, c.block_size, c.fp8, r.host_us,
                            r.enqueue_us, checks);
    }
    if (csv) std::fclose(csv);
    cudaStreamDestroy(stream);
    return 0;
  }
  for (const Config& c : order) {
    const Result r = run_decode(c, stream);
    std::printf("| %s | %d | %.1f | %.2f | %.0f | %.2f | %.3f |\n", c.name, c.ctx, r.us, r.tbps, r.tokens_per_s,
                r.stream_tbps, r.tbps / r.stream_tbps);
    std::fflush(stdout);
    if (csv) std::fprintf(csv, "%s,%d,%d,%d,%d,%.2f,%.3f,%.0f,%.2f,%.3f\n", c.name, g_batch, c.ctx, c.block_size, c.fp8, r.us,
                          r.tbps, r.tokens_per_s, r.stream_us, r.stream_tbps);
  }
  if (!only) long_context(csv, stream);
  if (csv) std::fclose(csv);
  cudaStreamDestroy(stream);
  return 0;
}
