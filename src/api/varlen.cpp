// Variable-length (packed) entry points: argument checking, then dispatch.
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "api/check.hpp"
#include "api/dispatch.hpp"
#include "core/backend.hpp"
#include "flashattn/attention.hpp"

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

struct VarlenDims {
  int b, total_q, total_k, h_q, h_k, d, d_v;
};

// q [total_q, h_q, d]; k [total_k, h_k, d]; v [total_k, h_k, d_v]; cu_seqlens_q/_k int32 [b + 1];
// seqused_k int32 [b]; max_seqlen_q/_k >= 0. Contents are checked later.
VarlenDims check_varlen_shapes(const Check& c, const VarlenArgs& a) {
  const Tensor& q = a.q;
  c.rank("q", q, 3, "[total_q, h_q, d]");
  c.layout("q", q);
  detail::api::check_query_heads(c, q, 1);
  c.rank("k", a.k, 3, "[total_k, h_k, d]");
  c.layout("k", a.k);
  c.dim("k", a.k, 2, q.shape[2], "head dim of q");
  detail::api::check_kv_heads(c, "k", a.k, 1, q.shape[1]);
  c.dtype("k", a.k, q.dtype, "same as q");
  c.device("k", a.k, q.device, "same as q");
  c.rank("v", a.v, 3, "[total_k, h_k, d_v]");
  c.like_head_dim("v", a.v, "k", a.k, a.v.shape[2], "same as k but any head dim d_v");

  c.rank("cu_seqlens_q", a.cu_seqlens_q, 1, "[b + 1]");
  c.dtype("cu_seqlens_q", a.cu_seqlens_q, DType::kInt32, "");
  c.device("cu_seqlens_q", a.cu_seqlens_q, q.device, "same as q");
  c.layout("cu_seqlens_q", a.cu_seqlens_q);
  if (a.cu_seqlens_q.shape[0] < 1) {
    c.fail("cu_seqlens_q", "shape [b + 1] with b >= 0", shape_string(a.cu_seqlens_q));
  }
  const std::int64_t b = a.cu_seqlens_q.shape[0] - 1;
  c.tensor("cu_seqlens_k", a.cu_seqlens_k, {b + 1}, "[b + 1], same as cu_seqlens_q",
           DType::kInt32, q.device);
  if (a.seqused_k.defined()) {
    c.tensor("seqused_k", a.seqused_k, {b}, "[b]", DType::kInt32, q.device);
  }
  if (a.seqused_q.defined()) {
    c.tensor("seqused_q", a.seqused_q, {b}, "[b]", DType::kInt32, q.device);
  }
  if (a.max_seqlen_q < 0) c.fail("max_seqlen_q", ">= 0", std::to_string(a.max_seqlen_q));
  if (a.max_seqlen_k < 0) c.fail("max_seqlen_k", ">= 0", std::to_string(a.max_seqlen_k));
  return {to_int(b),          to_int(q.shape[0]), to_int(a.k.shape[0]),
          to_int(q.shape[1]), to_int(a.k.shape[1]), to_int(q.shape[2]),
          to_int(a.v.shape[2])};
}

// cu_seqlens values: start at 0, non-decreasing, end at most at `total` (the packed
// tensor's first dimension) and no sequence longer than `max_seqlen`.
void check_cu_seqlens(const Check& c, std::string_view name, const std::vector<std::int32_t>& cu,
                      std::int64_t total, std::string_view total_name,
                      std::string_view max_name, int max_seqlen) {
  const std::string n(name);
  if (cu[0] != 0) c.fail(name, n + "[0] == 0", std::to_string(cu[0]));
  std::int64_t longest = 0;
  std::size_t longest_seq = 0;
  for (std::size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      c.fail(name, "non-decreasing values",
             n + "[" + std::to_string(i) + "] = " + std::to_string(cu[i]) + " < " + n + "[" +
                 std::to_string(i - 1) + "] = " + std::to_string(cu[i - 1]));
    }
    if (cu[i] - cu[i - 1] > longest) {
      longest = cu[i] - cu[i - 1];
      longest_seq = i - 1;
    }
  }
  const std::size_t last = cu.size() - 1;
  if (cu[last] > total) {
    c.fail(name,
           n + "[" + std::to_string(last) + "] <= " + std::to_string(total) + " (" +
               std::string(total_name) + ")",
           std::to_string(cu[last]));
  }
  if (max_seqlen < longest) {
    c.fail(max_name,
           ">= " + std::to_string(longest) + " (the length of sequence " +
               std::to_string(longest_seq) + " in " + n + ")",
           std::to_string(max_seqlen));
  }
}

