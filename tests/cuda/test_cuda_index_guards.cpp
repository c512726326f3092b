// CUDA: index tensors checked on the device (docs/semantics.md, "Index tensors checked on
// the device"). CUDA calls do not read cu_seqlens, seqused_k, cache_seqlens, cache_batch_idx
// and block_table back to the host (by default eagerly, and always under CUDA graph
// capture): a check kernel runs before the call's kernels. These tests pass out-of-range
// values, eagerly and captured into graphs. Each expects no CUDA error (run under
// compute-sanitizer memcheck for the out-of-bounds proof), and the documented result: the
// clamped indices compute exactly what an eager call with the clamped values computes (bit
// for bit), an append whose destination is out of range writes nothing, an append whose
// targets conflict writes nothing at all, and nothing outside the valid sequences' outputs
// and append slots changes; and the device check (flashattn::check_errors,
// core/backend.hpp) reports the bad value afterwards, without the call waiting for its
// stream. FLASHATTN_DEVICE_INDEX_CHECKS=0's host path (copy, synchronise, raise from the
// call) is tested through the test hook (IndexCheckPathScope).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_runs.hpp"
#include "cuda/kvcache_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/describe.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

// Captures fn(stream) into a graph (relaxed mode: the library's checks see the capture and
// skip reading device memory), replays it once and synchronises; no CUDA error allowed.
template <class Fn>
void replay_captured(Fn&& fn) {
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  fn(s);
  FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  FA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  FA_CUDA_OK(cudaGraphLaunch(exec, s));
  FA_CUDA_OK(cudaStreamSynchronize(s));
  FA_CUDA_OK(cudaGetLastError());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// Holds a stream (a host function enqueued on it) until open() or until `limit` passed: a
// call enqueued behind it returns before the gate opens unless it waits for the stream (a
// host copy and a synchronisation). Open it and synchronise the stream before it goes.
class StreamGate {
 public:
  StreamGate(cudaStream_t s, std::chrono::milliseconds limit) : limit_(limit) {
    EXPECT_EQ(cudaLaunchHostFunc(s, &StreamGate::hold, this), cudaSuccess);
  }
  void open() { open_ = true; }
  bool timed_out() const { return timed_out_; }

 private:
  static void CUDART_CB hold(void* self) {
    auto* g = static_cast<StreamGate*>(self);
    const auto start = std::chrono::steady_clock::now();
    while (!g->open_) {
      if (std::chrono::steady_clock::now() - start > g->limit_) {
        g->timed_out_ = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::chrono::milliseconds limit_;
  std::atomic<bool> open_{false}, timed_out_{false};
};

// The bad index a device check recorded, raised by check_errors() as an InvalidArgument of
// `function` naming one of `arguments`; afterwards nothing is pending. Returns the error text.
std::string expect_recorded_index_error(std::initializer_list<const char*> arguments, const std::string& function) {
  std::string what;
  try {
    check_errors(0);
  } catch (const InvalidArgument& e) {
    what = e.what();
    EXPECT_EQ(e.function(), function) << what;
    bool known = false;
    for (const char* a : arguments) known = known || e.argument() == a;
    EXPECT_TRUE(known) << what;
    EXPECT_NE(what.find("device check of an earlier " + function), std::string::npos) << what;
  }
  EXPECT_FALSE(what.empty()) << "check_errors() raised nothing: no bad index recorded";
  EXPECT_NO_THROW(check_errors(0)) << "a raised error is cleared";
  return what;
}

// Varlen with cu_seqlens entries below 0 and past the packed totals and seqused_k below 0
// and past the sequence: forward (every family) and backward equal, bit for bit, the eager
// calls with the clamped values.
TEST(CudaIndexGuards, VarlenOutOfRangeUnderCapture) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  // What the clamps make of the bad values below (total_q = 285, total_k = 346).
  const std::vector<int> cu_q = {0, 70, 70, 273, 285}, cu_k = {0, 90, 130, 330, 346}, used = {0, 40, 200, 3};
  const std::vector<int> bad_cu_q = {-9, 70, 70, 273, 100000}, bad_cu_k = {-1, 90, 130, 330, 1 << 30};
  const std::vector<int> bad_used = {-7, 40, 100000, 3};
  for (KernelFamily family : gpu_families()) {
    for (bool causal : {false, true}) {
      const DType dtype = coin(rng) ? DType::kFloat16 : DType::kBFloat16;
      VarlenCase c = VarlenCase::make(rng, cu_q, cu_k, 4, 2, d, dtype);
      c.set_seqused_k(used);
      c.opts.causal = causal;
      c.opts.deterministic = true;
      SCOPED_TRACE(std::string(family_str(family)) + " " + dtype_name(dtype) + (causal ? " causal" : ""));
      // Eager, checked values: the reference bits (and the oracle, for good measure).
      VarlenCase eager = c;
      cuda_varlen_forward(eager, family);
      expect_forward_matches(eager.problem(), dtype, forward_results(eager));
      cuda_varlen_backward(eager);

      // Captured, bad values in the device index tensors.
      DeviceVarlen dev(c);
      dev.cu_q.upload(int_tensor(bad_cu_q));
      dev.cu_k.upload(int_tensor(bad_cu_k));
      dev.used->upload(int_tensor(bad_used));
      VarlenCase got = c;
      got.poison_forward();
      got.poison_backward();
      DeviceCopy out(got.out), lse(got.lse), dout(got.dout), dq(got.dq), dk(got.dk), dv(got.dv);
      Options opts = c.call_options();
      opts.kernel_family = family;
      replay_captured([&](cudaStream_t s) {
        opts.stream = s;
        EXPECT_NO_THROW(varlen_forward(dev.args, out.view(), lse.view(), opts));
      });
      expect_recorded_index_error({"cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k"},
                                  "varlen_forward");
      out.download(got.out);
      lse.download(got.lse);
      EXPECT_TRUE(got.out.bitwise_equal(eager.out)) << "out: captured with bad indices vs eager with clamped ones";
      EXPECT_TRUE(got.lse.bitwise_equal(eager.lse)) << "lse: captured with bad indices vs eager with clamped ones";

      // The backward of the eager forward's out / lse, both ways.
      out.upload(eager.out);
      lse.upload(eager.lse);
      replay_captured([&](cudaStream_t s) {
        opts.stream = s;
        EXPECT_NO_THROW(varlen_backward(dev.args, dout.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view(),
                                        opts));
      });
      expect_recorded_index_error({"cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k"},
                                  "varlen_backward");
      dq.download(got.dq);
      dk.download(got.dk);
      dv.download(got.dv);
      EXPECT_TRUE(got.dq.bitwise_equal(eager.dq)) << "dq: captured with bad indices vs eager with clamped ones";
      EXPECT_TRUE(got.dk.bitwise_equal(eager.dk)) << "dk: captured with bad indices vs eager with clamped ones";
      EXPECT_TRUE(got.dv.bitwise_equal(eager.dv)) << "dv: captured with bad indices vs eager with clamped ones";
    }
  }
}

// A decode step (s_new = 1) with bad indices for sequences 1 .. 3 of 4: cache_seqlens -4
// (sequence 1), a block id past the cache or a cache_batch_idx past its rows where sequence 2
// appends, cache_seqlens past the capacity (sequence 3). Sequence 0 computes and appends as
// in the eager call with valid indices; the bad sequences append nothing (the caches are
// unchanged but for sequence 0's new row); sequence 1 sees exactly one key (its clamped
// length 0 plus the new one, which was not appended): key 0 of its cache, so its output is
// that key's value row.
TEST(CudaIndexGuards, KVCacheOutOfRangeUnderCapture) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  for (KernelFamily family : gpu_families()) {
    for (int block_size : {0, 16}) {
      KVCacheConfig cfg;
      cfg.batch = 4;
      cfg.s_q = 1;
      cfg.s_new = 1;
      cfg.h_q = 8;
      cfg.h_k = 2;
      cfg.d = d;
      cfg.dtype = DType::kBFloat16;
      cfg.cache_lens = {100, 37, 64, 20};
      cfg.block_size = block_size;
      if (block_size == 0) {
        cfg.use_batch_idx = true;
        cfg.cache_rows = 6;
      }
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.num_splits = 1;
      SCOPED_TRACE(std::string(family_str(family)) + (block_size ? " paged" : " dense with cache_batch_idx"));

      // Eager with the valid indices: sequence 0's reference bits and appended row.
      KVCacheCase eager = c;
      DeviceCopy kc_e(c.k_cache), vc_e(c.v_cache);
      {
        DeviceCopy q(c.q), lens(c.cache_lens_t), table(c.block_table_t), idx(c.batch_idx_t), kn(c.k_new),
            vn(c.v_new), out(eager.out), lse(eager.lse);
        KVCacheArgs a = c.args();
        a.q = q.view(), a.k_cache = kc_e.view(), a.v_cache = vc_e.view(), a.cache_seqlens = lens.view();
        if (block_size) a.block_table = table.view(); else a.cache_batch_idx = idx.view();
        a.k_new = kn.view(), a.v_new = vn.view();
        Options opts = c.call_options();
        opts.kernel_family = family;
        ASSERT_NO_THROW(kvcache_forward(a, out.view(), lse.view(), opts));
        FA_CUDA_OK(cudaDeviceSynchronize());
        out.download(eager.out);
        lse.download(eager.lse);
      }
      HostTensor k_eager = c.k_cache, v_eager = c.v_cache;
      kc_e.download(k_eager);
      vc_e.download(v_eager);

      // Captured with bad indices.
      std::vector<int> lens = c.cache_lens;
      lens[1] = -4;
      const std::int64_t capacity = block_size ? std::int64_t(c.max_blocks) * block_size : c.k_cache.size(1);
      lens[3] = static_cast<int>(capacity + 100);
      std::vector<int> table = c.block_table, idx = c.batch_idx;
      if (block_size) {
        table[std::size_t(2 * c.max_blocks + 64 / block_size)] = c.num_blocks + 50;  // where key 64 goes
      } else {
        idx[2] = 99;
      }
      KVCacheCase got = c;
      got.poison_outputs();
      DeviceCopy q(c.q), kc(c.k_cache), vc(c.v_cache), lens_d(int_tensor(lens)), kn(c.k_new), vn(c.v_new),
          out(got.out), lse(got.lse);
      const HostTensor table_t = block_size ? int_tensor(table, {cfg.batch, c.max_blocks}) : HostTensor();
      const HostTensor idx_t = block_size ? HostTensor() : int_tensor(idx);
      DeviceCopy table_d(table_t), idx_d(idx_t);
      KVCacheArgs a = c.args();
      a.q = q.view(), a.k_cache = kc.view(), a.v_cache = vc.view(), a.cache_seqlens = lens_d.view();
      if (block_size) a.block_table = table_d.view(); else a.cache_batch_idx = idx_d.view();
      a.k_new = kn.view(), a.v_new = vn.view();
      Options opts = c.call_options();
      opts.kernel_family = family;
      replay_captured([&](cudaStream_t s) {
        opts.stream = s;
        EXPECT_NO_THROW(kvcache_forward(a, out.view(), lse.view(), opts));
      });
      expect_recorded_index_error({"cache_seqlens", "block_table", "cache_batch_idx"}, "kvcache_forward");
      out.download(got.out);
      lse.download(got.lse);
      HostTensor k_got = c.k_cache, v_got = c.v_cache;
      kc.download(k_got);
      vc.download(v_got);

      // Sequence 0: the eager bits.
      const std::int64_t row = std::int64_t(cfg.h_q) * d;
      for (std::int64_t e = 0; e < row; ++e) {
        ASSERT_EQ(got.out.get(e), eager.out.get(e)) << "out of sequence 0, element " << e;
      }
      for (int h = 0; h < cfg.h_q; ++h) ASSERT_EQ(got.lse.at({0, h, 0}), eager.lse.at({0, h, 0})) << "lse, head " << h;
      // The caches: sequence 0's new row as in the eager call, everything else unchanged.
      const auto [slot0, row0] = c.locate(0, c.cache_lens[0]);
      const std::int64_t width = std::int64_t(cfg.h_k) * d, rows_per = c.k_cache.size(1);
      const std::int64_t new0 = (std::int64_t(slot0) * rows_per + row0) * width;
      std::int64_t changed = 0;
      for (std::int64_t e = 0; e < c.k_cache.numel(); ++e) {
        const bool appended = e >= new0 && e < new0 + width;
        const HostTensor& kw = appended ? k_eager : c.k_cache;
        const HostTensor& vw = appended ? v_eager : c.v_cache;
        // NaN slots compare by their bits (unused slots are NaN).
        const double x = k_got.get(e), y = kw.get(e), u = v_got.get(e), w = vw.get(e);
        if (!((x == y || (x != x && y != y)) && (u == w || (u != u && w != w)))) ++changed;
      }
      EXPECT_EQ(changed, 0) << "cache elements that differ from: sequence 0's append, all else unchanged";
      // Sequence 1: one visible key, key 0 of its cache: out = that value row, exactly.
      const auto [slot1, r1] = c.locate(1, 0);
      for (int h = 0; h < cfg.h_q; ++h)
        for (int col = 0; col < d; ++col) {
          const double want = c.v_cache.get((std::int64_t(slot1) * rows_per + r1) * width + (h / 4) * d + col);
          ASSERT_EQ(got.out.at({1, 0, h, col}), want) << "sequence 1 (cache_seqlens -4), head " << h << " col " << col;
        }
    }
  }
}

// A decode step without an append over a dense cache (cache_batch_idx): the decode kernel
// checks cache_seqlens and cache_batch_idx itself, with no check kernel (captured: one graph
// node where the call needs no split counters: one split, or on sm90 a cluster of splits).
// One bad value at a time, eagerly and captured: the error names the entry and its range,
// and the outputs are, bit for bit, those of the eager call with the value clamped.
TEST(CudaIndexGuards, DecodeKernelChecksItsOwnRows) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  int dev = 0, major = 0;
  FA_CUDA_OK(cudaGetDevice(&dev));
  FA_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  const int d = built_head_dims({128, 64, 256}).front();
  KVCacheConfig cfg;
  cfg.batch = 4;
  cfg.s_q = 1;
  cfg.s_new = 0;
  cfg.h_q = 8;
  cfg.h_k = 2;
  cfg.d = d;
  cfg.dtype = DType::kBFloat16;
  cfg.cache_lens = {700, 37, 300, 20};
  cfg.use_batch_idx = true;
  cfg.cache_rows = 6;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  const int capacity = static_cast<int>(c.k_cache.size(1));
  // Runs c's call with these cache_seqlens / cache_batch_idx, eagerly or captured (then
  // counting the graph's nodes); returns out and lse.
  auto run = [&](const std::vector<int>& lens, const std::vector<int>& idx, int splits, KernelFamily family,
                 bool captured, std::size_t* nodes) -> KVCacheCase {
    KVCacheCase r = c;
    r.poison_outputs();
    r.num_splits = splits;
    DeviceCopy q(c.q), kc(c.k_cache), vc(c.v_cache), lens_d(int_tensor(lens)), idx_d(int_tensor(idx)), out(r.out),
        lse(r.lse);
    KVCacheArgs a = r.args();
    a.q = q.view(), a.k_cache = kc.view(), a.v_cache = vc.view(), a.cache_seqlens = lens_d.view();
    a.cache_batch_idx = idx_d.view();
    Options opts = r.call_options();
    opts.kernel_family = family;
    cudaStream_t s;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    opts.stream = s;
    if (!captured) {
      EXPECT_NO_THROW(kvcache_forward(a, out.view(), lse.view(), opts));
    } else {
      cudaGraph_t graph;
      EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
      EXPECT_NO_THROW(kvcache_forward(a, out.view(), lse.view(), opts));
      EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
      EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, nodes), cudaSuccess);
      cudaGraphExec_t exec;
      EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      EXPECT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    cudaStreamDestroy(s);
    out.download(r.out);
    lse.download(r.lse);
    return r;
  };
  struct Bad {
    const char* argument;
    int b;
    int value, clamped;
    const char* expected;
  };
  const Bad bads[] = {
      {"cache_seqlens", 2, capacity + 5, capacity, "expected cache_seqlens[2] in [0, "},
      {"cache_seqlens", 0, -3, 0, "expected cache_seqlens[0] in [0, "},
      {"cache_batch_idx", 1, 99, cfg.cache_rows - 1, "expected cache_batch_idx[1] in [0, 5]"},
  };
  for (KernelFamily family : gpu_families()) {
    for (const int splits : {1, 3}) {
      for (const Bad& bad : bads) {
        for (const bool captured : {false, true}) {
          SCOPED_TRACE(std::string(family_str(family)) + " splits " + std::to_string(splits) + " " + bad.argument +
                       "[" + std::to_string(bad.b) + "] = " + std::to_string(bad.value) +
                       (captured ? " captured" : " eager"));
          std::vector<int> lens = c.cache_lens, idx = c.batch_idx;
          std::vector<int>& target = std::string(bad.argument) == "cache_seqlens" ? lens : idx;
          target[std::size_t(bad.b)] = bad.clamped;
          const KVCacheCase want = run(lens, idx, splits, family, false, nullptr);
          EXPECT_NO_THROW(check_errors(0)) << "the clamped call is valid";
          target[std::size_t(bad.b)] = bad.value;
          std::size_t nodes = 0;
          const KVCacheCase got = run(lens, idx, splits, family, captured, &nodes);
          const std::string what = expect_recorded_index_error({bad.argument}, "kvcache_forward");
          EXPECT_NE(what.find(bad.expected), std::string::npos) << what;
          EXPECT_NE(what.find("got " + std::string(bad.argument) + "[" + std::to_string(bad.b) + "] = " +
                              std::to_string(bad.value)),
                    std::string::npos)
              << what;
          EXPECT_TRUE(got.out.bitwise_equal(want.out)) << "out: the clamped call's bits";
          EXPECT_TRUE(got.lse.bitwise_equal(want.lse)) << "lse: the clamped call's bits";
          if (captured && (splits == 1 || major >= 9)) EXPECT_EQ(nodes, 1u) << "graph nodes: the decode kernel alone";
        }
      }
    }
  }
}

