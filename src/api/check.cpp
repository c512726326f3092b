#include "api/check.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include <cstdio>
#include <limits>
#include <optional>

#include "api/dispatch.hpp"
#include "core/backend.hpp"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::api {

namespace {

constexpr std::int64_t kMaxExtent = std::numeric_limits<int>::max();

Shape shape_of(const Tensor& t) { return Shape(t.shape, t.shape + t.rank); }

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string dtype_text(DType t, std::string_view why) {
  std::string s = "dtype " + std::string(dtype_name(t));
  if (!why.empty()) s += " (" + std::string(why) + ")";
  return s;
}

// [lowest byte, one past the highest byte] of a tensor with non-negative strides.
struct ByteRange {
  std::uintptr_t begin = 0, end = 0;
  bool empty() const { return begin == end; }
  bool overlaps(const ByteRange& o) const {
    return !empty() && !o.empty() && begin < o.end && o.begin < end;
  }
  std::string str() const {
    return "bytes [" + address_string(reinterpret_cast<const void*>(begin)) + ", " +
           address_string(reinterpret_cast<const void*>(end)) + ")";
  }
};

ByteRange byte_range(const Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  std::int64_t last = 0;
  for (int i = 0; i < t.rank; ++i) last += (t.shape[i] - 1) * t.stride[i];
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data);
  const auto esize = static_cast<std::uintptr_t>(dtype_size(t.dtype));
  return {begin, begin + static_cast<std::uintptr_t>(last) * esize + esize};
}

// Whether no two elements share an address: with the dimensions of extent > 1 sorted by
// stride, each stride must step past everything the smaller ones span. (Sufficient, and
// exact for the usual permuted and padded layouts.)
bool distinct_elements(const Tensor& t) {
  if (!t.defined() || t.numel() == 0) return true;
  std::pair<std::int64_t, std::int64_t> dims[kMaxRank];  // (stride, extent); no allocation
  int n = 0;
  for (int i = 0; i < t.rank && i < kMaxRank; ++i) {
    if (t.shape[i] > 1) dims[n++] = {t.stride[i], t.shape[i]};
  }
  std::sort(dims, dims + n);
  std::int64_t span = 0;  // highest offset reachable by the dimensions so far
  for (int i = 0; i < n; ++i) {
    const auto [stride, extent] = dims[i];
    if (stride <= span) return false;
    span += (extent - 1) * stride;
  }
  return true;
}

}  // namespace

std::string shape_string(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string address_string(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p)));
  return buf;
}

void Check::fail(std::string_view argument, const std::string& expected,
                 const std::string& actual) const {
  throw InvalidArgument(function_, std::string(argument), expected, actual);
}

void Check::unsupported(std::string_view argument, const std::string& expected,
                        const std::string& actual) const {
  throw Unsupported(function_, std::string(argument), expected, actual);
}

void Check::required(std::string_view name, const Tensor& t) const {
  if (!t.defined()) fail(name, "a defined tensor", "an undefined tensor (rank 0)");
}

void Check::rank(std::string_view name, const Tensor& t, int expected,
                 std::string_view dims) const {
  required(name, t);
  if (t.rank != expected) {
    fail(name, "rank " + std::to_string(expected) + " " + std::string(dims),
         "rank " + std::to_string(t.rank) + " " + flashattn::shape_string(t));
  }
}

void Check::shape(std::string_view name, const Tensor& t, const Shape& expected,
                  std::string_view why) const {
  required(name, t);
  if (shape_of(t) != expected) {
    std::string e = "shape " + shape_string(expected);
    if (!why.empty()) e += " (" + std::string(why) + ")";
    fail(name, e, flashattn::shape_string(t));
  }
}

void Check::dim(std::string_view name, const Tensor& t, int dim, std::int64_t expected,
                std::string_view why) const {
  if (t.shape[dim] != expected) {
    std::string e = "shape[" + std::to_string(dim) + "] == " + std::to_string(expected);
    if (!why.empty()) e += " (" + std::string(why) + ")";
    fail(name, e, std::to_string(t.shape[dim]));
  }
}

void Check::dtype(std::string_view name, const Tensor& t, DType expected,
                  std::string_view why) const {
  if (t.dtype != expected) fail(name, dtype_text(expected, why), dtype_name(t.dtype));
}

void Check::device(std::string_view name, const Tensor& t, Device expected,
                   std::string_view why) const {
  if (!(t.device == expected)) {
    std::string e = "device " + to_string(expected);
    if (!why.empty()) e += " (" + std::string(why) + ")";
    fail(name, e, to_string(t.device));
  }
}