// seqused values: each in [0, the sequence's length in `cu`].
void check_seqused(const Check& c, std::string_view name, const std::vector<std::int32_t>& used,
                   const std::vector<std::int32_t>& cu, std::string_view what) {
  for (std::size_t i = 0; i < used.size(); ++i) {
    const std::int32_t len = cu[i + 1] - cu[i];
    if (used[i] < 0 || used[i] > len) {
      const std::string at = std::string(name) + "[" + std::to_string(i) + "]";
      c.fail(name,
             at + " in [0, " + std::to_string(len) + "] (the " + std::string(what) +
                 " length of sequence " + std::to_string(i) + ")",
             at + " = " + std::to_string(used[i]));
    }
  }
}

// Returns false when the contents were not read (CUDA tensors, unless
// FLASHATTN_DEVICE_INDEX_CHECKS=0 outside graph capture): the call then checks them on the
// device.
bool check_varlen_contents(const Check& c, const VarlenArgs& a, const VarlenDims& dims,
                           Target target, void* stream) {
  const auto cu_q = detail::api::read_int32(a.cu_seqlens_q, target, stream);
  if (!cu_q) return false;
  check_cu_seqlens(c, "cu_seqlens_q", *cu_q, dims.total_q, "q.shape[0]", "max_seqlen_q",
                   a.max_seqlen_q);
  if (a.seqused_q.defined()) {
    const auto used_q = detail::api::read_int32(a.seqused_q, target, stream);
    if (!used_q) return false;
    check_seqused(c, "seqused_q", *used_q, *cu_q, "query");
  }
  const auto cu_k = detail::api::read_int32(a.cu_seqlens_k, target, stream);
  if (!cu_k) return false;
  check_cu_seqlens(c, "cu_seqlens_k", *cu_k, dims.total_k, "k.shape[0]", "max_seqlen_k",
                   a.max_seqlen_k);
  if (!a.seqused_k.defined()) return true;
  const auto used = detail::api::read_int32(a.seqused_k, target, stream);
  if (!used) return false;
  check_seqused(c, "seqused_k", *used, *cu_k, "key");
  return true;
}

// Options, backend, backend support, CUDA layouts and index contents: what every
// varlen entry point checks after the shapes.
Target check_varlen_rest(const Check& c, const VarlenArgs& a, const VarlenDims& dims,
                         const Options& opts, FwdParams& p, std::vector<std::uint8_t>& block_kinds,
                         detail::api::CudaCall call, bool* contents_read = nullptr) {
  detail::api::fill_options(c, opts, a.q.device, dims.b, dims.h_q,
                            detail::api::scale_dim(opts, dims.d, dims.d_v), p);
  const Target target = detail::api::resolve_target(c, opts, a.q.device);
  // fp8 q reaches here only from varlen_forward (the backward entry points reject it first).
  detail::api::check_fp8_cuda(c, opts, a.q, target == Target::kCUDA, dims.b, dims.h_k);
  // Block sparsity: the grid of max_seqlen_q x max_seqlen_k, positions within a sequence.
  detail::api::fill_block_sparse(c, opts, target == Target::kCPU, a.q.device,
                                 {dims.b, dims.h_q, a.max_seqlen_q, a.max_seqlen_k, true,
                                  dims.total_q, dims.total_k},
                                 block_kinds, p);
  // With qv (forward only: the backward rejects it before) the MLA kernel's head dims.
  detail::api::check_supported(c, target, a.q.dtype, dims.d, dims.d_v, dims.b, dims.h_q,
                               opts.qv.defined() ? detail::api::CudaCall::kMla : call);
  detail::api::check_qv_target(c, opts, target == Target::kCUDA);
  detail::api::check_cuda_layouts(c, target, {{"q", a.q}, {"k", a.k}, {"v", a.v}});
  const bool read = check_varlen_contents(c, a, dims, target, opts.stream);
  if (contents_read) *contents_read = read;
  return target;
}