// One bad value, checked on the device: the error names the tensor, the entry, the range
// and the value; it is raised by check_errors() or, if nobody asked, by the next call on
// the device (before that call runs), once; each replay of the graph checks again.
TEST(CudaIndexGuards, DeviceCheckNamesTheBadEntry) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 273, 285}, {0, 90, 130, 330, 346}, 4, 2, d, DType::kBFloat16);
  {
    VarlenCase first = c;  // an eager call: a captured one cannot allocate the error record
    cuda_varlen_forward(first, KernelFamily::kAuto);
  }
  DeviceVarlen dev(c);
  dev.args.max_seqlen_k = 300;  // so that only cu_seqlens_k[2] is wrong below
  dev.cu_k.upload(int_tensor({0, 90, 80, 330, 346}));
  DeviceCopy out(c.out), lse(c.lse);
  Options opts = c.call_options();
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  opts.stream = s;
  EXPECT_NO_THROW(varlen_forward(dev.args, out.view(), lse.view(), opts));
  FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  FA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  FA_CUDA_OK(cudaGraphLaunch(exec, s));
  FA_CUDA_OK(cudaStreamSynchronize(s));
  const std::string what = expect_recorded_index_error({"cu_seqlens_k"}, "varlen_forward");
  EXPECT_NE(what.find("expected cu_seqlens_k[2] in [90, 346]"), std::string::npos) << what;
  EXPECT_NE(what.find("got cu_seqlens_k[2] = 80 (found on cuda:0"), std::string::npos) << what;

  // Replayed: checked again; nobody calls check_errors, so the next call raises it.
  FA_CUDA_OK(cudaGraphLaunch(exec, s));
  FA_CUDA_OK(cudaStreamSynchronize(s));
  VarlenCase valid = c;
  {
    DeviceVarlen ok(valid);
    DeviceCopy out2(valid.out), lse2(valid.lse);
    try {
      varlen_forward(ok.args, out2.view(), lse2.view(), valid.call_options());
      ADD_FAILURE() << "the call after a replay with a bad cu_seqlens_k raised nothing";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), "cu_seqlens_k") << e.what();
    }
  }
  // Raised once: the same call now runs.
  cuda_varlen_forward(valid, KernelFamily::kAuto);
  expect_forward_matches(valid.problem(), valid.dtype, forward_results(valid));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// seqused_q and block-sparse lists, captured with bad values: the device checks name them
