// flashattn._C: the Python binding of the public C++ API.
//
// Tensors arrive as DLPack arrays (nb::ndarray of any dtype and device: numpy arrays,
// torch tensors, ...); the binding reads their pointer, dtype, shape, strides and device
// into flashattn::Tensor views and calls the library. Nothing is allocated or copied
// here: the caller (python/flashattn/*.py) allocates outputs. CUDA calls run on the
// stream passed as an integer (a cudaStream_t; 0 = the legacy default stream).
//
// C++ exceptions become Python exceptions with the same message:
//   flashattn::Unsupported     -> flashattn.UnsupportedError (InvalidArgumentError and
//                                 NotImplementedError)
//   flashattn::InvalidArgument -> flashattn.InvalidArgumentError (ValueError and
//                                 RuntimeError: flash_attn raises RuntimeError)
//   flashattn::CudaError       -> flashattn.CudaError (flashattn.Error)
//   other flashattn::Error     -> flashattn.Error (RuntimeError)
// The argument errors carry .function, .argument, .expected and .actual. The binding's own
// checks (a dtype or device the library has no name for, a rank above kMaxRank, an int out
// of range) raise the same errors before the library is called; an unknown dtype raises
// flashattn.DTypeError (InvalidArgumentError and TypeError).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <Python.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "flashattn/attention.hpp"

namespace nb = nanobind;
namespace fa = flashattn;

// A Python int (or anything with __index__ but a float), converted in the entry point with
// a range check, so that an out-of-range value is an InvalidArgumentError naming the
// argument rather than nanobind's "incompatible function arguments".
struct PyInt {
  nb::object value;
};

namespace nanobind::detail {
template <>
struct type_caster<PyInt> {
  NB_TYPE_CASTER(PyInt, const_name("int"))
  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    if (PyFloat_Check(src.ptr()) || !PyIndex_Check(src.ptr())) return false;
    value.value = borrow(src);
    return true;
  }
  static handle from_cpp(const PyInt& v, rv_policy, cleanup_list*) noexcept {
    return v.value.inc_ref();
  }
};
}  // namespace nanobind::detail

