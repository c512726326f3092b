// Internal: argument checking shared by the entry points.
//
// A Check carries the name of the entry point, so each helper throws an error of the
// form "flashattn::<function>: argument '<name>': expected <...>, got <...>". Every
// helper only reads; entry points run all of them before anything is written.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "core/params.hpp"
#include "flashattn/attention.hpp"

namespace flashattn::detail::api {

using Shape = std::vector<std::int64_t>;

std::string shape_string(const Shape& shape);
std::string address_string(const void* p);

// A named tensor argument, for checks that relate several tensors.
struct Arg {
  std::string_view name;
  const Tensor& tensor;
};

class Check {
 public:
  explicit Check(std::string_view function) : function_(function) {}
  std::string_view function() const { return function_; }

  [[noreturn]] void fail(std::string_view argument, const std::string& expected,
                         const std::string& actual) const;
  [[noreturn]] void unsupported(std::string_view argument, const std::string& expected,
                                const std::string& actual) const;

  // A required tensor is defined (rank > 0).
  void required(std::string_view name, const Tensor& t) const;
  // rank == expected; `dims` names the dimensions, e.g. "[b, s_q, h_q, d]".
  void rank(std::string_view name, const Tensor& t, int expected, std::string_view dims) const;
  // The whole shape; `why` says where it comes from, e.g. "same as q".
  void shape(std::string_view name, const Tensor& t, const Shape& expected,
             std::string_view why) const;
  // One dimension; `why` names it, e.g. "head dim of q".
  void dim(std::string_view name, const Tensor& t, int dim, std::int64_t expected,
           std::string_view why) const;
  void dtype(std::string_view name, const Tensor& t, DType expected, std::string_view why) const;
  void device(std::string_view name, const Tensor& t, Device expected, std::string_view why) const;
  // Sizes in [0, 2^31), non-null data when non-empty, non-negative strides, a contiguous
  // last dimension and data aligned to the element size.
  void layout(std::string_view name, const Tensor& t) const;

  // `t` has the shape, dtype and device of `ref` and a valid layout.
  void like(std::string_view name, const Tensor& t, std::string_view ref_name,
            const Tensor& ref) const;
  // `t` has the shape of `ref` except for its last dimension (a head dim), which is
  // `head_dim`, and ref's dtype and device and a valid layout: v against k, out and dout
  // against q when v's head dim d_v differs from q's. `why` explains the shape.
  void like_head_dim(std::string_view name, const Tensor& t, std::string_view ref_name,
                     const Tensor& ref, std::int64_t head_dim, std::string_view why) const;
  // `t` is defined with this shape, dtype and device and a valid layout.
  void tensor(std::string_view name, const Tensor& t, const Shape& shape, std::string_view why,
              DType dtype, Device device) const;

  // No output overlaps an input or another output, by byte ranges [lowest, highest]
  // element. Inputs may overlap each other (q, k, v may be slices of one tensor).
  void no_overlap(std::initializer_list<Arg> outputs, std::initializer_list<Arg> inputs) const;