// (check_errors), and the captured calls stay in bounds (memcheck in scripts/gpu.sh).
TEST(CudaIndexGuards, SequsedQAndBlockListsUnderCapture) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 273, 285}, {0, 90, 130, 330, 346}, 4, 2,
                                  built_head_dims({64, 128}).front(), DType::kBFloat16);
  {
    VarlenCase first = c;  // an eager call: a captured one cannot allocate the error record
    cuda_varlen_forward(first, KernelFamily::kAuto);
  }
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto captured = [&](auto&& call) {
    cudaGraph_t graph;
    FA_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    EXPECT_NO_THROW(call());
    FA_CUDA_OK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    FA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    FA_CUDA_OK(cudaGraphLaunch(exec, s));
    FA_CUDA_OK(cudaStreamSynchronize(s));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  };
  {
    VarlenCase u = c;
    u.set_seqused_q({5, 0, 250, 3});  // sequence 2 has 203 queries
    DeviceVarlen dev(u);
    DeviceCopy out(u.out), lse(u.lse);
    Options opts = u.call_options();
    opts.stream = s;
    captured([&] { varlen_forward(dev.args, out.view(), lse.view(), opts); });
    const std::string what = expect_recorded_index_error({"seqused_q"}, "varlen_forward");
    EXPECT_NE(what.find("seqused_q[2] in [0, 203]"), std::string::npos) << what;
  }
  {
    // 128 x 128 blocks over max_seqlen 203 x 200: M = N = 2; key block 2 is out of range.
    DeviceVarlen dev(c);
    HostTensor cnt_h(DType::kInt32, {1, 1, 2}), idx_h(DType::kInt32, {1, 1, 2, 2});
    const int cnt_v[2] = {1, 2}, idx_v[4] = {2, 0, 1, 0};
    for (int i = 0; i < 2; ++i) cnt_h.as<std::int32_t>()[i] = cnt_v[i];
    for (int i = 0; i < 4; ++i) idx_h.as<std::int32_t>()[i] = idx_v[i];
    DeviceCopy out(c.out), lse(c.lse), cnt(cnt_h), idx(idx_h);
    Options opts = c.call_options();
    opts.stream = s;
    opts.block_sparse.mask_block_cnt = cnt.view();
    opts.block_sparse.mask_block_idx = idx.view();
    captured([&] { varlen_forward(dev.args, out.view(), lse.view(), opts); });
    const std::string what = expect_recorded_index_error({"opts.block_sparse.mask_block_idx"}, "varlen_forward");
    EXPECT_NE(what.find("values in [0, 1]"), std::string::npos) << what;
  }
  cudaStreamDestroy(s);
}