void set_varlen_inputs(const VarlenArgs& a, const VarlenDims& dims, FwdParams& p) {
  detail::api::set_qkv(a.q, a.k, a.v, p);
  p.batch = dims.b;
  p.seqlen_q = a.max_seqlen_q;
  p.seqlen_k = a.max_seqlen_k;
  p.cu_seqlens_q = static_cast<const int*>(a.cu_seqlens_q.data);
  p.cu_seqlens_k = static_cast<const int*>(a.cu_seqlens_k.data);
  p.seqused_k = static_cast<const int*>(a.seqused_k.data);
  p.seqused_q = static_cast<const int*>(a.seqused_q.data);
  p.total_q = dims.total_q;
  p.total_k = dims.total_k;
  p.num_splits = 1;
}

// out [total_q, h_q, d]; lse [h_q, total_q], may be undefined.
void set_varlen_outputs(const Tensor& out, const Tensor& lse, FwdParams& p) {
  detail::api::set_out(out, p);
  if (lse.defined()) {
    p.lse = static_cast<float*>(lse.data);
    p.lse_head_stride = lse.stride[0];
  }
}

}  // namespace

void varlen_forward(const VarlenArgs& args, const Tensor& out, const Tensor& lse,
                    const Options& opts) {
  const Check c("varlen_forward");
  const VarlenDims dims = check_varlen_shapes(c, args);
  detail::api::check_fp8(c, opts, args.q, dims.b, dims.h_k);
  detail::api::check_out(c, out, args.q, dims.d_v);
  detail::api::check_qv(c, opts, args.q, dims.d_v);
  if (lse.defined()) {
    c.tensor("lse", lse, {dims.h_q, dims.total_q}, "[h_q, total_q]", DType::kFloat32,
             args.q.device);
  }
  FwdParams p;
  bool contents_read = true;
  std::vector<std::uint8_t> block_kinds;
  const Target target = check_varlen_rest(c, args, dims, opts, p, block_kinds,
                                          detail::api::CudaCall::kForward, &contents_read);
  detail::api::check_cuda_layouts(c, target, {{"out", out}});
  detail::api::fill_probs(c, opts, target == Target::kCPU, args.q.device,
                          {dims.h_q, dims.total_q, args.max_seqlen_k}, p);
  c.no_overlap({{"out", out}, {"lse", lse}, {"opts.return_probs", opts.return_probs}},
               {{"q", args.q}, {"k", args.k}, {"v", args.v}, {"cu_seqlens_q", args.cu_seqlens_q},
                {"cu_seqlens_k", args.cu_seqlens_k}, {"seqused_k", args.seqused_k},
                {"seqused_q", args.seqused_q},
                {"opts.alibi_slopes", opts.alibi_slopes},
                {"opts.learnable_sink", opts.learnable_sink}, {"opts.qv", opts.qv},
                {"opts.q_descale", opts.q_descale}, {"opts.k_descale", opts.k_descale},
                {"opts.v_descale", opts.v_descale}});

  set_varlen_inputs(args, dims, p);
  detail::api::set_qv(opts.qv, p);
  set_varlen_outputs(out, lse, p);
  std::vector<float> descales;  // fp8 q on the CPU: the descales, read on the host
  detail::api::set_fp8(opts, out, target == Target::kCUDA, p, descales);
  detail::api::check_cuda_forward_rows(c, target, p);
  Scratch scratch;
  detail::api::attach_workspace(c, target, {}, detail::api::forward_workspace_size(target, p), p,
                                scratch);
  if (target == Target::kCUDA && !contents_read) {
    detail::cuda::check_indices_on_device(p, detail::cuda::IndexCall::kVarlenForward);
  }
  detail::api::run_forward(target, p);
}

