#include "api/dispatch.hpp"

#include <algorithm>
#include <new>
#include <string>

#include "core/backend.hpp"
#include "core/kernel_family.hpp"

namespace flashattn::detail::api {

namespace {

constexpr int kMaxHeadDimCuda = 512;  // CUDA kernels: forward, backward, KV cache (the 512 bucket)
constexpr int kMaxHeadDimCpu = 512;  // CPU backend (tiles sized at run time)
constexpr std::size_t kCudaAlignBytes = 16;
constexpr std::int64_t kCudaStrideMultiple = 8;
constexpr std::size_t kWorkspaceAlignBytes = 16;
constexpr std::align_val_t kScratchAlign{64};

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kAuto: return "Backend::kAuto";
    case Backend::kCPU: return "Backend::kCPU";
    case Backend::kCUDA: return "Backend::kCUDA";
  }
  return "an unknown backend";
}

}  // namespace

Target resolve_target(const Check& check, const Options& opts, Device device) {
  const bool on_cuda = device.type == DeviceType::kCUDA;
  const Backend wanted = on_cuda ? Backend::kCUDA : Backend::kCPU;
  if (opts.backend != Backend::kAuto && opts.backend != wanted) {
    check.fail("opts.backend",
               std::string("Backend::kAuto or ") + backend_name(wanted) + " (the tensors are on " +
                   to_string(device) + ")",
               backend_name(opts.backend));
  }
  if (!on_cuda) return Target::kCPU;

  if (!cuda::built()) {
    check.unsupported("q", "tensors on a device this build runs (a build without CUDA runs cpu)",
                      to_string(device) + " (configure with FLASHATTN_CUDA=ON)");
  }
  const int count = cuda::device_count();
  if (count == 0) {
    check.unsupported("q", "a visible CUDA device for a tensor on " + to_string(device),
                      "no CUDA device visible");
  }
  if (device.index < 0 || device.index >= count) {
    check.fail("q", "a device ordinal in [0, " + std::to_string(count) + ") (visible CUDA devices)",
               to_string(device));
  }
  const int cc = cuda::compute_capability(device.index);
  if (cc < kMinComputeCapability) {
    check.unsupported("q", "a GPU of compute capability >= 8.0 (the sm80 kernel family)",
                      compute_capability_string(cc) + " on " + to_string(device));
  }
  // A bad index that an earlier call's device check found is this call's error (before
  // anything of this call runs); flashattn::check_errors() raises it without a call.
  cuda::prepare_index_checks(device.index, opts.stream);
  cuda::raise_index_error(device.index);
  return Target::kCUDA;
}

void fill_kernel_options(const Check& check, const Options& opts, Device device, FwdParams& p) {
  if (opts.kernel_family != KernelFamily::kAuto && opts.kernel_family != KernelFamily::kSm80 &&
      opts.kernel_family != KernelFamily::kSm90) {
    check.fail("opts.kernel_family", "KernelFamily::kAuto, kSm80 or kSm90",
               std::to_string(static_cast<int>(opts.kernel_family)));
  }
  if (opts.smem_cap != 0 && opts.smem_cap < kMinSmemPerBlock) {
    check.fail("opts.smem_cap",
               "0 (the device's limit) or a byte count >= " + std::to_string(kMinSmemPerBlock),
               std::to_string(opts.smem_cap));
  }
  p.kernel_family = opts.kernel_family;
  p.smem_cap = opts.smem_cap;
  if (device.type != DeviceType::kCUDA) return;
  // The environment fills what the Options leave at their defaults; a malformed variable
  // fails the CUDA calls that would read it.
  const KernelEnv& env = kernel_env();
  if (p.kernel_family == KernelFamily::kAuto) {
    if (!env.family.ok) check.fail(env.family.name, env.family.expected, env.family.actual);
    p.kernel_family = env.request.family;
  }
  if (p.smem_cap == 0) {
    if (!env.smem_cap.ok) check.fail(env.smem_cap.name, env.smem_cap.expected, env.smem_cap.actual);
    p.smem_cap = env.request.smem_cap;
  }
}