// The default: an eager call neither copies its index tensors to the host nor waits for its
// stream (it returns while a gate holds the stream), a bad value is no error of the call,
// and check_errors() raises it after the stream's work, naming the tensor, the entry and the
// value. The host path (FLASHATTN_DEVICE_INDEX_CHECKS=0) waits for the stream and raises
// from the call: the gate detects that wait. Where kernel launches themselves wait for the
// stream (a dense forward, which reads nothing back, does too: compute-sanitizer), the
// gates would measure the tool: the calls then run ungated, the rest is checked.
TEST(CudaIndexGuards, EagerCallsCheckOnTheDeviceByDefault) {
  FA_REQUIRE_GPU();
  const char* env = std::getenv("FLASHATTN_DEVICE_INDEX_CHECKS");
  EXPECT_EQ(detail::cuda::eager_index_checks_on_device(), env == nullptr || std::string(env) != "0")
      << "eager calls check on the device unless FLASHATTN_DEVICE_INDEX_CHECKS=0";
  const IndexCheckPathScope device(detail::cuda::IndexCheckPath::kDevice);
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  cudaStream_t s;
  FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_NO_THROW(check_errors(0)) << "an error left pending before this test";

  bool gated = true;
  {
    DenseCase dc = DenseCase::random(rng, Shape{1, 64, 64, 2, 2, d}, DType::kBFloat16);
    DeviceCopy q(dc.q), k(dc.k), v(dc.v), out(dc.out), lse(dc.lse);
    Options o = dc.call_options();
    o.stream = s;
    EXPECT_NO_THROW(flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o));  // loads it
    FA_CUDA_OK(cudaDeviceSynchronize());
    StreamGate gate(s, std::chrono::seconds(2));
    EXPECT_NO_THROW(flashattn::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o));
    // FLASHATTN_TEST_UNGATED=1 (scripts/gpu.sh under compute-sanitizer): initcheck makes the
    // varlen call below wait for its stream although the dense call here does not.
    gated = !gate.timed_out() && std::getenv("FLASHATTN_TEST_UNGATED") == nullptr;
    gate.open();
    FA_CUDA_OK(cudaStreamSynchronize(s));
  }
  if (!gated) std::printf("note: kernel launches wait for their stream here; the calls run ungated\n");
  const auto gate_for = [&](std::chrono::milliseconds limit) {
    return gated ? std::make_unique<StreamGate>(s, limit) : nullptr;
  };

  // Varlen: cu_seqlens_k[2] = 80 < cu_seqlens_k[1] = 90.
  VarlenCase c = VarlenCase::make(rng, {0, 70, 70, 273, 285}, {0, 90, 130, 330, 346}, 4, 2, d, DType::kBFloat16);
  {
    VarlenCase first = c;  // loads the kernels and allocates the error record
    cuda_varlen_forward(first, KernelFamily::kAuto);
  }
  {
    DeviceVarlen dev(c);
    dev.args.max_seqlen_k = 300;  // so that only cu_seqlens_k[2] is wrong
    dev.cu_k.upload(int_tensor({0, 90, 80, 330, 346}));
    VarlenCase got = c;
    got.poison_forward();
    DeviceCopy out(got.out), lse(got.lse);
    Options opts = c.call_options();
    opts.stream = s;
    FA_CUDA_OK(cudaDeviceSynchronize());  // the uploads (legacy stream) before s uses them
    const auto gate = gate_for(std::chrono::seconds(10));
    EXPECT_NO_THROW(varlen_forward(dev.args, out.view(), lse.view(), opts));
    if (gate) {
      EXPECT_FALSE(gate->timed_out()) << "the eager call waited for its stream";
      EXPECT_NO_THROW(check_errors(0)) << "raised before the check ran (the gate holds the stream)";
      gate->open();
    }
    FA_CUDA_OK(cudaStreamSynchronize(s));
    const std::string what = expect_recorded_index_error({"cu_seqlens_k"}, "varlen_forward");
    EXPECT_NE(what.find("expected cu_seqlens_k[2] in [90, 346]"), std::string::npos) << what;
    EXPECT_NE(what.find("got cu_seqlens_k[2] = 80 (found on cuda:0"), std::string::npos) << what;
    out.download(got.out);
    EXPECT_EQ(got.out.count_nan(), 0) << "the call ran (clamped) and wrote out";
  }

  // A paged decode step that appends, with split-KV partials in the caller's workspace:
  // block_table[1][0] (read by sequence 1) past the cache.
  KVCacheConfig cfg;
  cfg.batch = 3;
  cfg.h_q = 4;
  cfg.h_k = 2;
  cfg.d = d;
  cfg.s_new = 1;
  cfg.dtype = DType::kFloat16;
  cfg.cache_lens = {10 + uniform_int(rng, 0, 50), 20 + uniform_int(rng, 0, 50), 30 + uniform_int(rng, 0, 50)};
  cfg.block_size = 16;
  KVCacheCase kc = KVCacheCase::make(rng, cfg);
  kc.num_splits = 3;
  {
    DeviceCase dev(kc);
    dev.reset(kc);
    const std::size_t ws_bytes = kvcache_workspace_size(dev.args, dev.opts);
    void* ws = nullptr;
    FA_CUDA_OK(cudaMalloc(&ws, ws_bytes));
    Options opts = dev.opts;
    opts.stream = s;
    // Once with the valid table, ungated: loads the kernels (a lazily loaded module could
    // wait for the device), appends (the caches are restored below).
    FA_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {ws, ws_bytes}));
    FA_CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_NO_THROW(check_errors(0)) << "the valid call";
    kc.block_table[std::size_t(kc.max_blocks)] = kc.num_blocks + 3;
    kc.block_table_t = int_tensor(kc.block_table, {cfg.batch, kc.max_blocks});
    dev.table->upload(kc.block_table_t);
    dev.reset(kc);
    FA_CUDA_OK(cudaDeviceSynchronize());  // the uploads (legacy stream) before s uses them
    const auto gate = gate_for(std::chrono::seconds(10));
    EXPECT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {ws, ws_bytes}));
    if (gate) {
      EXPECT_FALSE(gate->timed_out()) << "the eager call waited for its stream";
      gate->open();
    }
    FA_CUDA_OK(cudaStreamSynchronize(s));
    const std::string what = expect_recorded_index_error({"block_table"}, "kvcache_forward");
    EXPECT_NE(what.find("got block_table[1][0] = " + std::to_string(kc.num_blocks + 3)), std::string::npos) << what;
    cudaFree(ws);
  }

  // The host path: the call waits for the stream (the gate times out first) and raises.
  {
    const IndexCheckPathScope host(detail::cuda::IndexCheckPath::kHost);
    DeviceVarlen dev(c);
    dev.args.max_seqlen_k = 300;
    dev.cu_k.upload(int_tensor({0, 90, 80, 330, 346}));
    VarlenCase got = c;
    got.poison_forward();
    DeviceCopy out(got.out), lse(got.lse);
    Options opts = c.call_options();
    opts.stream = s;
    FA_CUDA_OK(cudaDeviceSynchronize());
    const auto gate = gate_for(std::chrono::milliseconds(500));
    try {
      varlen_forward(dev.args, out.view(), lse.view(), opts);
      ADD_FAILURE() << "the host path did not raise the bad cu_seqlens_k";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.argument(), "cu_seqlens_k") << e.what();
      EXPECT_NE(std::string(e.what()).find("cu_seqlens_k[2] = 80"), std::string::npos) << e.what();
    }
    if (gate) {
      EXPECT_TRUE(gate->timed_out()) << "the host path returned without waiting for its stream";
      gate->open();
    }
    FA_CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_NO_THROW(check_errors(0)) << "the host path records nothing";
    out.download(got.out);
    EXPECT_EQ(got.out.count_nan(), got.out.numel()) << "the rejected call wrote out";
  }
  cudaStreamDestroy(s);
}

