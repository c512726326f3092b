// Dense-batch entry points and utilities: argument checking, then dispatch.
#include "flashattn/attention.hpp"

#include <cstdint>
#include <vector>

#include "api/check.hpp"
#include "api/dispatch.hpp"
#include "core/backend.hpp"

#ifndef FLASHATTN_VERSION
#error "FLASHATTN_VERSION is defined by the build"
#endif

namespace flashattn {

namespace {

using detail::BwdParams;
using detail::FwdParams;
using detail::api::Check;
using detail::api::Scratch;
using detail::api::Target;
using detail::api::to_int;

constexpr const char* kNoFp8Backward =
    "there is no backward for float8_e4m3 q, k, v, as in FlashAttention-3: the fp8 forward is "
    "for inference";

struct DenseDims {
  int b, s_q, s_k, h_q, h_k, d, d_v;
};

// q [b, s_q, h_q, d]; k [b, s_k, h_k, d]; v [b, s_k, h_k, d_v] with h_q % h_k == 0.
DenseDims check_qkv(const Check& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  c.rank("q", q, 4, "[b, s_q, h_q, d]");
  c.layout("q", q);
  detail::api::check_query_heads(c, q, 2);
  c.rank("k", k, 4, "[b, s_k, h_k, d]");
  c.layout("k", k);
  c.dim("k", k, 0, q.shape[0], "batch of q");
  c.dim("k", k, 3, q.shape[3], "head dim of q");
  detail::api::check_kv_heads(c, "k", k, 2, q.shape[2]);
  c.dtype("k", k, q.dtype, "same as q");
  c.device("k", k, q.device, "same as q");
  c.rank("v", v, 4, "[b, s_k, h_k, d_v]");
  c.like_head_dim("v", v, "k", k, v.shape[3], "same as k but any head dim d_v");
  return {to_int(q.shape[0]), to_int(q.shape[1]), to_int(k.shape[1]),
          to_int(q.shape[2]), to_int(k.shape[2]), to_int(q.shape[3]), to_int(v.shape[3])};
}

// Options, backend, backend support and CUDA layouts of q, k, v: what every dense
// entry point checks after the shapes (`call`: the forward's head-dim limits or the
// backward's). fp8 q reaches it only from forward (the backward entry points reject it
// first): on CUDA, the sm90 fp8 forward's rules (check_fp8_cuda).
Target check_dense_options(const Check& c, const Options& opts, const DenseDims& dims,
                           const Tensor& q, const Tensor& k, const Tensor& v, FwdParams& p,
                           detail::api::CudaCall call) {
  detail::api::fill_options(c, opts, q.device, dims.b, dims.h_q,
                            detail::api::scale_dim(opts, dims.d, dims.d_v), p);
  const Target target = detail::api::resolve_target(c, opts, q.device);
  detail::api::check_fp8_cuda(c, opts, q, target == Target::kCUDA, dims.b, dims.h_k);
  // With qv (forward only: the backward rejects it before) the MLA kernel's head dims.
  detail::api::check_supported(c, target, q.dtype, dims.d, dims.d_v, dims.b, dims.h_q,
                               opts.qv.defined() ? detail::api::CudaCall::kMla : call);
  detail::api::check_qv_target(c, opts, target == Target::kCUDA);
  detail::api::check_cuda_layouts(c, target, {{"q", q}, {"k", k}, {"v", v}});
  return target;
}

void set_dense_inputs(const DenseDims& dims, const Tensor& q, const Tensor& k, const Tensor& v,
                      FwdParams& p) {
  detail::api::set_qkv(q, k, v, p);
  p.batch = dims.b;
  p.seqlen_q = dims.s_q;
  p.seqlen_k = dims.s_k;
  p.num_splits = 1;
}

// lse [b, h_q, s_q] (dense); may be undefined.
void set_dense_lse(const Tensor& lse, FwdParams& p) {
  if (!lse.defined()) return;
  p.lse = static_cast<float*>(lse.data);
  p.lse_batch_stride = lse.stride[0];
  p.lse_head_stride = lse.stride[1];
}

}  // namespace

void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
             const Tensor& lse, const Options& opts) {
  const Check c("forward");
  const DenseDims dims = check_qkv(c, q, k, v);
  detail::api::check_fp8(c, opts, q, dims.b, dims.h_k);
  detail::api::check_out(c, out, q, dims.d_v);
  detail::api::check_qv(c, opts, q, dims.d_v);
  if (lse.defined()) {
    c.tensor("lse", lse, {dims.b, dims.h_q, dims.s_q}, "[b, h_q, s_q]", DType::kFloat32,
             q.device);
  }
  FwdParams p;
  const Target target = check_dense_options(c, opts, dims, q, k, v, p, detail::api::CudaCall::kForward);
  std::vector<std::uint8_t> block_kinds;
  detail::api::fill_block_sparse(c, opts, target == Target::kCPU, q.device,
                                 {dims.b, dims.h_q, dims.s_q, dims.s_k}, block_kinds, p);
  detail::api::check_cuda_layouts(c, target, {{"out", out}});
  detail::api::fill_probs(c, opts, target == Target::kCPU, q.device,
                          {dims.b, dims.h_q, dims.s_q, dims.s_k}, p);
  c.no_overlap({{"out", out}, {"lse", lse}, {"opts.return_probs", opts.return_probs}},
               {{"q", q}, {"k", k}, {"v", v}, {"opts.alibi_slopes", opts.alibi_slopes},
                {"opts.learnable_sink", opts.learnable_sink}, {"opts.qv", opts.qv},
                {"opts.q_descale", opts.q_descale}, {"opts.k_descale", opts.k_descale},
                {"opts.v_descale", opts.v_descale}});

  set_dense_inputs(dims, q, k, v, p);
  detail::api::set_qv(opts.qv, p);
  detail::api::set_out(out, p);
  std::vector<float> descales;  // fp8 q on the CPU: the descales, read on the host
  detail::api::set_fp8(opts, out, target == Target::kCUDA, p, descales);
  set_dense_lse(lse, p);
  detail::api::check_cuda_forward_rows(c, target, p);
  Scratch scratch;
  detail::api::attach_workspace(c, target, {}, detail::api::forward_workspace_size(target, p), p,
                                scratch);
  detail::api::run_forward(target, p);
}