void Check::layout(std::string_view name, const Tensor& t) const {
  required(name, t);
  if (t.rank > kMaxRank) {
    fail(name, "rank <= " + std::to_string(kMaxRank), "rank " + std::to_string(t.rank));
  }
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0) fail(name, "non-negative sizes", "shape " + flashattn::shape_string(t));
    if (t.shape[i] > kMaxExtent) {
      fail(name, "shape[" + std::to_string(i) + "] < 2^31", std::to_string(t.shape[i]));
    }
  }
  for (int i = 0; i < t.rank; ++i) {
    if (t.stride[i] < 0) {
      fail(name, "non-negative strides",
           "stride[" + std::to_string(i) + "] = " + std::to_string(t.stride[i]));
    }
  }
  const int last = t.rank - 1;
  if (t.stride[last] != 1) {
    fail(name, "stride[" + std::to_string(last) + "] == 1 (contiguous last dimension)",
         std::to_string(t.stride[last]));
  }
  if (t.numel() > 0 && t.data == nullptr) {
    fail(name, "non-null data for a tensor of shape " + flashattn::shape_string(t), "nullptr");
  }
  const std::size_t esize = dtype_size(t.dtype);
  // The byte offset of the highest element, sum((shape[i] - 1) * stride[i]) * esize, must
  // fit the int64 offsets of the backends and not run past the end of the address space:
  // a larger stride would wrap the pointer around (a read or write far from the tensor).
  if (t.numel() > 0) {
    std::uint64_t end = 0;
    bool overflow = false;
    for (int i = 0; i < t.rank; ++i) {
      std::uint64_t term = 0;
      overflow |= __builtin_mul_overflow(static_cast<std::uint64_t>(t.shape[i] - 1),
                                         static_cast<std::uint64_t>(t.stride[i]), &term);
      overflow |= __builtin_add_overflow(end, term, &end);
    }
    overflow |= __builtin_add_overflow(end, std::uint64_t{1}, &end);
    overflow |= __builtin_mul_overflow(end, static_cast<std::uint64_t>(esize), &end);
    const auto begin = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(t.data));
    if (overflow || end > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
        end > std::numeric_limits<std::uintptr_t>::max() - begin) {
      fail(name,
           "element offsets within the address space (sum of (shape[i] - 1) * stride[i] "
           "elements of " + std::to_string(esize) + " bytes, below 2^63 bytes, from data " +
               address_string(t.data) + ")",
           "shape " + flashattn::shape_string(t) + " with strides " +
               shape_string(Shape(t.stride, t.stride + t.rank)));
    }
  }
  if (reinterpret_cast<std::uintptr_t>(t.data) % esize != 0) {
    fail(name,
         "data aligned to " + std::to_string(esize) + " bytes (the size of " +
             dtype_name(t.dtype) + ")",
         "address " + address_string(t.data));
  }
}

void Check::like(std::string_view name, const Tensor& t, std::string_view ref_name,
                 const Tensor& ref) const {
  // The message ("same as <ref>") and the reference's Shape are built only on a mismatch:
  // this runs for most tensors of every call.
  const bool same_shape = t.defined() && t.rank == ref.rank && t.rank <= kMaxRank &&
                          std::equal(t.shape, t.shape + t.rank, ref.shape);
  if (!same_shape || t.dtype != ref.dtype || !(t.device == ref.device)) {
    const std::string why = "same as " + std::string(ref_name);
    shape(name, t, shape_of(ref), why);
    dtype(name, t, ref.dtype, why);
    device(name, t, ref.device, why);
  }
  layout(name, t);
}

void Check::like_head_dim(std::string_view name, const Tensor& t, std::string_view ref_name,
                          const Tensor& ref, std::int64_t head_dim,
                          std::string_view why) const {
  Shape expected = shape_of(ref);
  if (!expected.empty()) expected.back() = head_dim;
  shape(name, t, expected, why);
  dtype(name, t, ref.dtype, "same as " + std::string(ref_name));
  device(name, t, ref.device, "same as " + std::string(ref_name));
  layout(name, t);
}

void Check::tensor(std::string_view name, const Tensor& t, const Shape& expected_shape,
                   std::string_view why, DType expected_dtype, Device expected_device) const {
  shape(name, t, expected_shape, why);
  dtype(name, t, expected_dtype, "");
  device(name, t, expected_device, "same as q");
  layout(name, t);
}

void Check::no_overlap(std::initializer_list<Arg> outputs, std::initializer_list<Arg> inputs) const {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (!distinct_elements(out->tensor)) {
      fail(out->name, "distinct memory for every element (an output)",
           "shape " + flashattn::shape_string(out->tensor) + " with strides " +
               shape_string(Shape(out->tensor.stride, out->tensor.stride + out->tensor.rank)));
    }
    const ByteRange r = byte_range(out->tensor);
    auto test = [&](const Arg& other, std::string_view kind) {
      const ByteRange o = byte_range(other.tensor);
      if (r.overlaps(o)) {
        fail(out->name,
             "memory disjoint from " + std::string(kind) + " '" + std::string(other.name) + "' (" +
                 o.str() + ")",
             r.str());
      }
    };
    for (const Arg& in : inputs) test(in, "input");
    for (auto other = outputs.begin(); other != out; ++other) test(*other, "output");
  }
}