// KV-cache appends whose targets conflict, which the host's check_append_targets rejects:
// two sequences appending to one block (paged) or one cache row (dense, cache_batch_idx
// naming a row twice), and a sequence appending to slots of a block that another sequence
// reads cached keys from. On the device (eagerly by default, and under capture) the call
// raises nothing, its append writes nothing (the caches keep every byte), and check_errors()
// names block_table / cache_batch_idx with both targets; the host path raises from the
// call. Blocks shared for reading only (prefix sharing) append as usual. Random contents,
// out poisoned.
TEST(CudaIndexGuards, AppendTargetsWrittenTwice) {
  FA_REQUIRE_GPU();
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  EXPECT_NO_THROW(check_errors(0)) << "an error left pending before this test";
  enum class Path { kEager, kCaptured, kHost };
  enum class Conflict { kTwoAppendsOneBlock, kAppendWhereRead, kTwoAppendsOneRow, kNone };
  for (Conflict conflict : {Conflict::kTwoAppendsOneBlock, Conflict::kAppendWhereRead, Conflict::kTwoAppendsOneRow,
                            Conflict::kNone}) {
    for (Path path : {Path::kEager, Path::kCaptured, Path::kHost}) {
      const bool dense = conflict == Conflict::kTwoAppendsOneRow;
      KVCacheConfig cfg;
      cfg.batch = 4;
      cfg.s_q = 2;
      cfg.s_new = 2;
      cfg.h_q = 4;
      cfg.h_k = 2;
      cfg.d = d;
      cfg.dtype = coin(rng) ? DType::kBFloat16 : DType::kFloat16;
      // Sequence 0 appends at 30..31 (block column 1, slots 14..15, after its cached keys
      // there), 1 at 16..17 (column 1, slots 0..1), 2 at 40..41 (column 2) and reads
      // columns 0 and 1 whole, 3 at 0..1 (column 0, slots 0..1).
      cfg.cache_lens = {30, 16, 40, 0};
      if (dense) {
        cfg.use_batch_idx = true;
        cfg.cache_rows = 6;
      } else {
        cfg.block_size = 16;
        cfg.share_blocks = conflict == Conflict::kNone;  // sequence 1 reads sequence 0's block 0
      }
      KVCacheCase c = KVCacheCase::make(rng, cfg);
      c.num_splits = 1 + static_cast<int>(uniform_int(rng, 0, 2));
      const auto at = [&](int b, int t) -> int& { return c.block_table[std::size_t(b * c.max_blocks + t)]; };
      std::vector<std::string> want;  // fragments of the device check's message
      if (conflict == Conflict::kTwoAppendsOneBlock) {
        at(3, 0) = at(1, 1);
        const std::string blk = std::to_string(at(1, 1));
        want = {"sequence 1 appends to block_table[1][1] = block " + blk + ", slots 0..1",
                "sequence 3 appends to block_table[3][0] = block " + blk + ", slots 0..1"};
      } else if (conflict == Conflict::kAppendWhereRead) {
        at(2, 0) = at(0, 1);
        const std::string blk = std::to_string(at(0, 1));
        want = {"sequence 0 appends to block_table[0][1] = block " + blk + ", slots 14..15, and "
                "sequence 2 reads block_table[2][0] = block " + blk + ", slots 0..15"};
      } else if (conflict == Conflict::kTwoAppendsOneRow) {
        c.batch_idx[3] = c.batch_idx[1];
        const std::string row = std::to_string(c.batch_idx[1]);
        want = {"sequence 1 appends to cache row " + row + ", slots 16..17",
                "sequence 3 appends to cache row " + row + ", slots 0..1"};
      } else {
        ASSERT_EQ(at(1, 0), at(0, 0)) << "the case shares sequence 0's block 0 with sequence 1";
      }
      c.block_table_t = dense ? HostTensor() : int_tensor(c.block_table, {cfg.batch, c.max_blocks});
      c.batch_idx_t = dense ? int_tensor(c.batch_idx) : HostTensor();
      const char* argument = dense ? "cache_batch_idx" : "block_table";
      SCOPED_TRACE(std::string(path == Path::kEager ? "eager" : path == Path::kCaptured ? "captured" : "host path") +
                   ", " + argument + ", conflict " + std::to_string(static_cast<int>(conflict)));

      const IndexCheckPathScope scope(path == Path::kHost ? detail::cuda::IndexCheckPath::kHost
                                                          : detail::cuda::IndexCheckPath::kDevice);
      DeviceCase dev(c);
      dev.reset(c);  // out / lse poisoned
      FA_CUDA_OK(cudaDeviceSynchronize());
      const std::size_t ws_bytes = kvcache_workspace_size(dev.args, dev.opts);
      ASSERT_GE(ws_bytes, detail::cuda::kAppendVerdictBytes) << "the append check's verdict is in the workspace";
      void* ws = nullptr;
      FA_CUDA_OK(cudaMalloc(&ws, ws_bytes));
      FA_CUDA_OK(cudaMemset(ws, 0, ws_bytes));
      cudaStream_t s;
      FA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      Options opts = dev.opts;
      opts.stream = s;
      bool raised = false;
      if (path == Path::kCaptured) {
        replay_captured([&](cudaStream_t cs) {
          opts.stream = cs;
          EXPECT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {ws, ws_bytes}));
        });
      } else {
        try {
          kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), opts, {ws, ws_bytes});
        } catch (const InvalidArgument& e) {
          raised = true;
          EXPECT_EQ(e.argument(), argument) << e.what();
          EXPECT_NE(std::string(e.what()).find("expected append targets that no other append and no cached key use"),
                    std::string::npos)
              << e.what();
        }
        FA_CUDA_OK(cudaStreamSynchronize(s));
      }
      HostTensor k_got = c.k_cache, v_got = c.v_cache;
      dev.kc->download(k_got);
      dev.vc->download(v_got);
      if (conflict == Conflict::kNone) {
        EXPECT_FALSE(raised);
        EXPECT_NO_THROW(check_errors(0)) << "prefix sharing for reading is valid";
        EXPECT_TRUE(k_got.bitwise_equal(c.k_cache_expected)) << "k_cache: the append of a valid call";
        EXPECT_TRUE(v_got.bitwise_equal(c.v_cache_expected)) << "v_cache: the append of a valid call";
        dev.out->download(c.out);
        dev.lse->download(c.lse);
        expect_forward_matches(c.problem(), cfg.dtype, forward_results(c));
      } else {
        EXPECT_TRUE(k_got.bitwise_equal(c.k_cache)) << "k_cache changed: a conflicting append wrote";
        EXPECT_TRUE(v_got.bitwise_equal(c.v_cache)) << "v_cache changed: a conflicting append wrote";
        if (path == Path::kHost) {
          EXPECT_TRUE(raised) << "the host path accepted the conflicting append";
          EXPECT_NO_THROW(check_errors(0)) << "the host path records nothing";
        } else {
          EXPECT_FALSE(raised) << "the device path raised from the call";
          const std::string what = expect_recorded_index_error({argument}, "kvcache_forward");
          EXPECT_NE(what.find("expected append targets that no other append and no cached key use"),
                    std::string::npos)
              << what;
          for (const std::string& w : want) EXPECT_NE(what.find(w), std::string::npos) << w << "\n" << what;
          EXPECT_NE(what.find("the append wrote nothing"), std::string::npos) << what;
        }
      }
      cudaStreamDestroy(s);
      cudaFree(ws);
    }
  }
}