namespace {

using In = nb::ndarray<nb::ro>;  // an input: read-only arrays are accepted
using Out = nb::ndarray<>;       // an output: must be writable
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

// The Python exception types, created once at import.
PyObject* g_error = nullptr;             // flashattn.Error(RuntimeError)
PyObject* g_cuda_error = nullptr;        // flashattn.CudaError(Error)
PyObject* g_invalid_argument = nullptr;  // flashattn.InvalidArgumentError(ValueError,
                                         //                               RuntimeError)
PyObject* g_dtype_error = nullptr;       // flashattn.DTypeError(InvalidArgumentError,
                                         //                      TypeError)
PyObject* g_unsupported = nullptr;       // flashattn.UnsupportedError(InvalidArgumentError,
                                         //                            NotImplementedError)

std::string dlpack_dtype_text(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  std::string name;
  switch (static_cast<Code>(t.code)) {
    case Code::Int: name = "int"; break;
    case Code::UInt: name = "uint"; break;
    case Code::Float: name = "float"; break;
    case Code::Bfloat: name = "bfloat"; break;
    case Code::Complex: name = "complex"; break;
    case Code::Bool: name = "bool"; break;
    default: name = "DLPack type code " + std::to_string(t.code) + " of "; break;
  }
  name += std::to_string(t.bits);
  if (t.lanes != 1) name += " x " + std::to_string(t.lanes) + " lanes";
  return "dtype " + name;
}

// The entry point being bound, for the binding's own errors ("flashattn::<function>: ...").
thread_local const char* g_function = "binding";

struct Entry {
  explicit Entry(const char* name) : saved(g_function) { g_function = name; }
  ~Entry() { g_function = saved; }
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  const char* saved;
};

// A dtype the library has no DType for: flashattn.DTypeError (also a TypeError).
struct DTypeArgument : fa::InvalidArgument {
  using fa::InvalidArgument::InvalidArgument;
};

// An argument the binding refuses before the library sees the call: the library's own
// error type, with the same message format and attributes.
[[noreturn]] void binding_error(const char* argument, const std::string& expected,
                                const std::string& actual) {
  throw fa::InvalidArgument(g_function, argument, expected, actual);
}

// The index arrays: int32 only.
bool is_index_argument(const std::string& a) {
  return a == "cu_seqlens_q" || a == "cu_seqlens_k" || a == "seqused_k" ||
         a == "cache_seqlens" || a == "block_table" || a == "cache_batch_idx" ||
         a == "tree_mask" || a == "cache_leftpad";
}

std::int64_t int_in(const PyInt& v, const char* argument, std::int64_t lo, std::int64_t hi) {
  nb::object idx = nb::steal(PyNumber_Index(v.value.ptr()));
  if (!idx.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
  if (overflow == 0 && x == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0 || x < lo || x > hi) {
    binding_error(argument,
                  "an int in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
                  nb::cast<std::string>(nb::str(idx)));
  }
  return x;
}

int int32_in(const PyInt& v, const char* argument, std::int64_t lo = INT32_MIN) {
  return static_cast<int>(int_in(v, argument, lo, INT32_MAX));
}

std::uint64_t uint64_in(const PyInt& v, const char* argument) {
  nb::object idx = nb::steal(PyNumber_Index(v.value.ptr()));
  if (!idx.is_valid()) throw nb::python_error();
  const unsigned long long x = PyLong_AsUnsignedLongLong(idx.ptr());
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw nb::python_error();
    PyErr_Clear();
    binding_error(argument, "an int in [0, 18446744073709551615]",
                  nb::cast<std::string>(nb::str(idx)));
  }
  return x;
}

fa::DType to_dtype(nb::dlpack::dtype t, const char* argument) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    const auto code = static_cast<Code>(t.code);
    if (code == Code::Float && t.bits == 16) return fa::DType::kFloat16;
    if (code == Code::Bfloat && t.bits == 16) return fa::DType::kBFloat16;
    if (code == Code::Float && t.bits == 32) return fa::DType::kFloat32;
    if (code == Code::Float && t.bits == 64) return fa::DType::kFloat64;
    if (code == Code::Float8_E4M3FN && t.bits == 8) return fa::DType::kFloat8E4M3;
    if (code == Code::Int && t.bits == 32) return fa::DType::kInt32;
  }
  throw DTypeArgument(g_function, argument,
                     is_index_argument(argument)
                         ? "dtype int32"
                         : "dtype float16, bfloat16, float32, float64, float8_e4m3fn or int32",
                     dlpack_dtype_text(t));
}

fa::Device to_device(int type, int id, const char* argument) {
  if (type == nb::device::cpu::value) return fa::Device::cpu();
  if (type == nb::device::cuda::value) return fa::Device::cuda(id);
  binding_error(argument, "a CPU or CUDA array",
                "DLPack device type " + std::to_string(type));
}

template <typename Array>
fa::Tensor to_tensor(const Array& a, const char* argument) {
  fa::Tensor t;
  if (a.ndim() < 1 || a.ndim() > static_cast<std::size_t>(fa::kMaxRank)) {
    binding_error(argument, "rank 1 .. " + std::to_string(fa::kMaxRank), "rank " + std::to_string(a.ndim()));
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = to_dtype(a.dtype(), argument);
  t.rank = static_cast<int>(a.ndim());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = static_cast<std::int64_t>(a.shape(static_cast<std::size_t>(i)));
    t.stride[i] = a.stride(static_cast<std::size_t>(i));
  }
  t.device = to_device(a.device_type(), a.device_id(), argument);
  return t;
}

template <typename Array>
fa::Tensor to_tensor(const std::optional<Array>& a, const char* argument) {
  return a ? to_tensor(*a, argument) : fa::Tensor{};
}