void check_query_heads(const Check& check, const Tensor& q, int dim) {
  if (q.shape[dim] < 1) {
    check.fail("q", "shape[" + std::to_string(dim) + "] (h_q) >= 1", std::to_string(q.shape[dim]));
  }
}

void check_kv_heads(const Check& check, std::string_view name, const Tensor& t, int dim,
                    std::int64_t h_q) {
  const std::int64_t h_k = t.shape[dim];
  if (h_k < 1 || h_q % h_k != 0) {
    check.fail(name,
               "shape[" + std::to_string(dim) + "] (h_k) >= 1 and dividing h_q = " +
                   std::to_string(h_q),
               std::to_string(h_k));
  }
}

RowStrides row_strides(const Tensor& t) {
  if (t.rank == 4) return {t.stride[0], t.stride[1], t.stride[2]};
  return {0, t.stride[0], t.stride[1]};
}

void set_qkv(const Tensor& q, const Tensor& k, const Tensor& v, FwdParams& p) {
  const int head_dim = q.rank - 2;
  p.dtype = q.dtype;
  p.q_dtype = q.dtype;
  p.kv_dtype = k.dtype;
  p.h_q = to_int(q.shape[head_dim]);
  p.h_k = to_int(k.shape[head_dim]);
  p.d = to_int(q.shape[head_dim + 1]);
  p.d_v = to_int(v.shape[head_dim + 1]);
  p.h_ratio = p.h_q / p.h_k;
  const RowStrides qs = row_strides(q), ks = row_strides(k), vs = row_strides(v);
  p.q = q.data;
  p.q_batch_stride = qs.batch, p.q_row_stride = qs.row, p.q_head_stride = qs.head;
  p.k = k.data;
  p.k_batch_stride = ks.batch, p.k_row_stride = ks.row, p.k_head_stride = ks.head;
  p.v = v.data;
  p.v_batch_stride = vs.batch, p.v_row_stride = vs.row, p.v_head_stride = vs.head;
}

void set_qv(const Tensor& qv, FwdParams& p) {
  if (!qv.defined()) return;
  const RowStrides s = row_strides(qv);
  p.qv = qv.data;
  p.qv_batch_stride = s.batch, p.qv_row_stride = s.row, p.qv_head_stride = s.head;
}

void check_qv(const Check& check, const Options& opts, const Tensor& q, std::int64_t d_v) {
  if (!opts.qv.defined()) return;
  check.like_head_dim("opts.qv", opts.qv, "q", q, d_v, "same as q but the head dim d_v of v");
}

void reject_qv(const Check& check, const Options& opts) {
  if (!opts.qv.defined()) return;
  check.unsupported("opts.qv",
                    "an undefined tensor (qv has no backward, as in FlashAttention-3: the "
                    "forward with qv is for inference)",
                    "a tensor of shape " + flashattn::shape_string(opts.qv));
}

void check_qv_target(const Check& check, const Options& opts, bool cuda) {
  if (!opts.qv.defined() || !cuda) return;
  // The CUDA MLA kernel (src/cuda/sm80/mla_kernel.cuh) is inference only, without masks
  // beyond the per-row key intervals; its head-dim rules are check_supported's (CudaCall::kMla).
  if (opts.dropout_p > 0.0f) {
    check.unsupported("opts.dropout_p", "0 with opts.qv on CUDA (the MLA kernel has no dropout)",
                      number(opts.dropout_p));
  }
  if (opts.block_sparse.defined()) {
    check.unsupported("opts.block_sparse",
                      "undefined lists with opts.qv on CUDA (the MLA kernel takes no block-sparse mask)",
                      "a block-sparse mask");
  }
}

void set_out(const Tensor& out, FwdParams& p) {
  const RowStrides s = row_strides(out);
  p.out = out.data;
  p.o_batch_stride = s.batch, p.o_row_stride = s.row, p.o_head_stride = s.head;
}

void check_out(const Check& check, const Tensor& out, const Tensor& q, std::int64_t d_v) {
  if (q.dtype != DType::kFloat8E4M3) {
    check.like_head_dim("out", out, "q", q, d_v, "same as q but the head dim d_v of v");
    return;
  }
  check.required("out", out);
  if (out.dtype != DType::kBFloat16 && out.dtype != DType::kFloat16) {
    check.fail("out", "dtype bfloat16 or float16 (the output of float8_e4m3 q, k, v)",
               dtype_name(out.dtype));
  }
  Tensor like_q = q;
  like_q.dtype = out.dtype;
  check.like_head_dim("out", out, "q", like_q, d_v,
                      "same as q but the head dim d_v of v and dtype bfloat16 / float16");
}

namespace {

struct Descale {
  const char* name;
  const Tensor& tensor;
};

}  // namespace