void check_supported(const Check& check, Target target, DType dtype, int d, int d_v, int batch,
                     int h_q, CudaCall call, std::string_view v_name) {
  const bool fp8 = dtype == DType::kFloat8E4M3;
  const bool fp8_call = call != CudaCall::kBackward;  // fp8 q: the forward and KV-cache calls
  if (fp8 && target == Target::kCUDA && !fp8_call) {
    check.unsupported("q",
                      "dtype float16 or bfloat16 (CUDA backend: float8_e4m3 q, k, v run on CUDA "
                      "in forward, varlen_forward and kvcache_forward only; here they run on the "
                      "CPU backend)",
                      dtype_name(dtype));
  }
  if (dtype == DType::kInt32) {
    check.fail("q", "a floating-point dtype", dtype_name(dtype));
  }
  if (target == Target::kCPU) {
    if (d < 1 || d > kMaxHeadDimCpu) {
      check.unsupported("q", "head dim d in [1, 512] (CPU backend)", "d = " + std::to_string(d));
    }
    if (d_v < 1 || d_v > kMaxHeadDimCpu) {
      check.unsupported(v_name, "head dim d_v in [1, 512] (CPU backend)",
                        "d_v = " + std::to_string(d_v));
    }
    return;
  }
  constexpr int kMaxGridYZ = 65535;  // the kernels index heads and sequences by grid y and z
  if (batch > kMaxGridYZ) {
    check.unsupported("q", "at most 65535 sequences per call (CUDA backend)",
                      std::to_string(batch) + " sequences");
  }
  if (h_q > kMaxGridYZ) {
    check.unsupported("q", "at most 65535 query heads (CUDA backend)", std::to_string(h_q) + " heads");
  }
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16 && !fp8) {
    check.unsupported("q",
                      fp8_call ? "dtype float16, bfloat16 or float8_e4m3 (CUDA backend)"
                               : "dtype float16 or bfloat16 (CUDA backend)",
                      dtype_name(dtype));
  }
  if (call == CudaCall::kMla) {
    // The MLA kernel (src/cuda/sm80/mla_kernel.cuh): q / k padded to 64 dims, qv / v to 512.
    if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
      check.unsupported("q", "dtype float16 or bfloat16 with opts.qv (CUDA backend)", dtype_name(dtype));
    }
    if (d < 8 || d % 8 != 0 || d > 64) {
      check.unsupported("q",
                        "head dim with d % 8 == 0 and 8 <= d <= 64 with opts.qv (CUDA MLA kernel: d is the rope part)",
                        "d = " + std::to_string(d));
    }
    if (d_v < 8 || d_v % 8 != 0 || d_v > 512) {
      check.unsupported(v_name, "head dim with d_v % 8 == 0 and 8 <= d_v <= 512 with opts.qv (CUDA MLA kernel)",
                        "d_v = " + std::to_string(d_v));
    }
    return;
  }
  // Every call (forward, backward, KV cache; dense and varlen): d to 512.
  const std::string max_d = std::to_string(kMaxHeadDimCuda);
  if (d < 1 || d % 8 != 0 || d > kMaxHeadDimCuda) {
    check.unsupported("q", "head dim with d % 8 == 0 and 8 <= d <= " + max_d + " (CUDA backend)",
                      "d = " + std::to_string(d));
  }
  if (d_v < 1 || d_v % 8 != 0 || d_v > kMaxHeadDimCuda) {
    check.unsupported(v_name, "head dim with d_v % 8 == 0 and 8 <= d_v <= " + max_d + " (CUDA backend)",
                      "d_v = " + std::to_string(d_v));
  }
  // The kernels run d_v != d in the bucket of the larger head dim.
  if (!cuda::supports_wide_head_dim(std::max(d, d_v))) {
    check.unsupported(d_v > d ? v_name : std::string_view("q"),
                      "a head dim compiled into this build (FLASHATTN_HEAD_DIMS)",
                      d_v > d ? "d_v = " + std::to_string(d_v) : "d = " + std::to_string(d));
  }
}

void check_kvcache_head_dim_v(const Check& check, Target target, int d, int d_v, bool fp8_cache,
                              bool tree_mask) {
  if (target != Target::kCUDA || d_v == d || (!fp8_cache && !tree_mask)) return;
  const std::string with = fp8_cache && tree_mask ? "a float8_e4m3 cache and a draft-tree mask (tree_mask)"
                           : fp8_cache            ? "a float8_e4m3 cache (k_cache, v_cache)"
                                                  : "a draft-tree mask (tree_mask)";
  check.unsupported("v_cache",
                    "head dim d_v == d = " + std::to_string(d) + " with " + with +
                        " on CUDA (only the decode kernel runs fp8 caches and draft-tree masks, "
                        "and it has one head dim; d_v != d runs on CUDA with 16-bit caches and "
                        "no tree mask, and on the CPU backend with both)",
                    "d_v = " + std::to_string(d_v));
}

void check_cuda_layout(const Check& check, std::string_view name, const Tensor& t) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % kCudaAlignBytes != 0) {
    check.fail(name, "data 16-byte aligned (CUDA backend)", "address " + address_string(t.data));
  }
  for (int i = 0; i + 1 < t.rank; ++i) {
    // 16-byte aligned rows: 8 elements of 16 bits, 16 of an fp8 cache.
    const std::int64_t multiple =
        std::max<std::int64_t>(kCudaStrideMultiple,
                               static_cast<std::int64_t>(kCudaAlignBytes / dtype_size(t.dtype)));
    if (t.shape[i] > 1 && t.stride[i] % multiple != 0) {
      check.fail(name,
                 "stride[" + std::to_string(i) + "] a multiple of " + std::to_string(multiple) +
                     " elements (CUDA backend: 16-byte aligned rows)",
                 std::to_string(t.stride[i]));
    }
  }
}