void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
              const Tensor& dv, const Options& opts, Workspace workspace) {
  const Check c("backward");
  const DenseDims dims = check_qkv(c, q, k, v);
  detail::api::reject_fp8(c, opts, q, kNoFp8Backward);
  detail::api::reject_qv(c, opts);
  c.like_head_dim("out", out, "q", q, dims.d_v, "same as q but the head dim d_v of v");
  c.like_head_dim("dout", dout, "q", q, dims.d_v, "same as q but the head dim d_v of v");
  c.tensor("lse", lse, {dims.b, dims.h_q, dims.s_q}, "[b, h_q, s_q]", DType::kFloat32,
           q.device);
  c.like("dq", dq, "q", q);
  c.like("dk", dk, "k", k);
  c.like("dv", dv, "v", v);
  BwdParams p;
  const Target target = check_dense_options(c, opts, dims, q, k, v, p, detail::api::CudaCall::kBackward);
  std::vector<std::uint8_t> block_kinds;
  detail::api::fill_block_sparse(c, opts, target == Target::kCPU, q.device,
                                 {dims.b, dims.h_q, dims.s_q, dims.s_k}, block_kinds, p);
  detail::api::fill_sink_grad(c, opts, q.device, dims.h_q, p);
  detail::api::check_cuda_layouts(c, target,
                                  {{"out", out}, {"dout", dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}});
  c.no_overlap({{"dq", dq}, {"dk", dk}, {"dv", dv},
                {"opts.learnable_sink_grad", opts.learnable_sink_grad}},
               {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse},
                {"opts.alibi_slopes", opts.alibi_slopes},
                {"opts.learnable_sink", opts.learnable_sink}});

  set_dense_inputs(dims, q, k, v, p);
  detail::api::set_out(out, p);
  set_dense_lse(lse, p);
  detail::api::set_gradients(dout, dq, dk, dv, p);
  Scratch scratch;
  detail::api::attach_workspace(c, target, workspace,
                                detail::api::backward_workspace_size(target, p), p, scratch);
  detail::api::run_backward(target, p);
}

std::size_t backward_workspace_size(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Options& opts) {
  const Check c("backward_workspace_size");
  const DenseDims dims = check_qkv(c, q, k, v);
  detail::api::reject_fp8(c, opts, q, kNoFp8Backward);
  detail::api::reject_qv(c, opts);
  BwdParams p;
  const Target target = check_dense_options(c, opts, dims, q, k, v, p, detail::api::CudaCall::kBackward);
  std::vector<std::uint8_t> block_kinds;
  detail::api::fill_block_sparse(c, opts, target == Target::kCPU, q.device,
                                 {dims.b, dims.h_q, dims.s_q, dims.s_k}, block_kinds, p);
  set_dense_inputs(dims, q, k, v, p);
  return detail::api::backward_workspace_size(target, p);
}

bool cuda_available() noexcept {
  return detail::cuda::built() && detail::cuda::device_count() > 0;
}

void check_errors(int device) { detail::cuda::raise_index_error(device); }

const char* version() noexcept { return FLASHATTN_VERSION; }

}  // namespace flashattn