void check_fp8(const Check& check, const Options& opts, const Tensor& q, int batch, int h_k) {
  const Descale descales[] = {{"opts.q_descale", opts.q_descale},
                              {"opts.k_descale", opts.k_descale},
                              {"opts.v_descale", opts.v_descale}};
  const bool fp8 = q.dtype == DType::kFloat8E4M3;
  for (const Descale& ds : descales) {
    if (!ds.tensor.defined()) continue;
    if (!fp8) {
      check.fail(ds.name,
                 "an undefined tensor when q is not float8_e4m3 (descales go with fp8 q, k, v)",
                 "a tensor of shape " + flashattn::shape_string(ds.tensor) + " with q of dtype " +
                     dtype_name(q.dtype));
    }
    check.tensor(ds.name, ds.tensor, {batch, h_k}, "[b, h_k], one per (sequence, KV head)",
                 DType::kFloat32, q.device);
  }
  if (fp8 && opts.qv.defined()) {
    check.unsupported("opts.qv",
                      "an undefined tensor with float8_e4m3 q, k, v (no fp8 qv, as in "
                      "FlashAttention-3)",
                      "a tensor of shape " + flashattn::shape_string(opts.qv));
  }
}

void reject_fp8(const Check& check, const Options& opts, const Tensor& q, std::string_view why) {
  if (q.dtype == DType::kFloat8E4M3) {
    check.unsupported("q", "dtype float16, bfloat16, float32 or float64 (" + std::string(why) + ")",
                      dtype_name(q.dtype));
  }
  check_fp8(check, opts, q, 0, 0);  // descales without fp8 q
}

void check_fp8_cuda(const Check& check, const Options& opts, const Tensor& q, bool cuda,
                    int batch, int h_k) {
  if (!cuda || q.dtype != DType::kFloat8E4M3) return;
  const Descale descales[] = {{"opts.q_descale", opts.q_descale},
                              {"opts.k_descale", opts.k_descale},
                              {"opts.v_descale", opts.v_descale}};
  for (const Descale& ds : descales) {
    const Tensor& t = ds.tensor;
    if (!t.defined() || batch <= 1) continue;
    if (t.stride[0] != h_k) {
      check.fail(ds.name,
                 "stride[0] == " + std::to_string(h_k) +
                     " (h_k: contiguous [b, h_k], the CUDA fp8 forward reads descale[b * h_k + "
                     "g] on the device)",
                 std::to_string(t.stride[0]));
    }
  }
  constexpr const char* kOnCuda = " with float8_e4m3 q, k, v on CUDA (the sm90 fp8 forward, as "
                                  "FlashAttention-3's, has none; the CPU backend runs it)";
  if (opts.dropout_p > 0.0f) {
    check.unsupported("opts.dropout_p", std::string("0") + kOnCuda, number(opts.dropout_p));
  }
  if (opts.return_probs.defined()) {
    check.unsupported("opts.return_probs", std::string("an undefined tensor") + kOnCuda,
                      "a tensor of shape " + flashattn::shape_string(opts.return_probs));
  }
  if (opts.block_sparse.defined()) {
    check.unsupported("opts.block_sparse", std::string("undefined lists") + kOnCuda,
                      "a block-sparse mask");
  }
}

void set_fp8(const Options& opts, const Tensor& out, bool cuda, FwdParams& p,
             std::vector<float>& storage) {
  if (p.q_dtype != DType::kFloat8E4M3) return;
  p.dtype = out.dtype;
  p.scale_block_stride = p.h_k;
  p.scale_by_sequence = true;
  if (cuda) {
    // The device pointers as they are: [b, h_k] contiguous (check_fp8_cuda), read by the
    // kernel as descale[b * h_k + g]; nullptr = 1.
    const auto device_ptr = [](const Tensor& t) {
      return t.defined() ? static_cast<const float*>(t.data) : nullptr;
    };
    storage.clear();
    p.q_descale = device_ptr(opts.q_descale);
    p.k_scale = device_ptr(opts.k_descale);
    p.v_scale = device_ptr(opts.v_descale);
    return;
  }
  const std::size_t n = std::size_t(p.batch) * std::size_t(p.h_k);
  storage.assign(3 * n, 1.0f);
  const Tensor* tensors[] = {&opts.q_descale, &opts.k_descale, &opts.v_descale};
  for (int t = 0; t < 3; ++t) {
    const Tensor& ds = *tensors[t];
    if (!ds.defined()) continue;
    const float* src = static_cast<const float*>(ds.data);
    for (int b = 0; b < p.batch; ++b)
      for (int g = 0; g < p.h_k; ++g)
        storage[t * n + std::size_t(b) * p.h_k + g] = src[std::int64_t(b) * ds.stride[0] + g];
  }
  p.q_descale = storage.data();
  p.k_scale = storage.data() + n;
  p.v_scale = storage.data() + 2 * n;
}