void check_cuda_layouts(const Check& check, Target target, std::initializer_list<Arg> tensors) {
  if (target != Target::kCUDA) return;
  for (const Arg& a : tensors) {
    if (a.tensor.defined()) check_cuda_layout(check, a.name, a.tensor);
  }
}

std::optional<std::vector<std::int32_t>> read_int32(const Tensor& t, Target target,
                                                    void* stream) {
  const std::int64_t rows = t.rank == 2 ? t.shape[0] : 1;
  const std::int64_t cols = t.shape[t.rank - 1];
  const std::int64_t row_stride = t.rank == 2 ? t.stride[0] : 0;
  std::vector<std::int32_t> values(static_cast<std::size_t>(rows * cols));
  if (values.empty()) return values;

  const std::int32_t* src = static_cast<const std::int32_t*>(t.data);
  std::vector<std::int32_t> staged;
  if (target == Target::kCUDA) {
    // By default no host copy, no synchronisation: the call checks its indices on the
    // device (cuda::check_indices_on_device), as under graph capture. With
    // FLASHATTN_DEVICE_INDEX_CHECKS=0 they are copied here, outside capture.
    if (cuda::eager_index_checks_on_device()) return std::nullopt;
    // One copy of the span from the first to the last element, then gather on the host.
    staged.resize(static_cast<std::size_t>((rows - 1) * row_stride + cols));
    if (!cuda::copy_to_host_for_validation(staged.data(), t.data,
                                           staged.size() * sizeof(std::int32_t), stream)) {
      return std::nullopt;
    }
    src = staged.data();
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      values[static_cast<std::size_t>(r * cols + c)] = src[r * row_stride + c];
    }
  }
  return values;
}

Scratch::~Scratch() {
  if (data_ == nullptr) return;
  if (target_ == Target::kCUDA) {
    cuda::free_async(data_, stream_);
  } else {
    ::operator delete[](data_, kScratchAlign);
  }
}

void* Scratch::allocate(Target target, std::size_t bytes, void* stream) {
  target_ = target;
  stream_ = stream;
  data_ = target == Target::kCUDA ? cuda::alloc_async(bytes, stream)
                                  : ::operator new[](bytes, kScratchAlign);
  return data_;
}

void attach_workspace(const Check& check, Target target, const Workspace& ws,
                      std::size_t needed, FwdParams& p, Scratch& scratch) {
  if (ws.bytes == 0) {
    if (needed > 0) {
      p.workspace = scratch.allocate(target, needed, p.stream);
      p.workspace_bytes = needed;
    }
    return;
  }
  if (ws.data == nullptr) {
    check.fail("workspace", "non-null data for " + std::to_string(ws.bytes) + " bytes", "nullptr");
  }
  if (ws.bytes < needed) {
    check.fail("workspace", ">= " + std::to_string(needed) + " bytes",
               std::to_string(ws.bytes) + " bytes");
  }
  if (reinterpret_cast<std::uintptr_t>(ws.data) % kWorkspaceAlignBytes != 0) {
    check.fail("workspace", "data 16-byte aligned", "address " + address_string(ws.data));
  }
  p.workspace = ws.data;
  p.workspace_bytes = ws.bytes;
}

std::size_t forward_workspace_size(Target target, const FwdParams& p) {
  return target == Target::kCUDA ? cuda::forward_workspace_size(p) : cpu::forward_workspace_size(p);
}

std::size_t backward_workspace_size(Target target, const BwdParams& p) {
  return target == Target::kCUDA ? cuda::backward_workspace_size(p)
                                 : cpu::backward_workspace_size(p);
}

void check_cuda_forward_rows(const Check& check, Target target, const FwdParams& p) {
  constexpr std::int64_t kMaxGridZ = 65535, kSmallestTileRows = 64;
  if (target != Target::kCUDA || p.mask.unbounded()) return;
  if (std::int64_t(p.seqlen_q) > kMaxGridZ * kSmallestTileRows) {
    check.unsupported("q",
                      "at most " + std::to_string(kMaxGridZ * kSmallestTileRows) +
                          " query rows per sequence with a causal or window mask (CUDA backend)",
                      std::to_string(p.seqlen_q) + " rows");
  }
}

void run_forward(Target target, const FwdParams& p) {
  if (target == Target::kCUDA) {
    cuda::forward(p);
  } else {
    cpu::forward(p);
  }
}

void run_backward(Target target, const BwdParams& p) {
  if (target == Target::kCUDA) {
    cuda::backward(p);
  } else {
    cpu::backward(p);
  }
}

void run_append_kv(Target target, const AppendParams& p, cuda::AppendVerdict verdict) {
  if (target == Target::kCUDA) {
    cuda::append_kv(p, verdict);
  } else {
    cpu::append_kv(p);
  }
}

}  // namespace flashattn::detail::api