 private:
  std::string function_;
};

// Validates the options every entry point shares (window, softmax scale, softcap, ALiBi,
// dropout, threads) and fills the score, mask, dropout and execution fields of p.
// `batch` and `h_q` give the ALiBi shapes; d the default scale 1/sqrt(d) (the head dim of
// q and k, or d + d_v with qv).
void fill_options(const Check& check, const Options& opts, Device device, int batch, int h_q,
                  int d, FwdParams& p);

// Validates opts.learnable_sink_grad (backward: fp32 [h_q], needs opts.learnable_sink)
// and sets p.dsink. No-op when undefined.
void fill_sink_grad(const Check& check, const Options& opts, Device device, int h_q,
                    BwdParams& p);

// Validates opts.return_probs against `shape` ([b, h_q, s_q, s_k] or, varlen,
// [h_q, total_q, max_seqlen_k]) and fills the probs fields of p. No-op when undefined.
void fill_probs(const Check& check, const Options& opts, bool cpu_backend, Device device,
                const Shape& shape, FwdParams& p);

// Validates opts.block_sparse (attention.hpp, BlockSparseTensors) of a call with the given
// dims (varlen: s_q, s_k are max_seqlen_q / _k, and the doc ids are packed [total_q],
// [total_k]): shapes, dtypes, devices, counts, indices (range, duplicates), doc ids and
// prefix lengths, and builds the block-kind table into `kinds` (kept alive by the caller)
// and the block-sparse fields of p. No-op when undefined.
struct BlockSparseDims {
  int batch = 0, h_q = 0, s_q = 0, s_k = 0;
  bool varlen = false;
  std::int64_t total_q = 0, total_k = 0;  // varlen only
};
// CUDA (cpu_backend false): the lists' device pointers go to p.bs_lists (the device builds
// the table; kinds is filled only for the content checks of an eager call).
void fill_block_sparse(const Check& check, const Options& opts, bool cpu_backend, Device device,
                       const BlockSparseDims& dims, std::vector<std::uint8_t>& kinds,
                       FwdParams& p);
// Entry points without block sparsity (KV cache): Unsupported when it is given.
void decline_block_sparse(const Check& check, const Options& opts, std::string_view why);

// h_q (q.shape[dim]) is at least 1.
void check_query_heads(const Check& check, const Tensor& q, int dim);
// h_k (t.shape[dim]) is at least 1 and divides h_q (grouped-query attention).
void check_kv_heads(const Check& check, std::string_view name, const Tensor& t, int dim,
                    std::int64_t h_q);

// The (batch, row, head) strides of a [b, s, h, d] tensor, or of a packed [total, h, d]
// one (batch stride 0: varlen rows are found through cu_seqlens).
struct RowStrides {
  std::int64_t batch = 0, row = 0, head = 0;
};
RowStrides row_strides(const Tensor& t);

// Pointers and strides of q, k, v (and dtype, heads, head dim, h_ratio) into p.
void set_qkv(const Tensor& q, const Tensor& k, const Tensor& v, FwdParams& p);
// opts.qv (MLA, [b, s_q, h_q, d_v] or packed [total_q, h_q, d_v]) into p; no-op when
// undefined.
void set_qv(const Tensor& qv, FwdParams& p);
// opts.qv of a forward entry point: undefined, or the shape of q with the last dim d_v,
// q's dtype and device.
void check_qv(const Check& check, const Options& opts, const Tensor& q, std::int64_t d_v);
// The head dim of the default scale 1/sqrt(.): d, or d + d_v with opts.qv.
inline int scale_dim(const Options& opts, int d, int d_v) {
  return opts.qv.defined() ? d + d_v : d;
}
// A backward entry point: opts.qv undefined (qv has no backward), else Unsupported.
void reject_qv(const Check& check, const Options& opts);
// With qv on a CUDA target (the MLA kernel): opts.dropout_p 0 and no opts.block_sparse,
// else Unsupported naming them. The head dims are check_supported's (CudaCall::kMla).
void check_qv_target(const Check& check, const Options& opts, bool cuda);
void set_out(const Tensor& out, FwdParams& p);

// fp8 (e4m3) q, k, v (a forward entry point): out has q's shape with the last dim d_v and
// dtype bfloat16 or float16 (the output of an fp8 forward, FlashAttention-3's rule); other
// q: like q, as before.
void check_out(const Check& check, const Tensor& out, const Tensor& q, std::int64_t d_v);
// opts.q_descale / k_descale / v_descale: with float8_e4m3 q (k, v are checked to match q)
// each is undefined (1) or fp32 [batch, h_k] on q's device with a contiguous last dim;
// without fp8 q they must be undefined. fp8 q takes no opts.qv.
void check_fp8(const Check& check, const Options& opts, const Tensor& q, int batch, int h_k);
// A backward / KV-cache entry point: q not float8_e4m3 and no descales, else Unsupported
// (fp8 q) or InvalidArgument (descales); `why` ends the Unsupported message.
void reject_fp8(const Check& check, const Options& opts, const Tensor& q, std::string_view why);
// fp8 q, k, v on the CUDA backend (forward / varlen_forward / kvcache_forward, after
// check_fp8 and resolve_target; a no-op without fp8 q or when `cuda` is false). The sm90
// fp8 kernel and the decode kernel read a descale as descale[b * h_k + g] on the device, so each one given must be contiguous
// [b, h_k]: stride[0] == h_k when b > 1 (stride[1] == 1, fp32, the shape and q's device are
// check_fp8's), else InvalidArgument naming it. What that kernel does not run is
// Unsupported naming the option: opts.dropout_p > 0, opts.return_probs, opts.block_sparse
// (the CPU backend runs them with fp8; opts.qv is check_fp8's, for every backend).
void check_fp8_cuda(const Check& check, const Options& opts, const Tensor& q, bool cuda,
                    int batch, int h_k);
// After set_qkv / set_out with fp8 q (a no-op otherwise): p.dtype becomes out's,
// p.scale_block_stride h_k, p.scale_by_sequence true, and p.q_descale / k_scale / v_scale
// the [batch, h_k] descales:
//   CPU (`cuda` false): pointers into `storage`, which holds the three descales
//     [3][batch * h_k] read on the host (1 where undefined) and must outlive the call;
//   CUDA: the descale tensors' own device pointers (contiguous [b, h_k]: check_fp8_cuda),
//     nullptr where undefined (the kernel reads nullptr as 1); nothing is copied and
//     `storage` is left empty.
void set_fp8(const Options& opts, const Tensor& out, bool cuda, FwdParams& p,
             std::vector<float>& storage);
void set_gradients(const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                   BwdParams& p);

// Narrowing for values already checked to lie in [0, 2^31).
inline int to_int(std::int64_t v) { return static_cast<int>(v); }

}  // namespace flashattn::detail::api
