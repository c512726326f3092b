// CUDA fp8 (e4m3) q, k, v forward (the sm90 fp8 kernel; FlashAttention-3's per-(sequence,
// KV head) descales) through the public API: forward and varlen_forward against the fp64
// oracle over the DEQUANTIZED inputs, each output element and lse within the bound of a
// kernel that rounds P to e4m3 before the P V product (support/fp8_bound.hpp, derived from
// the data; the failure message gives the measured fraction of it), with the CPU backend's
// fp8 forward of the same inputs checked against the same bound beside it. Fresh random
// inputs with random descales per (sequence, KV head) and an omitted descale (= 1), NaN-
// poisoned out and lse (checked fully written), odd lengths (1, 77, 300, 1000), head dims
// 128 and 256, causal / window / GQA / MQA / varlen with seqused_k and an empty sequence /
// softcap / ALiBi / learnable sink, bf16 and fp16 outputs. And the rules on a device: with
// fp8 on CUDA, dropout, return_probs and a block-sparse mask are Unsupported naming the
// option, a descale that is not a contiguous [b, h_k] is an InvalidArgument naming it;
// nothing is written. (kvcache_forward with fp8 q runs on CUDA in the decode kernel:
// test_cuda_kvcache_fp8q.cpp.)
//
// The accuracy tests skip without a GPU or on one that is not sm90 (compute capability
// 9.x); the rules skip only without a GPU (they fail before any kernel).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/backend.hpp"
#include "cuda/device_copy.hpp"
#include "cuda/device_runs.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/describe.hpp"
#include "support/fp8_bound.hpp"
#include "support/random.hpp"

#define FA_SKIP_UNDER_SM80_ENV()                                                                \
  do {                                                                                          \
    const char* f_ = std::getenv("FLASHATTN_KERNEL_FAMILY");                                   \
    if (f_ != nullptr && std::string(f_) == "sm80")                                             \
      GTEST_SKIP() << "FLASHATTN_KERNEL_FAMILY=sm80: the fp8 forward is the sm90 family's";    \
    if (env_smem_cap() > 0) GTEST_SKIP() << "FLASHATTN_SMEM_CAP: the fp8 forward is the sm90 family's"; \
  } while (0)

// The fp8 forward is the sm90 family's: compute capability 9.x, and not where gpu.sh's
// reruns force the sm80 family or emulate a 99 KiB part through the environment.
#define FA_REQUIRE_SM90()                                                                       \
  do {                                                                                          \
    FA_REQUIRE_GPU();                                                                           \
    const int cc_ = detail::cuda::compute_capability(0);                                       \
    if (cc_ / 10 != 9) {                                                                        \
      GTEST_SKIP() << "the fp8 forward runs on sm90 (compute capability 9.x); this GPU is "   \
                   << cc_ / 10 << "." << cc_ % 10;                                              \
    }                                                                                           \
    FA_SKIP_UNDER_SM80_ENV();                                                                   \
  } while (0)

