// CUDA: index tensors the host could not check (docs/semantics.md, "Index tensors the host
// could not check"). Under CUDA graph capture the host skips its checks of cu_seqlens,
// seqused_k, cache_seqlens, cache_batch_idx and block_table; these tests capture calls whose
// index tensors hold out-of-range values and replay them. Each expects no CUDA error (run
// under compute-sanitizer memcheck for the out-of-bounds proof), and the documented result:
// the clamped indices compute exactly what an eager call with the clamped values computes
// (bit for bit), an append whose destination is out of range writes nothing, and nothing
// outside the valid sequences' outputs and append slots changes; and the device check of
// the indices (flashattn::check_errors, core/backend.hpp) reports the bad value afterwards.
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/device_runs.hpp"
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

// FLASHATTN_DEVICE_INDEX_CHECKS=1 (run the suite once with it): eager calls do not copy the
// indices to the host nor synchronise; a bad value is not an error of the call itself but
// of check_errors() after the stream's work, and the kernels clamp it meanwhile.
TEST(CudaIndexGuards, EagerDeviceChecksWithTheEnvironmentSwitch) {
  FA_REQUIRE_GPU();
  if (!detail::cuda::device_index_checks_only()) GTEST_SKIP() << "FLASHATTN_DEVICE_INDEX_CHECKS is not 1";
  FA_SEEDED_RNG(rng);
  const int d = built_head_dims({64, 128, 256}).front();
  KVCacheConfig cfg;
  cfg.batch = 3;
  cfg.h_q = 4;
  cfg.h_k = 2;
  cfg.d = d;
  cfg.s_new = 1;
  cfg.dtype = DType::kFloat16;
  cfg.cache_lens = {10, 20, 30};
  cfg.block_size = 16;
  KVCacheCase c = KVCacheCase::make(rng, cfg);
  c.block_table[std::size_t(c.max_blocks)] = c.num_blocks + 3;  // block_table[1][0], read by sequence 1
  c.block_table_t = int_tensor(c.block_table, {cfg.batch, c.max_blocks});
  EXPECT_NO_THROW(cuda_kvcache(c, KernelFamily::kAuto));  // synchronises after the call
  const std::string what = expect_recorded_index_error({"block_table"}, "kvcache_forward");
  EXPECT_NE(what.find("block_table[1][0] = " + std::to_string(c.num_blocks + 3)), std::string::npos) << what;
}

}  // namespace
}  // namespace flashattn::test