// The CUDA kernel family and shared-memory cap of every call from this process
// (flashattn.set_kernel_family): process-wide, not per thread, because torch runs a
// backward on its own autograd threads. A tuning knob: results never depend on it.
std::atomic<int> g_kernel_family{static_cast<int>(fa::KernelFamily::kAuto)};
std::atomic<int> g_smem_cap{0};

fa::KernelFamily kernel_family_in(const std::string& name) {
  if (name == "auto") return fa::KernelFamily::kAuto;
  if (name == "sm80") return fa::KernelFamily::kSm80;
  if (name == "sm90") return fa::KernelFamily::kSm90;
  binding_error("family", "'auto', 'sm80' or 'sm90'", "'" + name + "'");
}

const char* kernel_family_out(fa::KernelFamily f) {
  switch (f) {
    case fa::KernelFamily::kSm80: return "sm80";
    case fa::KernelFamily::kSm90: return "sm90";
    default: return "auto";
  }
}

// Options shared by every entry point; keyword arguments of the same names in Python.
struct CommonOptions {
  std::optional<double> softmax_scale;
  bool causal = false;
  PyInt window_left;
  PyInt window_right;
  double softcap = 0.0;
  OptIn alibi_slopes;
  double dropout_p = 0.0;
  PyInt seed;
  PyInt offset;
  bool deterministic = false;
  OptOut return_probs;
  std::uintptr_t stream = 0;
  PyInt num_threads;
  OptIn learnable_sink;
  OptOut learnable_sink_grad;
  OptIn qv;  // (the order of FA_COMMON_VALUES: aggregate initialisation)
  // Block-sparse mask (fa::BlockSparseTensors; dense entry points on the CPU).
  OptIn mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx;
  PyInt block_size_q, block_size_k;
  OptIn q_doc_ids, k_doc_ids, prefix_keys;
  // fp8 q, k, v: fp32 [b, h_k] descales (FlashAttention-3's names).
  OptIn q_descale, k_descale, v_descale;

  fa::Options build() const {
    fa::Options o;
    if (softmax_scale) o.softmax_scale = static_cast<float>(*softmax_scale);
    o.causal = causal;
    o.window_left = int32_in(window_left, "window_left");
    o.window_right = int32_in(window_right, "window_right");
    o.softcap = static_cast<float>(softcap);
    o.alibi_slopes = to_tensor(alibi_slopes, "alibi_slopes");
    o.dropout_p = static_cast<float>(dropout_p);
    o.seed = uint64_in(seed, "seed");
    o.offset = uint64_in(offset, "offset");
    o.deterministic = deterministic;
    o.stream = reinterpret_cast<void*>(stream);
    o.num_threads = int32_in(num_threads, "num_threads");
    o.return_probs = to_tensor(return_probs, "return_probs");
    o.learnable_sink = to_tensor(learnable_sink, "learnable_sink");
    o.learnable_sink_grad = to_tensor(learnable_sink_grad, "learnable_sink_grad");
    fa::BlockSparseTensors& bs = o.block_sparse;
    bs.mask_block_cnt = to_tensor(mask_block_cnt, "mask_block_cnt");
    bs.mask_block_idx = to_tensor(mask_block_idx, "mask_block_idx");
    bs.full_block_cnt = to_tensor(full_block_cnt, "full_block_cnt");
    bs.full_block_idx = to_tensor(full_block_idx, "full_block_idx");
    bs.block_size_q = int32_in(block_size_q, "block_size_q");
    bs.block_size_k = int32_in(block_size_k, "block_size_k");
    bs.q_doc_ids = to_tensor(q_doc_ids, "q_doc_ids");
    bs.k_doc_ids = to_tensor(k_doc_ids, "k_doc_ids");
    bs.prefix_keys = to_tensor(prefix_keys, "prefix_keys");
    o.qv = to_tensor(qv, "qv");
    o.q_descale = to_tensor(q_descale, "q_descale");
    o.k_descale = to_tensor(k_descale, "k_descale");
    o.v_descale = to_tensor(v_descale, "v_descale");
    o.kernel_family = static_cast<fa::KernelFamily>(g_kernel_family.load(std::memory_order_relaxed));
    o.smem_cap = g_smem_cap.load(std::memory_order_relaxed);
    return o;
  }
};