// A conflict found only across the device check's windows of kHashWindow = 1024 append
// targets (a long append: 64 sequences of 300 new keys in blocks of 16, 20 targets each),
// in a table whose walk spreads over several check blocks: the last sequence's last new
// block is the first sequence's first one. The call appends nothing; check_errors names
// both.
TEST(CudaIndexGuards, AppendConflictAcrossCheckWindows) {
  FA_REQUIRE_GPU();
  const IndexCheckPathScope device(detail::cuda::IndexCheckPath::kDevice);
  FA_SEEDED_RNG(rng);
  EXPECT_NO_THROW(check_errors(0)) << "an error left pending before this test";
  KVCacheConfig cfg;
  cfg.batch = 64;
  cfg.s_q = 1;
  cfg.s_new = 300;
  cfg.h_q = 2;
  cfg.h_k = 1;
  cfg.d = built_head_dims({64, 128, 256}).front();
  cfg.dtype = DType::kBFloat16;
  cfg.max_cache_len = 2000;  // about 144 block-table columns: 9216 entries, 5 check blocks
  cfg.block_size = 16;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  const int last = cfg.batch - 1;
  const int t_last = (c.cache_lens[std::size_t(last)] + cfg.s_new - 1) / cfg.block_size;
  const int t_first = c.cache_lens[0] / cfg.block_size;
  c.block_table[std::size_t(last * c.max_blocks + t_last)] = c.block_table[std::size_t(t_first)];
  c.block_table_t = int_tensor(c.block_table, {cfg.batch, c.max_blocks});
  DeviceCase dev(c);
  dev.reset(c);
  FA_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_NO_THROW(kvcache_forward(dev.args, dev.out->view(), dev.lse->view(), dev.opts));
  FA_CUDA_OK(cudaDeviceSynchronize());
  HostTensor k_got = c.k_cache;
  dev.kc->download(k_got);
  EXPECT_TRUE(k_got.bitwise_equal(c.k_cache)) << "k_cache changed: a conflicting append wrote";
  const std::string what = expect_recorded_index_error({"block_table"}, "kvcache_forward");
  const std::string blk = " = block " + std::to_string(c.block_table[std::size_t(t_first)]);
  EXPECT_NE(what.find("block_table[0][" + std::to_string(t_first) + "]" + blk), std::string::npos) << what;
  EXPECT_NE(what.find("block_table[" + std::to_string(last) + "][" + std::to_string(t_last) + "]" + blk),
            std::string::npos)
      << what;
}

}  // namespace
}  // namespace flashattn::test