void set_gradients(const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                   BwdParams& p) {
  const RowStrides os = row_strides(dout), qs = row_strides(dq), ks = row_strides(dk),
                   vs = row_strides(dv);
  p.dout = dout.data;
  p.do_batch_stride = os.batch, p.do_row_stride = os.row, p.do_head_stride = os.head;
  p.dq = dq.data;
  p.dq_batch_stride = qs.batch, p.dq_row_stride = qs.row, p.dq_head_stride = qs.head;
  p.dk = dk.data;
  p.dk_batch_stride = ks.batch, p.dk_row_stride = ks.row, p.dk_head_stride = ks.head;
  p.dv = dv.data;
  p.dv_batch_stride = vs.batch, p.dv_row_stride = vs.row, p.dv_head_stride = vs.head;
}

void fill_options(const Check& check, const Options& opts, Device device, int batch, int h_q,
                  int d, FwdParams& p) {
  if (opts.window_left < -1) {
    check.fail("opts.window_left", ">= -1", std::to_string(opts.window_left));
  }
  if (opts.window_right < -1) {
    check.fail("opts.window_right", ">= -1", std::to_string(opts.window_right));
  }
  if (opts.softmax_scale && !std::isfinite(*opts.softmax_scale)) {
    check.fail("opts.softmax_scale", "a finite value (or unset for 1/sqrt(d))",
               number(*opts.softmax_scale));
  }
  if (!(opts.softcap >= 0.0f) || std::isinf(opts.softcap)) {
    check.fail("opts.softcap", "a finite value >= 0 (0 = off)", number(opts.softcap));
  }
  if (!(opts.dropout_p >= 0.0f && opts.dropout_p < 1.0f)) {
    check.fail("opts.dropout_p", "a value in [0, 1)", number(opts.dropout_p));
  }
  if (opts.num_threads < 0) {
    check.fail("opts.num_threads", ">= 0 (0 = OpenMP default)", std::to_string(opts.num_threads));
  }

  const Tensor& alibi = opts.alibi_slopes;
  if (alibi.defined()) {
    const Shape per_head{h_q}, per_batch_head{batch, h_q};
    const Shape actual(alibi.shape, alibi.shape + alibi.rank);
    if (actual != per_head && actual != per_batch_head) {
      check.fail("opts.alibi_slopes",
                 "shape " + shape_string(per_head) + " or " + shape_string(per_batch_head) +
                     " ([h_q] or [b, h_q])",
                 flashattn::shape_string(alibi));
    }
    check.dtype("opts.alibi_slopes", alibi, DType::kFloat32, "");
    check.device("opts.alibi_slopes", alibi, device, "same as q");
    check.layout("opts.alibi_slopes", alibi);
    p.alibi_slopes = static_cast<const float*>(alibi.data);
    p.alibi_batch_stride = alibi.rank == 2 ? alibi.stride[0] : 0;
  }

  const Tensor& sink = opts.learnable_sink;
  if (sink.defined()) {
    check.tensor("opts.learnable_sink", sink, {h_q}, "[h_q], one logit per query head",
                 DType::kFloat32, device);
    p.sink = static_cast<const float*>(sink.data);
  }

  fill_kernel_options(check, opts, device, p);
  p.scale = opts.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(d)));
  p.softcap = opts.softcap;
  p.mask = semantics::Mask::make(opts.causal, opts.window_left, opts.window_right);
  p.dropout_p = opts.dropout_p;
  p.rp_dropout = static_cast<float>(semantics::dropout_keep_scale(opts.dropout_p));
  p.rng.seed = opts.seed;
  p.rng.offset = opts.offset;
  p.rng.threshold = semantics::dropout_threshold(opts.dropout_p);
  p.deterministic = opts.deterministic;
  p.num_threads = opts.num_threads;
  p.stream = opts.stream;
  p.device_index = device.type == DeviceType::kCUDA ? device.index : 0;
}

void fill_sink_grad(const Check& check, const Options& opts, Device device, int h_q,
                    BwdParams& p) {
  const Tensor& grad = opts.learnable_sink_grad;
  if (!grad.defined()) return;
  if (!opts.learnable_sink.defined()) {
    check.fail("opts.learnable_sink_grad",
               "an undefined tensor when opts.learnable_sink is undefined (no sink, no gradient)",
               "a tensor of shape " + flashattn::shape_string(grad));
  }
  check.tensor("opts.learnable_sink_grad", grad, {h_q}, "[h_q], like opts.learnable_sink",
               DType::kFloat32, device);
  p.dsink = static_cast<float*>(grad.data);
}

namespace {

// Element (i0, i1, i2[, i3]) of a CPU int32 tensor through its strides.
std::int32_t int32_at(const Tensor& t, std::int64_t i0, std::int64_t i1, std::int64_t i2 = 0,
                      std::int64_t i3 = 0) {
  const std::int64_t idx[kMaxRank] = {i0, i1, i2, i3};
  std::int64_t off = 0;
  for (int d = 0; d < t.rank; ++d) off += idx[d] * t.stride[d];
  return static_cast<const std::int32_t*>(t.data)[off];
}

std::string list_index(std::string_view name, std::int64_t b, std::int64_t h, std::int64_t m,
                       std::int64_t e = -1) {
  std::string s = std::string(name) + "[" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                  std::to_string(m);
  if (e >= 0) s += ", " + std::to_string(e);
  return s + "]";
}

}  // namespace

