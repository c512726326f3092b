// Internal: choosing the backend of a call, backend-specific argument rules, reading
// index tensors for validation, workspace handling and the calls into the backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "api/check.hpp"
#include "core/backend.hpp"
#include "core/params.hpp"
#include "flashattn/attention.hpp"

namespace flashattn::detail::api {

enum class Target : std::uint8_t { kCPU, kCUDA };

// The backend for tensors on `device`: Options::backend must be kAuto or match the
// device; a CUDA device needs a CUDA build, a visible GPU of that ordinal and sm80+.
Target resolve_target(const Check& check, const Options& opts, Device device);

// Options::kernel_family and smem_cap (or, at their defaults, the environment's
// FLASHATTN_KERNEL_FAMILY and FLASHATTN_SMEM_CAP for CUDA tensors) into p.
void fill_kernel_options(const Check& check, const Options& opts, Device device, FwdParams& p);

// Which CUDA kernels a call runs, for their head-dim limits: the forward (dense, varlen),
// the backward, a KV-cache call (each d and d_v up to 512, within the compiled buckets) or
// a forward or KV-cache call with Options::qv (the MLA kernel: d <= 64, d_v <= 512,
// whatever the compiled buckets; float16 / bfloat16 only).
enum class CudaCall { kForward, kBackward, kKVCache, kMla };

// The element type (of q, k, v, out, ...) and head dim are ones the backend runs.
// Also checks the CUDA launch limits: batch and h_q index grid dimensions of at most 65535.
// d: head dim of q and k; d_v: of v and out (the CPU backend takes any pair in [1, 512]).
// v_name names v's tensor in errors ("v", or "v_cache"). On CUDA both are % 8 == 0, at most
// 512 (within the compiled buckets), and may differ (the kernels run in the bucket of the
// larger; KV-cache calls with d_v != d run the fused forward, not the decode kernel:
// check_kvcache_head_dim_v).
// float8_e4m3 q, k, v run on CUDA in the forward calls (forward / varlen_forward: the sm90
// fp8 forward, which itself raises Unsupported for what it does not cover: a GPU other than
// sm90, a head dim, ...) and KV-cache calls (the decode kernel, every family; d_v != d is
// check_kvcache_head_dim_v's); the backward entry points reject fp8 q before.
void check_supported(const Check& check, Target target, DType dtype, int d, int d_v, int batch,
                     int h_q, CudaCall call, std::string_view v_name = "v");

// A CUDA KV-cache call with d_v != d runs the fused forward (sm80, or sm90 where it takes
// the call), never the decode kernel, which has one head dim: an fp8 cache (under 16-bit or
// fp8 q) or a draft-tree mask, which only the decode kernel runs, is Unsupported naming v_cache (called before
// anything of the call runs, the append included). A no-op for the CPU, which runs both.
void check_kvcache_head_dim_v(const Check& check, Target target, int d, int d_v, bool fp8_cache,
                              bool tree_mask);

// CUDA kernels load rows with 16-byte vectors: data 16-byte aligned and every
// non-last stride (of a dimension with more than one element) a multiple of 8 elements.
void check_cuda_layout(const Check& check, std::string_view name, const Tensor& t);
// check_cuda_layout for each defined tensor when the target is CUDA.
void check_cuda_layouts(const Check& check, Target target, std::initializer_list<Arg> tensors);

// The values of an int32 tensor of rank 1 or 2, row-major, read on the host (through a
// stream-ordered copy and a synchronisation for CUDA tensors, which only
// FLASHATTN_DEVICE_INDEX_CHECKS=0 asks for). nullopt for CUDA tensors by default and while
// the stream is captured into a CUDA graph: the caller then skips content checks, and the
// call checks them on the device (cuda::check_indices_on_device).
std::optional<std::vector<std::int32_t>> read_int32(const Tensor& t, Target target,
                                                    void* stream);

// Scratch memory allocated for a call that was given no workspace; freed (stream-ordered
// on CUDA) when the call returns or throws.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();
  void* allocate(Target target, std::size_t bytes, void* stream);

 private:
  Target target_ = Target::kCPU;
  void* data_ = nullptr;
  void* stream_ = nullptr;
};

// Validates the caller's workspace against `needed` bytes (or allocates `needed`
// bytes into `scratch` when none was given) and points p.workspace at it.
void attach_workspace(const Check& check, Target target, const Workspace& ws,
                      std::size_t needed, FwdParams& p, Scratch& scratch);

std::size_t forward_workspace_size(Target target, const FwdParams& p);
std::size_t backward_workspace_size(Target target, const BwdParams& p);
// CUDA launch limits of a forward that depend on its lengths: with a causal or window
// mask the sm80 forward indexes query tiles by grid z (its launch order), at most 65535
// tiles of 64 rows (its smallest). Called before anything of the call runs (the KV-cache
// append included); a no-op for the CPU.
void check_cuda_forward_rows(const Check& check, Target target, const FwdParams& p);

void run_forward(Target target, const FwdParams& p);
void run_backward(Target target, const BwdParams& p);
// verdict: the device check's on the append (CUDA), if any.
void run_append_kv(Target target, const AppendParams& p, cuda::AppendVerdict verdict = {});

}  // namespace flashattn::detail::api