namespace flashattn::test {
namespace {

// Device copies of what a call reads besides q, k, v: the descales (undefined stays
// undefined), ALiBi slopes and the sink; `opts` is the case's Options pointing at them.
struct DeviceOptions {
  std::unique_ptr<DeviceCopy> q_descale, k_descale, v_descale, alibi, sink;
  Options opts;
  DeviceOptions(Options host, const Fp8Inputs& q8, const std::vector<float>& alibi_host,
                const HostTensor& alibi_t, const SinkInputs& sink_in)
      : opts(std::move(host)) {
    q_descale = std::make_unique<DeviceCopy>(q8.q_descale);
    k_descale = std::make_unique<DeviceCopy>(q8.k_descale);
    v_descale = std::make_unique<DeviceCopy>(q8.v_descale);
    opts.q_descale = q_descale->view();
    opts.k_descale = k_descale->view();
    opts.v_descale = v_descale->view();
    opts.alibi_slopes = Tensor{};
    if (!alibi_host.empty()) {
      alibi = std::make_unique<DeviceCopy>(alibi_t);
      opts.alibi_slopes = alibi->view();
    }
    opts.learnable_sink = Tensor{};
    opts.learnable_sink_grad = Tensor{};
    if (!sink_in.logits.empty()) {
      sink = std::make_unique<DeviceCopy>(sink_in.tensor);
      opts.learnable_sink = sink->view();
    }
  }
};

// out / lse of the device run against the oracle under the fp8 bound, and the CPU backend's
// results (already in `cpu`) under the same bound; prints both fractions.
void check_against_bound(const std::string& name, const RefProblem& p, DType out_dtype,
                         const ForwardResults& gpu, const ForwardResults& cpu) {
  const std::vector<RefOutput> ref = reference_forward(p);
  const Fp8PBound bound = fp8_p_quantized_bound(p, ref, out_dtype);
  const std::vector<double> ref_out = concat_out(ref), ref_lse = concat_lse(ref);
  EXPECT_TRUE(fully_written("out", gpu.out));
  EXPECT_TRUE(fully_written("lse", gpu.lse));
  double out_frac = 0, lse_frac = 0, cpu_frac = 0;
  EXPECT_TRUE(within_fp8_bound("CUDA fp8 out", gpu.out, ref_out, bound.out, &out_frac));
  EXPECT_TRUE(within_fp8_bound("CUDA fp8 lse", gpu.lse, ref_lse, bound.lse, &lse_frac));
  EXPECT_TRUE(within_fp8_bound("CPU fp8 out", cpu.out, ref_out, bound.out, &cpu_frac));
  std::printf("fp8 %s: max |err| / bound: CUDA out %.3f, lse %.3f; CPU backend out %.3f\n", name.c_str(),
              out_frac, lse_frac, cpu_frac);
}

// ------------------------------------------------------------------ dense

struct DenseFp8 {
  const char* name;
  int batch, s_q, s_k, h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  int alibi;  // 0 off, 1 [h_q], 2 [b, h_q]
  bool sink;
  char omit;  // descale left undefined: 'q', 'k', 'v' or 0
  DType out;
};

void PrintTo(const DenseFp8& f, std::ostream* os) { *os << f.name; }

class CudaFp8Dense : public ::testing::TestWithParam<DenseFp8> {};

TEST_P(CudaFp8Dense, WithinTheFp8BoundOfTheOracle) {
  FA_REQUIRE_SM90();
  const DenseFp8 f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim " << f.d << " not in this build";
  FA_SEEDED_RNG(rng);
  DenseCase c = DenseCase::random(rng, {f.batch, f.s_q, f.s_k, f.h_q, f.h_k, f.d}, DType::kFloat32);
  const Fp8Inputs q8 = quantize_fp8_random_descales(c, rng, f.omit);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  if (f.alibi > 0) c.set_alibi(random_alibi(rng, f.batch, f.h_q, f.alibi == 2), f.alibi == 2);
  if (f.sink) c.sink.set(random_sink(rng, f.h_q));
  c.sink.want_grad = false;
  c.out = HostTensor(f.out, {f.batch, f.s_q, f.h_q, f.d});
  Options host_opts = c.call_options();
  q8.apply(host_opts);
  SCOPED_TRACE(std::string(f.name) + " " + c.shape.str() + " out " + dtype_name(f.out) + " " + describe(host_opts));

  // The CPU backend: the same call on host tensors.
  c.poison_forward();
  ASSERT_NO_THROW(forward(q8.q.view(), q8.k.view(), q8.v.view(), c.out.view(), c.lse.view(), host_opts));
  const ForwardResults cpu = forward_results(c);

  c.poison_forward();
  {
    DeviceCopy q(q8.q), k(q8.k), v(q8.v), out(c.out), lse(c.lse);
    const DeviceOptions dev(host_opts, q8, c.alibi, c.alibi_tensor, c.sink);
    ASSERT_NO_THROW(forward(q.view(), k.view(), v.view(), out.view(), lse.view(), dev.opts));
    FA_CUDA_OK(cudaDeviceSynchronize());
    out.download(c.out);
    lse.download(c.lse);
  }
  check_against_bound(f.name, c.problem(), f.out, forward_results(c), cpu);
}

constexpr DType kBf16 = DType::kBFloat16, kFp16 = DType::kFloat16;

INSTANTIATE_TEST_SUITE_P(
    Features, CudaFp8Dense,
    ::testing::Values(
        DenseFp8{"plain_d128", 2, 77, 300, 4, 4, 128, false, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"plain_d256_fp16", 2, 300, 77, 2, 2, 256, false, -1, -1, 0.f, 0, false, 0, kFp16},
        DenseFp8{"causal_gqa_d128", 2, 300, 1000, 8, 2, 128, true, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"causal_sq_gt_sk_mqa_d256", 2, 300, 77, 4, 1, 256, true, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"window_mqa_d128", 1, 1000, 1000, 4, 1, 128, false, 100, 17, 0.f, 0, false, 0, kBf16},
        DenseFp8{"window_left_causal_d256", 1, 1000, 300, 2, 2, 256, false, 64, 0, 0.f, 0, false, 0, kBf16},
        DenseFp8{"decode_gqa_d128", 3, 1, 1000, 8, 2, 128, false, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"one_by_one_d128", 2, 1, 1, 2, 1, 128, false, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"softcap_d256", 1, 77, 1000, 4, 2, 256, false, -1, -1, 30.f, 0, false, 0, kBf16},
        DenseFp8{"softcap_causal_fp16_d128", 2, 300, 300, 2, 1, 128, true, -1, -1, 5.f, 0, false, 0, kFp16},
        DenseFp8{"alibi_sink_causal_d128", 2, 300, 300, 4, 2, 128, true, -1, -1, 0.f, 2, true, 0, kBf16},
        DenseFp8{"alibi_sink_d256", 1, 77, 300, 4, 2, 256, false, -1, -1, 0.f, 1, true, 0, kBf16},
        DenseFp8{"omit_q_descale_d128", 2, 77, 300, 4, 2, 128, false, -1, -1, 0.f, 0, false, 'q', kBf16},
        DenseFp8{"omit_k_descale_causal_d256", 2, 77, 300, 4, 2, 256, true, -1, -1, 0.f, 0, false, 'k', kBf16},
        DenseFp8{"omit_v_descale_sink_d128", 2, 300, 77, 2, 1, 128, false, -1, -1, 0.f, 0, true, 'v', kFp16},
        // The other buckets and head dims inside them (columns past d zero-filled by the copies).
        DenseFp8{"plain_d64", 2, 77, 300, 4, 4, 64, false, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"causal_gqa_d64_fp16", 2, 300, 1000, 8, 2, 64, true, -1, -1, 0.f, 0, false, 0, kFp16},
        DenseFp8{"window_mqa_d32", 1, 300, 300, 2, 1, 32, false, 64, 16, 0.f, 0, false, 0, kBf16},
        DenseFp8{"causal_d96", 2, 300, 300, 2, 2, 96, true, -1, -1, 0.f, 0, false, 0, kBf16},
        DenseFp8{"softcap_sink_d192", 1, 77, 300, 2, 1, 192, false, -1, -1, 10.f, 0, true, 0, kBf16}),
    [](const auto& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------ varlen

struct VarlenFp8 {
  const char* name;
  std::vector<int> len_q, len_k;
  int h_q, h_k, d;
  bool causal;
  int left, right;
  float softcap;
  bool seqused, alibi, sink;
  char omit;
  DType out;
};

void PrintTo(const VarlenFp8& f, std::ostream* os) { *os << f.name; }

class CudaFp8Varlen : public ::testing::TestWithParam<VarlenFp8> {};

TEST_P(CudaFp8Varlen, WithinTheFp8BoundOfTheOracle) {
  FA_REQUIRE_SM90();
  const VarlenFp8 f = GetParam();
  if (!detail::cuda::supports_head_dim(f.d)) GTEST_SKIP() << "head dim " << f.d << " not in this build";
  FA_SEEDED_RNG(rng);
  VarlenCase c = VarlenCase::make(rng, offsets(f.len_q), offsets(f.len_k), f.h_q, f.h_k, f.d, DType::kFloat32,
                                  /*pad_q=*/3, /*pad_k=*/5);
  if (f.seqused) {
    std::vector<int> used;
    for (int b = 0; b < c.batch(); ++b) used.push_back(uniform_int(rng, 0, c.len_k(b)));
    c.set_seqused_k(used);
  }
  const Fp8Inputs q8 = quantize_fp8_random_descales(c, rng, f.omit);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  if (f.alibi) c.set_alibi(random_alibi(rng, c.batch(), f.h_q, true), true);
  if (f.sink) c.sink.set(random_sink(rng, f.h_q));
  c.sink.want_grad = false;
  c.out = HostTensor(f.out, {c.total_q, f.h_q, f.d});
  Options host_opts = c.call_options();
  q8.apply(host_opts);
  SCOPED_TRACE(std::string(f.name) + " " + describe(host_opts));

  VarlenArgs host_args = c.args();
  host_args.q = q8.q.view();
  host_args.k = q8.k.view();
  host_args.v = q8.v.view();
  c.poison_forward();
  ASSERT_NO_THROW(varlen_forward(host_args, c.out.view(), c.lse.view(), host_opts));
  const ForwardResults cpu = forward_results(c);

  c.poison_forward();
  {
    DeviceCopy q(q8.q), k(q8.k), v(q8.v), cu_q(c.cu_q_t), cu_k(c.cu_k_t), out(c.out), lse(c.lse);
    std::unique_ptr<DeviceCopy> used;
    VarlenArgs a = host_args;
    a.q = q.view();
    a.k = k.view();
    a.v = v.view();
    a.cu_seqlens_q = cu_q.view();
    a.cu_seqlens_k = cu_k.view();
    if (!c.seqused_k.empty()) {
      used = std::make_unique<DeviceCopy>(c.seqused_t);
      a.seqused_k = used->view();
    }
    const DeviceOptions dev(host_opts, q8, c.alibi, c.alibi_tensor, c.sink);
    ASSERT_NO_THROW(varlen_forward(a, out.view(), lse.view(), dev.opts));
    FA_CUDA_OK(cudaDeviceSynchronize());
    out.download(c.out);
    lse.download(c.lse);
  }
  check_against_bound(f.name, c.problem(), f.out, forward_results(c), cpu);
}

INSTANTIATE_TEST_SUITE_P(
    Packs, CudaFp8Varlen,
    ::testing::Values(
        VarlenFp8{"plain_gqa_d128", {1, 77, 300}, {300, 1, 1000}, 4, 2, 128, false, -1, -1, 0.f, false, false, false, 0,
                  kBf16},
        VarlenFp8{"causal_seqused_k_mqa_d128", {77, 300, 1}, {1000, 300, 77}, 8, 1, 128, true, -1, -1, 0.f, true,
                  false, false, 0, kBf16},
        VarlenFp8{"window_softcap_sink_d256", {300, 1000}, {300, 1000}, 2, 2, 256, false, 50, 50, 20.f, false, false,
                  true, 0, kBf16},
        VarlenFp8{"alibi_empty_seq_omit_v_d256", {77, 0, 300}, {300, 5, 0}, 4, 2, 256, true, -1, -1, 0.f, false, true,
                  false, 'v', kFp16},
        VarlenFp8{"seqused_k_sink_omit_k_d128", {1000, 1}, {1000, 1000}, 4, 4, 128, false, -1, -1, 0.f, true, false,
                  true, 'k', kBf16},
        VarlenFp8{"causal_seqused_k_gqa_d64", {77, 300, 1}, {1000, 300, 77}, 4, 2, 64, true, -1, -1, 0.f, true, false,
                  false, 0, kBf16}),
    [](const auto& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------ rules on a device

// A small fp8 problem on the device (b 2, s 8, h 2 / 1, d 128, bf16 out poisoned with NaN).
class CudaFp8Rules : public ::testing::Test {
 protected:
  static constexpr int b = 2, s = 8, h_q = 2, h_k = 1, d = 128;
  void SetUp() override {
    FA_REQUIRE_GPU();
    FA_SKIP_UNDER_SM80_ENV();
    Rng rng(0xF8C0);
    c_ = std::make_unique<DenseCase>(DenseCase::random(rng, {b, s, s, h_q, h_k, d}, DType::kFloat32));
    q8_ = quantize_fp8(*c_);
    c_->out = HostTensor(DType::kBFloat16, {b, s, h_q, d});
    c_->poison_forward();
    q_ = std::make_unique<DeviceCopy>(q8_.q);
    k_ = std::make_unique<DeviceCopy>(q8_.k);
    v_ = std::make_unique<DeviceCopy>(q8_.v);
    out_ = std::make_unique<DeviceCopy>(c_->out);
    lse_ = std::make_unique<DeviceCopy>(c_->lse);
    qd_ = std::make_unique<DeviceCopy>(q8_.q_descale);
    kd_ = std::make_unique<DeviceCopy>(q8_.k_descale);
    vd_ = std::make_unique<DeviceCopy>(q8_.v_descale);
    opts_.q_descale = qd_->view();
    opts_.k_descale = kd_->view();
    opts_.v_descale = vd_->view();
  }
  // The message of the error `call` raises (its type checked), and that out / lse are
  // still their poison.
  template <class E, class F>
  std::string error_of(F&& call) {
    std::string m = "no exception";
    try {
      call();
    } catch (const E& e) {
      m = e.what();
    } catch (const std::exception& e) {
      m = std::string("another exception: ") + e.what();
    }
    expect_cuda_ok(cudaDeviceSynchronize());
    HostTensor o = c_->out, l = c_->lse;
    out_->download(o);
    lse_->download(l);
    EXPECT_EQ(o.count_nan(), o.numel()) << "out was written by a rejected call";
    EXPECT_EQ(l.count_nan(), l.numel()) << "lse was written by a rejected call";
    return m;
  }
  void fwd(const Options& opts) { forward(q_->view(), k_->view(), v_->view(), out_->view(), lse_->view(), opts); }
  static void expect_cuda_ok(cudaError_t e) { EXPECT_EQ(e, cudaSuccess); }

  std::unique_ptr<DenseCase> c_;
  Fp8Inputs q8_;
  std::unique_ptr<DeviceCopy> q_, k_, v_, out_, lse_, qd_, kd_, vd_;
  Options opts_;
};

TEST_F(CudaFp8Rules, DropoutIsUnsupported) {
  Options o = opts_;
  o.dropout_p = 0.25f;
  const std::string m = error_of<Unsupported>([&] { fwd(o); });
  EXPECT_NE(m.find("argument 'opts.dropout_p': expected 0 with float8_e4m3 q, k, v on CUDA"), std::string::npos) << m;
}

TEST_F(CudaFp8Rules, ReturnProbsIsUnsupported) {
  HostTensor probs_h(DType::kFloat32, {b, h_q, s, s});
  probs_h.fill_nan();
  DeviceCopy probs(probs_h);
  Options o = opts_;
  o.return_probs = probs.view();
  const std::string m = error_of<Unsupported>([&] { fwd(o); });
  EXPECT_NE(m.find("argument 'opts.return_probs': expected an undefined tensor with float8_e4m3 q, k, v on CUDA"),
            std::string::npos)
      << m;
}

TEST_F(CudaFp8Rules, BlockSparseIsUnsupported) {
  const HostTensor cnt_h = int_tensor({1, 1, 1, 1}, {b, h_q, 1});
  const HostTensor idx_h = int_tensor({0, 0, 0, 0}, {b, h_q, 1, 1});
  DeviceCopy cnt(cnt_h), idx(idx_h);
  Options o = opts_;
  o.block_sparse.mask_block_cnt = cnt.view();
  o.block_sparse.mask_block_idx = idx.view();
  const std::string m = error_of<Unsupported>([&] { fwd(o); });
  EXPECT_NE(m.find("argument 'opts.block_sparse': expected undefined lists with float8_e4m3 q, k, v on CUDA"),
            std::string::npos)
      << m;
}

TEST_F(CudaFp8Rules, VarlenDropoutIsUnsupported) {
  const HostTensor cu_h = int_tensor({0, s, 2 * s});
  DeviceCopy cu(cu_h);
  VarlenArgs a;
  a.q = q_->view();
  a.k = k_->view();
  a.v = v_->view();
  for (Tensor* t : {&a.q, &a.k, &a.v}) {  // [b * s, h, d] views of the dense tensors
    *t = Tensor::contiguous(t->data, t->dtype, {b * s, t->shape[2], d}, Device::cuda(0));
  }
  a.cu_seqlens_q = cu.view();
  a.cu_seqlens_k = cu.view();
  a.max_seqlen_q = a.max_seqlen_k = s;
  Options o = opts_;
  o.dropout_p = 0.5f;
  const Tensor out = Tensor::contiguous(out_->data(), DType::kBFloat16, {b * s, h_q, d}, Device::cuda(0));
  const Tensor lse = Tensor::contiguous(lse_->data(), DType::kFloat32, {h_q, b * s}, Device::cuda(0));
  const std::string m = error_of<Unsupported>([&] { varlen_forward(a, out, lse, o); });
  EXPECT_NE(m.find("flashattn::varlen_forward: argument 'opts.dropout_p'"), std::string::npos) << m;
}

TEST_F(CudaFp8Rules, PaddedDescaleIsInvalid) {
  // [b, h_k] with a row stride of 4: not the contiguous [b, h_k] the kernel reads.
  HostTensor padded_h(DType::kFloat32, {b, 4});
  padded_h.fill(0.5);
  DeviceCopy padded(padded_h);
  Options o = opts_;
  o.k_descale = Tensor::strided(padded.data(), DType::kFloat32, {b, h_k}, {4, 1}, Device::cuda(0));
  const std::string m = error_of<InvalidArgument>([&] { fwd(o); });
  EXPECT_NE(m.find("argument 'opts.k_descale': expected stride[0] == 1 (h_k: contiguous [b, h_k]"), std::string::npos)
      << m;
  EXPECT_NE(m.find("got 4"), std::string::npos) << m;
}

TEST_F(CudaFp8Rules, BackwardIsUnsupported) {
  HostTensor g_h(DType::kFloat8E4M3, {b, s, h_q, d}), gk_h(DType::kFloat8E4M3, {b, s, h_k, d});
  DeviceCopy dq(g_h), dk(gk_h), dv(gk_h);
  const std::string m = error_of<Unsupported>([&] {
    backward(out_->view(), q_->view(), k_->view(), v_->view(), out_->view(), lse_->view(), dq.view(), dk.view(),
             dv.view(), opts_);
  });
  EXPECT_NE(m.find("argument 'q'"), std::string::npos) << m;
  EXPECT_NE(m.find("no backward for float8_e4m3"), std::string::npos) << m;
}

}  // namespace
}  // namespace flashattn::test