void varlen_backward(const VarlenArgs& args, const Tensor& dout, const Tensor& out,
                     const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                     const Options& opts, Workspace workspace) {
  const Check c("varlen_backward");
  const VarlenDims dims = check_varlen_shapes(c, args);
  detail::api::reject_fp8(c, opts, args.q, kNoFp8Backward);
  detail::api::reject_qv(c, opts);
  c.like_head_dim("out", out, "q", args.q, dims.d_v, "same as q but the head dim d_v of v");
  c.like_head_dim("dout", dout, "q", args.q, dims.d_v, "same as q but the head dim d_v of v");
  c.tensor("lse", lse, {dims.h_q, dims.total_q}, "[h_q, total_q]", DType::kFloat32,
           args.q.device);
  c.like("dq", dq, "q", args.q);
  c.like("dk", dk, "k", args.k);
  c.like("dv", dv, "v", args.v);
  BwdParams p;
  bool contents_read = true;
  std::vector<std::uint8_t> block_kinds;
  const Target target = check_varlen_rest(c, args, dims, opts, p, block_kinds,
                                          detail::api::CudaCall::kBackward, &contents_read);
  detail::api::fill_sink_grad(c, opts, args.q.device, dims.h_q, p);
  detail::api::check_cuda_layouts(c, target,
                                  {{"out", out}, {"dout", dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}});
  c.no_overlap({{"dq", dq}, {"dk", dk}, {"dv", dv},
                {"opts.learnable_sink_grad", opts.learnable_sink_grad}},
               {{"dout", dout}, {"q", args.q}, {"k", args.k}, {"v", args.v}, {"out", out},
                {"lse", lse}, {"cu_seqlens_q", args.cu_seqlens_q},
                {"cu_seqlens_k", args.cu_seqlens_k}, {"seqused_k", args.seqused_k},
                {"seqused_q", args.seqused_q},
                {"opts.alibi_slopes", opts.alibi_slopes},
                {"opts.learnable_sink", opts.learnable_sink}});

  set_varlen_inputs(args, dims, p);
  set_varlen_outputs(out, lse, p);
  detail::api::set_gradients(dout, dq, dk, dv, p);
  Scratch scratch;
  detail::api::attach_workspace(c, target, workspace,
                                detail::api::backward_workspace_size(target, p), p, scratch);
  if (target == Target::kCUDA && !contents_read) {
    detail::cuda::check_indices_on_device(p, detail::cuda::IndexCall::kVarlenBackward);
  }
  detail::api::run_backward(target, p);
}

std::size_t varlen_backward_workspace_size(const VarlenArgs& args, const Options& opts) {
  const Check c("varlen_backward_workspace_size");
  const VarlenDims dims = check_varlen_shapes(c, args);
  detail::api::reject_fp8(c, opts, args.q, kNoFp8Backward);
  detail::api::reject_qv(c, opts);
  BwdParams p;
  std::vector<std::uint8_t> block_kinds;
  const Target target = check_varlen_rest(c, args, dims, opts, p, block_kinds,
                                          detail::api::CudaCall::kBackward);
  set_varlen_inputs(args, dims, p);
  return detail::api::backward_workspace_size(target, p);
}

}  // namespace flashattn