fa::Workspace to_workspace(const OptOut& ws) {
  if (!ws) return {};
  return {ws->data(), ws->nbytes()};
}

// ------------------------------------------------------------------ exceptions

PyObject* new_exception(nb::module_& m, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = std::string("flashattn.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

void raise_argument_error(PyObject* type, const fa::InvalidArgument& e) {
  nb::object exc = nb::borrow(type)(nb::str(e.what()));
  exc.attr("function") = nb::str(e.function().c_str());
  exc.attr("argument") = nb::str(e.argument().c_str());
  exc.attr("expected") = nb::str(e.expected().c_str());
  exc.attr("actual") = nb::str(e.actual().c_str());
  PyErr_SetObject(type, exc.ptr());
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const fa::Unsupported& e) {
    raise_argument_error(g_unsupported, e);
  } catch (const DTypeArgument& e) {
    raise_argument_error(g_dtype_error, e);
  } catch (const fa::InvalidArgument& e) {
    raise_argument_error(g_invalid_argument, e);
  } catch (const fa::CudaError& e) {
    PyErr_SetString(g_cuda_error, e.what());
  } catch (const fa::Error& e) {
    PyErr_SetString(g_error, e.what());
  }
}

void register_exceptions(nb::module_& m) {
  g_error = new_exception(m, "Error", PyExc_RuntimeError,
                          "A flashattn error that is not about the arguments.");
  g_cuda_error = new_exception(m, "CudaError", g_error,
                               "The CUDA runtime reported an error while running a call.");
  // Also a RuntimeError: flash_attn's argument checks (TORCH_CHECK) raise RuntimeError, so
  // code written for it catches these too.
  nb::object invalid_bases =
      nb::make_tuple(nb::handle(PyExc_ValueError), nb::handle(PyExc_RuntimeError));
  g_invalid_argument = new_exception(
      m, "InvalidArgumentError", invalid_bases.ptr(),
      "An argument is malformed: wrong shape, dtype, stride, alignment, range or aliasing.\n"
      "A ValueError and a RuntimeError. Attributes: function, argument, expected, actual.");
  nb::object dtype_bases =
      nb::make_tuple(nb::handle(g_invalid_argument), nb::handle(PyExc_TypeError));
  g_dtype_error = new_exception(
      m, "DTypeError", dtype_bases.ptr(),
      "An array's dtype is none the library has a name for (int64, bool, uint8, ...):\n"
      "an InvalidArgumentError and a TypeError.");
  nb::object unsupported_bases =
      nb::make_tuple(nb::handle(g_invalid_argument), nb::handle(PyExc_NotImplementedError));
  g_unsupported = new_exception(
      m, "UnsupportedError", unsupported_bases.ptr(),
      "The arguments are well formed but the backend cannot run them (a head dim, dtype\n"
      "or feature it does not support, or a backend not built).");
  nb::register_exception_translator(translate);
}

// ------------------------------------------------------------------ entry points

#define FA_COMMON_ARGS                                                                      \
  std::optional<double> softmax_scale, bool causal, PyInt window_left, PyInt window_right,  \
      double softcap, OptIn alibi_slopes, double dropout_p, PyInt seed, PyInt offset,       \
      bool deterministic, OptOut return_probs, std::uintptr_t stream, PyInt num_threads,   \
      OptIn learnable_sink, OptOut learnable_sink_grad, OptIn qv, OptIn mask_block_cnt,     \
      OptIn mask_block_idx, OptIn full_block_cnt, OptIn full_block_idx, PyInt block_size_q, \
      PyInt block_size_k, OptIn q_doc_ids, OptIn k_doc_ids, OptIn prefix_keys,             \
      OptIn q_descale, OptIn k_descale, OptIn v_descale

#define FA_COMMON_VALUES                                                                \
  CommonOptions {                                                                       \
    softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, \
        seed, offset, deterministic, return_probs, stream, num_threads, learnable_sink, \
        learnable_sink_grad, qv, mask_block_cnt, mask_block_idx, full_block_cnt,        \
        full_block_idx, block_size_q, block_size_k, q_doc_ids, k_doc_ids, prefix_keys,  \
        q_descale, k_descale, v_descale                                                 \
  }

// The keyword arguments of CommonOptions, all optional.
#define FA_COMMON_KWARGS                                                                   \
  nb::kw_only(), nb::arg("softmax_scale") = nb::none(), nb::arg("causal") = false,         \
      nb::arg("window_left") = -1, nb::arg("window_right") = -1, nb::arg("softcap") = 0.0, \
      nb::arg("alibi_slopes") = nb::none(), nb::arg("dropout_p") = 0.0,                    \
      nb::arg("seed") = 0, nb::arg("offset") = 0, nb::arg("deterministic") = false,        \
      nb::arg("return_probs") = nb::none(), nb::arg("stream") = 0,                         \
      nb::arg("num_threads") = 0, nb::arg("learnable_sink") = nb::none(),                  \
      nb::arg("learnable_sink_grad") = nb::none(), nb::arg("qv") = nb::none(),              \
      nb::arg("mask_block_cnt") = nb::none(),                                               \
      nb::arg("mask_block_idx") = nb::none(), nb::arg("full_block_cnt") = nb::none(),       \
      nb::arg("full_block_idx") = nb::none(), nb::arg("block_size_q") = 128,                \
      nb::arg("block_size_k") = 128, nb::arg("q_doc_ids") = nb::none(),                     \
      nb::arg("k_doc_ids") = nb::none(), nb::arg("prefix_keys") = nb::none(),              \
      nb::arg("q_descale") = nb::none(), nb::arg("k_descale") = nb::none(),                 \
      nb::arg("v_descale") = nb::none()

fa::VarlenArgs varlen_args(const In& q, const In& k, const In& v, const In& cu_seqlens_q,
                           const In& cu_seqlens_k, const OptIn& seqused_k, const PyInt& max_seqlen_q,
                           const PyInt& max_seqlen_k, const OptIn& seqused_q) {
  fa::VarlenArgs a;
  a.q = to_tensor(q, "q");
  a.k = to_tensor(k, "k");
  a.v = to_tensor(v, "v");
  a.cu_seqlens_q = to_tensor(cu_seqlens_q, "cu_seqlens_q");
  a.cu_seqlens_k = to_tensor(cu_seqlens_k, "cu_seqlens_k");
  a.seqused_k = to_tensor(seqused_k, "seqused_k");
  a.seqused_q = to_tensor(seqused_q, "seqused_q");
  a.max_seqlen_q = int32_in(max_seqlen_q, "max_seqlen_q");
  a.max_seqlen_k = int32_in(max_seqlen_k, "max_seqlen_k");
  return a;
}

// The cache is writable for kvcache_forward (the append) and read-only for the size query.
template <typename Cache>
fa::KVCacheArgs kvcache_args(const In& q, const Cache& k_cache, const Cache& v_cache,
                             const In& cache_seqlens, const OptIn& block_table,
                             const OptIn& cache_batch_idx, const OptIn& k_new,
                             const OptIn& v_new, const PyInt& num_splits, const OptIn& k_scale,
                             const OptIn& v_scale, const OptIn& tree_mask,
                             const OptIn& cache_leftpad) {
  fa::KVCacheArgs a;
  a.q = to_tensor(q, "q");
  a.k_cache = to_tensor(k_cache, "k_cache");
  a.v_cache = to_tensor(v_cache, "v_cache");
  a.cache_seqlens = to_tensor(cache_seqlens, "cache_seqlens");
  a.block_table = to_tensor(block_table, "block_table");
  a.cache_batch_idx = to_tensor(cache_batch_idx, "cache_batch_idx");
  a.k_new = to_tensor(k_new, "k_new");
  a.v_new = to_tensor(v_new, "v_new");
  a.num_splits = int32_in(num_splits, "num_splits");
  a.k_scale = to_tensor(k_scale, "k_scale");
  a.v_scale = to_tensor(v_scale, "v_scale");
  a.tree_mask = to_tensor(tree_mask, "tree_mask");
  a.cache_leftpad = to_tensor(cache_leftpad, "cache_leftpad");
  return a;
}

// The fp8-cache scales and the draft-tree mask: keyword-only, after the common options.
#define FA_KVCACHE_KWARGS                                                        \
  nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(), \
      nb::arg("tree_mask").none() = nb::none(), nb::arg("cache_leftpad").none() = nb::none()

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashattn: exact FlashAttention over DLPack arrays (the C++ API, bound by nanobind)";
  register_exceptions(m);

  m.def("version", [] { return std::string(fa::version()); }, "The library version.");
  m.def("cuda_available", &fa::cuda_available,
        "True when this build has the CUDA backend and a CUDA device is visible.");
  m.def(
      "check_errors",
      [](const PyInt& device) {
        const Entry entry("check_errors");
        const int d = int32_in(device, "device", -1);
        fa::check_errors(d);
      },
      nb::arg("device") = -1,
      "Raise the first bad index tensor value that the device checks of earlier CUDA calls "
      "found on `device` (-1: any device) as an InvalidArgumentError naming the tensor, the "
      "entry, the expected range and the value, and clear it; None when there is none. CUDA "
      "calls check cu_seqlens, seqused, cache_seqlens, cache_batch_idx, block_table and "
      "block-sparse lists on the device without synchronising (a KV-cache append whose "
      "targets conflict writes nothing), so such an error is raised by the next CUDA call on "
      "that device or by this function. It does not synchronise either: synchronise the "
      "stream first (torch.cuda.synchronize()) to see the checks of the work on it. Without "
      "CUDA (a CPU build, or no GPU) there is nothing to raise: it returns None.");
  m.def(
      "set_kernel_family",
      [](const std::string& family, const PyInt& smem_cap) {
        const Entry entry("set_kernel_family");
        const fa::KernelFamily f = kernel_family_in(family);
        const int cap = int32_in(smem_cap, "smem_cap", 0);
        if (cap != 0 && cap < 99 * 1024) {
          binding_error("smem_cap", "0 (the device's limit) or a byte count >= 101376 (99 KiB)",
                        std::to_string(cap));
        }
        g_kernel_family.store(static_cast<int>(f), std::memory_order_relaxed);
        g_smem_cap.store(cap, std::memory_order_relaxed);
      },
      nb::arg("family"), nb::arg("smem_cap") = 0,
      "Choose the CUDA kernel family ('auto', 'sm80' or 'sm90') and the most shared memory per "
      "block a configuration may use (0: the device's limit) for every later call from this "
      "process, on every thread. 'auto' with 0 restores the default (the environment "
      "variables FLASHATTN_KERNEL_FAMILY / FLASHATTN_SMEM_CAP, else the best for the GPU). "
      "Forcing a family the GPU cannot run makes calls raise UnsupportedError. Results never "
      "depend on it.");
  m.def(
      "get_kernel_family",
      [] {
        return nb::make_tuple(
            kernel_family_out(static_cast<fa::KernelFamily>(g_kernel_family.load(std::memory_order_relaxed))),
            g_smem_cap.load(std::memory_order_relaxed));
      },
      "(family, smem_cap) as set by set_kernel_family.");

  m.def(
      "forward",
      [](const In& q, const In& k, const In& v, const Out& out, const OptOut& lse,
         FA_COMMON_ARGS) {
        const Entry entry("forward");
        const fa::Options o = FA_COMMON_VALUES.build();
        const fa::Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v"),
                         to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        nb::gil_scoped_release release;
        fa::forward(tq, tk, tv, to, tl, o);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
      FA_COMMON_KWARGS,
      "out, lse <- attention(q [b, s_q, h_q, d], k, v [b, s_k, h_k, d]); lse [b, h_q, s_q] "
      "float32 or None.");

  m.def(
      "backward",
      [](const In& dout, const In& q, const In& k, const In& v, const In& out, const In& lse,
         const Out& dq, const Out& dk, const Out& dv, const OptOut& workspace, FA_COMMON_ARGS) {
        const Entry entry("backward");
        const fa::Options o = FA_COMMON_VALUES.build();
        const fa::Tensor tdo = to_tensor(dout, "dout"), tq = to_tensor(q, "q"),
                         tk = to_tensor(k, "k"), tv = to_tensor(v, "v"),
                         to = to_tensor(out, "out"), tl = to_tensor(lse, "lse"),
                         tdq = to_tensor(dq, "dq"), tdk = to_tensor(dk, "dk"),
                         tdv = to_tensor(dv, "dv");
        const fa::Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        fa::backward(tdo, tq, tk, tv, to, tl, tdq, tdk, tdv, o, ws);
      },
      nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"),
      nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("workspace").none() = nb::none(),
      FA_COMMON_KWARGS,
      "dq, dk, dv <- gradients of forward; dk, dv are summed over each GQA group. "
      "workspace: a byte array of at least backward_workspace_size bytes, or None.");

  m.def(
      "backward_workspace_size",
      [](const In& q, const In& k, const In& v, FA_COMMON_ARGS) {
        const Entry entry("backward_workspace_size");
        const fa::Options o = FA_COMMON_VALUES.build();
        return fa::backward_workspace_size(to_tensor(q, "q"), to_tensor(k, "k"),
                                           to_tensor(v, "v"), o);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), FA_COMMON_KWARGS,
      "Bytes of scratch backward wants (0 if none).");

  m.def(
      "varlen_forward",
      [](const In& q, const In& k, const In& v, const In& cu_seqlens_q, const In& cu_seqlens_k,
         const OptIn& seqused_k, const PyInt& max_seqlen_q, const PyInt& max_seqlen_k, const Out& out,
         const OptOut& lse, FA_COMMON_ARGS, const OptIn& seqused_q) {
        const Entry entry("varlen_forward");
        const fa::Options o = FA_COMMON_VALUES.build();
        const fa::VarlenArgs a = varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                             max_seqlen_q, max_seqlen_k, seqused_q);
        const fa::Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        nb::gil_scoped_release release;
        fa::varlen_forward(a, to, tl, o);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
      nb::arg("seqused_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("out"), nb::arg("lse").none(), FA_COMMON_KWARGS,
      nb::arg("seqused_q").none() = nb::none(),
      "Packed sequences: q [total_q, h_q, d], k, v [total_k, h_k, d], cu_seqlens int32 [b + 1]; "
      "lse [h_q, total_q].");

  m.def(
      "varlen_backward",
      [](const In& q, const In& k, const In& v, const In& cu_seqlens_q, const In& cu_seqlens_k,
         const OptIn& seqused_k, const PyInt& max_seqlen_q, const PyInt& max_seqlen_k, const In& dout,
         const In& out, const In& lse, const Out& dq, const Out& dk, const Out& dv,
         const OptOut& workspace, FA_COMMON_ARGS, const OptIn& seqused_q) {
        const Entry entry("varlen_backward");
        const fa::Options o = FA_COMMON_VALUES.build();
        const fa::VarlenArgs a = varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                             max_seqlen_q, max_seqlen_k, seqused_q);
        const fa::Tensor tdo = to_tensor(dout, "dout"), to = to_tensor(out, "out"),
                         tl = to_tensor(lse, "lse"), tdq = to_tensor(dq, "dq"),
                         tdk = to_tensor(dk, "dk"), tdv = to_tensor(dv, "dv");
        const fa::Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        fa::varlen_backward(a, tdo, to, tl, tdq, tdk, tdv, o, ws);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
      nb::arg("seqused_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("dout"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"), nb::arg("dk"),
      nb::arg("dv"), nb::arg("workspace").none() = nb::none(), FA_COMMON_KWARGS,
      nb::arg("seqused_q").none() = nb::none(), "Gradients of varlen_forward.");

  m.def(
      "varlen_backward_workspace_size",
      [](const In& q, const In& k, const In& v, const In& cu_seqlens_q, const In& cu_seqlens_k,
         const OptIn& seqused_k, const PyInt& max_seqlen_q, const PyInt& max_seqlen_k, FA_COMMON_ARGS,
         const OptIn& seqused_q) {
        const Entry entry("varlen_backward_workspace_size");
        const fa::Options o = FA_COMMON_VALUES.build();
        return fa::varlen_backward_workspace_size(
            varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, seqused_q),
            o);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
      nb::arg("seqused_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      FA_COMMON_KWARGS, nb::arg("seqused_q").none() = nb::none(),
      "Bytes of scratch varlen_backward wants (0 if none).");

  m.def(
      "kvcache_forward",
      [](const In& q, const Out& k_cache, const Out& v_cache, const In& cache_seqlens,
         const OptIn& block_table, const OptIn& cache_batch_idx, const OptIn& k_new,
         const OptIn& v_new, const PyInt& num_splits, const Out& out, const OptOut& lse,
         const OptOut& workspace, FA_COMMON_ARGS, const OptIn& k_scale, const OptIn& v_scale,
         const OptIn& tree_mask, const OptIn& cache_leftpad) {
        const Entry entry("kvcache_forward");
        const fa::Options o = FA_COMMON_VALUES.build();
        const fa::KVCacheArgs a = kvcache_args(q, k_cache, v_cache, cache_seqlens, block_table,
                                               cache_batch_idx, k_new, v_new, num_splits, k_scale,
                                               v_scale, tree_mask, cache_leftpad);
        const fa::Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        const fa::Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        fa::kvcache_forward(a, to, tl, o, ws);
      },
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("cache_seqlens"),
      nb::arg("block_table").none(), nb::arg("cache_batch_idx").none(), nb::arg("k_new").none(),
      nb::arg("v_new").none(), nb::arg("num_splits"), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("workspace").none() = nb::none(), FA_COMMON_KWARGS, FA_KVCACHE_KWARGS,
      "Attention against a dense or paged KV cache; k_new/v_new are first written into the "
      "cache in place at cache_seqlens (which is not advanced). An fp8 cache (float8_e4m3fn) "
      "takes k_scale, v_scale (float32 [h_k] or [k_cache.shape[0], h_k]); tree_mask (int32 "
      "[b, s_q, ceil(s_q / 32)]) restricts which of the last s_q keys (the drafts) each query "
      "sees. v_cache / v_new / out may have another head dim d_v than q / k_cache; qv ([b, s_q, "
      "h_q, d_v], a common option: MLA decode as FlashAttention-3's qv) adds qv . v to each "
      "score; cache_leftpad (int32 [b], dense caches) starts sequence i's keys at cache row "
      "cache_leftpad[i].");

  m.def(
      "kvcache_workspace_size",
      [](const In& q, const In& k_cache, const In& v_cache, const In& cache_seqlens,
         const OptIn& block_table, const OptIn& cache_batch_idx, const OptIn& k_new,
         const OptIn& v_new, const PyInt& num_splits, FA_COMMON_ARGS, const OptIn& k_scale,
         const OptIn& v_scale, const OptIn& tree_mask, const OptIn& cache_leftpad) {
        const Entry entry("kvcache_workspace_size");
        const fa::Options o = FA_COMMON_VALUES.build();
        const fa::KVCacheArgs a = kvcache_args(q, k_cache, v_cache, cache_seqlens, block_table,
                                               cache_batch_idx, k_new, v_new, num_splits, k_scale,
                                               v_scale, tree_mask, cache_leftpad);
        return fa::kvcache_workspace_size(a, o);
      },
      nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("cache_seqlens"),
      nb::arg("block_table").none(), nb::arg("cache_batch_idx").none(), nb::arg("k_new").none(),
      nb::arg("v_new").none(), nb::arg("num_splits"), FA_COMMON_KWARGS, FA_KVCACHE_KWARGS,
      "Bytes of scratch kvcache_forward wants (0 if none).");
}