void decline_block_sparse(const Check& check, const Options& opts, std::string_view why) {
  if (!opts.block_sparse.defined()) return;
  check.unsupported("opts.block_sparse", "undefined lists (" + std::string(why) + ")",
                    "a block-sparse mask");
}

namespace {

// An int32 CUDA tensor's elements copied to the host for the content checks: the span from
// its first to its last element, viewed with the same strides. False while the stream is
// captured into a CUDA graph and unless FLASHATTN_DEVICE_INDEX_CHECKS=0 (the device checks).
bool host_int32(const Tensor& t, void* stream, std::vector<std::int32_t>& buf, Tensor& view) {
  view = t;
  std::int64_t span = 1;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] == 0) span = 0;
  }
  if (span > 0) {
    for (int d = 0; d < t.rank; ++d) span += (t.shape[d] - 1) * t.stride[d];
  }
  if (detail::cuda::eager_index_checks_on_device()) return false;
  buf.assign(std::size_t(span), 0);
  if (!detail::cuda::copy_to_host_for_validation(buf.data(), t.data, buf.size() * sizeof(std::int32_t), stream)) {
    return false;
  }
  view.data = buf.data();
  return true;
}

}  // namespace

void fill_block_sparse(const Check& check, const Options& opts, bool cpu_backend, Device device,
                       const BlockSparseDims& dims, std::vector<std::uint8_t>& kinds,
                       FwdParams& p) {
  const BlockSparseTensors& bs = opts.block_sparse;
  const int batch = dims.batch, h_q = dims.h_q, s_q = dims.s_q, s_k = dims.s_k;
  const std::string sq = dims.varlen ? "max_seqlen_q" : "s_q";
  const std::string sk = dims.varlen ? "max_seqlen_k" : "s_k";
  const bool any_extra = bs.q_doc_ids.defined() || bs.k_doc_ids.defined() || bs.prefix_keys.defined();
  if (!bs.defined()) {
    if (any_extra) {
      check.fail(bs.q_doc_ids.defined()   ? "opts.block_sparse.q_doc_ids"
                 : bs.k_doc_ids.defined() ? "opts.block_sparse.k_doc_ids"
                                          : "opts.block_sparse.prefix_keys",
                 "an undefined tensor when opts.block_sparse has no block lists",
                 "a defined tensor");
    }
    return;
  }
  if (bs.block_size_q < 1) {
    check.fail("opts.block_sparse.block_size_q", ">= 1", std::to_string(bs.block_size_q));
  }
  if (bs.block_size_k < 1) {
    check.fail("opts.block_sparse.block_size_k", ">= 1", std::to_string(bs.block_size_k));
  }
  const std::int64_t M = (std::int64_t(s_q) + bs.block_size_q - 1) / bs.block_size_q;
  const std::int64_t N = (std::int64_t(s_k) + bs.block_size_k - 1) / bs.block_size_k;
  const std::string mn = "M = ceil(" + sq + " / block_size_q) = ceil(" + std::to_string(s_q) + " / " +
                         std::to_string(bs.block_size_q) + ") = " + std::to_string(M);
  const std::string nn = "N = ceil(" + sk + " / block_size_k) = ceil(" + std::to_string(s_k) + " / " +
                         std::to_string(bs.block_size_k) + ") = " + std::to_string(N);

  struct Pair {
    std::string_view cnt_name, idx_name;
    Tensor cnt, idx;  // CUDA: host copies for the content checks (below)
    std::uint8_t kind;
  };
  Pair pairs[2] = {
      {"opts.block_sparse.mask_block_cnt", "opts.block_sparse.mask_block_idx", bs.mask_block_cnt,
       bs.mask_block_idx, semantics::kBlockPartial},
      {"opts.block_sparse.full_block_cnt", "opts.block_sparse.full_block_idx", bs.full_block_cnt,
       bs.full_block_idx, semantics::kBlockFull}};
  if (!bs.mask_block_cnt.defined()) check.required("opts.block_sparse.mask_block_cnt", bs.mask_block_cnt);
  if (!bs.mask_block_idx.defined()) check.required("opts.block_sparse.mask_block_idx", bs.mask_block_idx);
  if (bs.full_block_cnt.defined() != bs.full_block_idx.defined()) {
    const bool cnt = bs.full_block_cnt.defined();
    check.fail(cnt ? "opts.block_sparse.full_block_idx" : "opts.block_sparse.full_block_cnt",
               std::string("a tensor, since opts.block_sparse.") +
                   (cnt ? "full_block_cnt" : "full_block_idx") + " is given (both or neither)",
               "an undefined tensor");
  }
  std::int64_t tb = 1, th = 1;  // the table's batch and head extents
  for (const Pair& pr : pairs) {
    if (!pr.cnt.defined()) continue;
    check.rank(pr.cnt_name, pr.cnt, 3, "[B, H, M] (B = 1 or b, H = 1 or h_q)");
    check.dtype(pr.cnt_name, pr.cnt, DType::kInt32, "");
    check.device(pr.cnt_name, pr.cnt, device, "same as q");
    check.layout(pr.cnt_name, pr.cnt);
    const std::int64_t B = pr.cnt.shape[0], H = pr.cnt.shape[1];
    if (B != 1 && B != batch) check.dim(pr.cnt_name, pr.cnt, 0, batch, "batch: 1 or b");
    if (H != 1 && H != h_q) check.dim(pr.cnt_name, pr.cnt, 1, h_q, "heads: 1 or h_q");
    check.dim(pr.cnt_name, pr.cnt, 2, M, "query blocks " + mn);
    check.rank(pr.idx_name, pr.idx, 4, "[B, H, M, N]");
    check.dtype(pr.idx_name, pr.idx, DType::kInt32, "");
    check.device(pr.idx_name, pr.idx, device, "same as q");
    check.layout(pr.idx_name, pr.idx);
    check.shape(pr.idx_name, pr.idx, {B, H, M, N},
                "[B, H, M, N] with B, H, M of " + std::string(pr.cnt_name) + " and " + nn);
    tb = std::max(tb, B);
    th = std::max(th, H);
  }

  // CUDA: the lists themselves go to the device's table build (its own checks report what
  // the host could not read); the host checks copies of them when it can.
  bool contents = true;
  std::vector<std::int32_t> host_buf[4];
  if (!cpu_backend) {
    for (int i = 0; i < 2; ++i) {
      Pair& pr = pairs[i];
      if (!pr.cnt.defined()) continue;
      FwdParams::BlockList& l = p.bs_lists[i];
      l.cnt = static_cast<const int*>(pr.cnt.data);
      l.idx = static_cast<const int*>(pr.idx.data);
      l.cnt_b = pr.cnt.shape[0] > 1 ? pr.cnt.stride[0] : 0;
      l.cnt_h = pr.cnt.shape[1] > 1 ? pr.cnt.stride[1] : 0;
      l.idx_b = pr.idx.shape[0] > 1 ? pr.idx.stride[0] : 0;
      l.idx_h = pr.idx.shape[1] > 1 ? pr.idx.stride[1] : 0;
      l.idx_m = pr.idx.stride[2];
      if (pr.idx.stride[3] != 1) {
        check.fail(pr.idx_name, "unit stride in its last dimension", std::to_string(pr.idx.stride[3]));
      }
      contents = contents && host_int32(pr.cnt, opts.stream, host_buf[2 * i], pr.cnt) &&
                 host_int32(pr.idx, opts.stream, host_buf[2 * i + 1], pr.idx);
    }
  }

  const std::int64_t plane = M * N;
  // The table has one byte per (batch, head, query block, key block) of the lists.
  constexpr std::int64_t kMaxTable = std::int64_t{1} << 31;
  if (plane > 0 && tb * th > kMaxTable / plane) {
    check.fail("opts.block_sparse",
               "at most 2^31 (batch, head, query block, key block) entries (larger blocks)",
               std::to_string(tb) + " x " + std::to_string(th) + " x " + std::to_string(M) +
                   " x " + std::to_string(N));
  }
  if (contents) kinds.assign(std::size_t(tb * th * plane), semantics::kBlockSkip);
  for (const Pair& pr : pairs) {
    if (!pr.cnt.defined() || !contents) continue;
    const std::int64_t B = pr.cnt.shape[0], H = pr.cnt.shape[1];
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t m = 0; m < M; ++m) {
          const std::int32_t cnt = int32_at(pr.cnt, b, h, m);
          if (cnt < 0 || cnt > N) {
            check.fail(pr.cnt_name, "counts in [0, " + nn + "] at " + list_index("", b, h, m),
                       std::to_string(cnt));
          }
          for (std::int32_t e = 0; e < cnt; ++e) {
            const std::int32_t n = int32_at(pr.idx, b, h, m, e);
            if (n < 0 || n >= N) {
              check.fail(pr.idx_name,
                         "key block indices in [0, N) (" + nn + ") at " + list_index("", b, h, m, e),
                         std::to_string(n));
            }
            // Fill every table entry this (b, h) covers (a broadcast list covers several).
            for (std::int64_t tbb = (B == tb ? b : 0); tbb < (B == tb ? b + 1 : tb); ++tbb)
              for (std::int64_t thh = (H == th ? h : 0); thh < (H == th ? h + 1 : th); ++thh) {
                std::uint8_t& k = kinds[std::size_t((tbb * th + thh) * plane + m * N + n)];
                if (k != semantics::kBlockSkip) {
                  check.fail(pr.idx_name,
                             "each key block listed at most once per query block (in "
                             "mask_block_idx and full_block_idx together); at " +
                                 list_index("", b, h, m, e),
                             "key block " + std::to_string(n) + " listed again");
                }
                k = pr.kind;
              }
          }
        }
  }

  if (bs.q_doc_ids.defined() != bs.k_doc_ids.defined()) {
    const bool q = bs.q_doc_ids.defined();
    check.fail(q ? "opts.block_sparse.k_doc_ids" : "opts.block_sparse.q_doc_ids",
               std::string("a tensor, since opts.block_sparse.") + (q ? "q_doc_ids" : "k_doc_ids") +
                   " is given (both or neither)",
               "an undefined tensor");
  }
  if (bs.q_doc_ids.defined() && dims.varlen) {  // packed, one id per row of q / k
    check.tensor("opts.block_sparse.q_doc_ids", bs.q_doc_ids, {dims.total_q}, "[total_q]",
                 DType::kInt32, device);
    check.tensor("opts.block_sparse.k_doc_ids", bs.k_doc_ids, {dims.total_k}, "[total_k]",
                 DType::kInt32, device);
    p.doc_ids_q = static_cast<const int*>(bs.q_doc_ids.data);
    p.doc_ids_k = static_cast<const int*>(bs.k_doc_ids.data);
  } else if (bs.q_doc_ids.defined()) {
    check.tensor("opts.block_sparse.q_doc_ids", bs.q_doc_ids, {batch, s_q}, "[b, s_q]",
                 DType::kInt32, device);
    check.tensor("opts.block_sparse.k_doc_ids", bs.k_doc_ids, {batch, s_k}, "[b, s_k]",
                 DType::kInt32, device);
    p.doc_ids_q = static_cast<const int*>(bs.q_doc_ids.data);
    p.doc_ids_k = static_cast<const int*>(bs.k_doc_ids.data);
    p.doc_q_batch_stride = bs.q_doc_ids.stride[0];
    p.doc_k_batch_stride = bs.k_doc_ids.stride[0];
  }
  if (bs.prefix_keys.defined()) {
    const Tensor& pk = bs.prefix_keys;
    if (pk.rank != 1 || (pk.shape[0] != 1 && pk.shape[0] != batch)) {
      check.fail("opts.block_sparse.prefix_keys",
                 "shape [1] or [" + std::to_string(batch) + "] ([1] or [b])",
                 flashattn::shape_string(pk));
    }
    check.dtype("opts.block_sparse.prefix_keys", pk, DType::kInt32, "");
    check.device("opts.block_sparse.prefix_keys", pk, device, "same as q");
    check.layout("opts.block_sparse.prefix_keys", pk);
    std::vector<std::int32_t> pk_buf;
    Tensor pk_host = pk;  // CUDA: the kernels read a negative prefix as 0 where no copy was made
    const bool read = cpu_backend || host_int32(pk, opts.stream, pk_buf, pk_host);
    for (std::int64_t b = 0; read && b < pk.shape[0]; ++b) {
      const std::int32_t v = int32_at(pk_host, b, 0);
      if (v < 0) {
        check.fail("opts.block_sparse.prefix_keys", "values >= 0 at [" + std::to_string(b) + "]",
                   std::to_string(v));
      }
    }
    p.prefix_keys = static_cast<const int*>(pk.data);
    p.prefix_batch_stride = pk.shape[0] > 1 ? pk.stride[0] : 0;
  }
  p.block_kinds = cpu_backend ? kinds.data() : nullptr;
  p.bs_table_batch = static_cast<int>(tb);
  p.bs_table_heads = static_cast<int>(th);
  p.bs_block_q = bs.block_size_q;
  p.bs_block_k = bs.block_size_k;
  p.bs_blocks_q = static_cast<int>(M);
  p.bs_blocks_k = static_cast<int>(N);
  p.bs_head_stride = th > 1 ? plane : 0;
  p.bs_batch_stride = tb > 1 ? th * plane : 0;
}

void fill_probs(const Check& check, const Options& opts, bool cpu_backend, Device device,
                const Shape& shape, FwdParams& p) {
  const Tensor& probs = opts.return_probs;
  if (!probs.defined()) return;
  const bool varlen = shape.size() == 3;
  if (!cpu_backend) {
    check.unsupported("opts.return_probs",
                      "an undefined tensor (only the CPU backend writes probabilities)",
                      "a tensor on " + to_string(device));
  }
  check.shape("opts.return_probs", probs, shape,
              varlen ? "[h_q, total_q, max_seqlen_k]" : "[b, h_q, s_q, s_k]");
  check.dtype("opts.return_probs", probs, DType::kFloat32, "");
  check.device("opts.return_probs", probs, device, "same as q");
  check.layout("opts.return_probs", probs);
  p.probs = static_cast<float*>(probs.data);
  if (varlen) {
    p.probs_batch_stride = 0;
    p.probs_head_stride = probs.stride[0];
    p.probs_row_stride = probs.stride[1];
  } else {
    p.probs_batch_stride = probs.stride[0];
    p.probs_head_stride = probs.stride[1];
    p.probs_row_stride = probs.stride[2];
  }
}

}  // namespace flashattn::detail::api
