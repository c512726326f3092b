// Internal: what each backend provides. Argument checking (src/api) has already
// validated everything; a backend may assume well-formed parameters.
#pragma once

#include <cstddef>

#include "core/params.hpp"

namespace flashattn::detail {

namespace cpu {
// Forward over dense, varlen or KV-cache parameters; honours num_splits (> 1 uses
// p.workspace, at least forward_workspace_size(p) bytes).
void forward(const FwdParams& p);
std::size_t forward_workspace_size(const FwdParams& p);
// Backward; uses p.workspace (at least backward_workspace_size(p) bytes) if it needs one.
void backward(const BwdParams& p);
std::size_t backward_workspace_size(const BwdParams& p);
// In-place KV-cache append.
void append_kv(const AppendParams& p);
}  // namespace cpu

namespace cuda {
// True when the CUDA backend was compiled in.
bool built() noexcept;
// Number of visible CUDA devices (0 without the backend or without a GPU).
int device_count() noexcept;
// Compute capability (major * 10 + minor) of a device; 0 if none.
int compute_capability(int device) noexcept;
// Whether the CUDA backend supports this dtype / head dim (for clear errors).
bool supports_head_dim(int d) noexcept;
void forward(const FwdParams& p);
std::size_t forward_workspace_size(const FwdParams& p);
void backward(const BwdParams& p);
std::size_t backward_workspace_size(const BwdParams& p);
void append_kv(const AppendParams& p);
// Copies device memory to the host for argument validation (cu_seqlens, block tables,
// cache lengths), ordered on the stream and synchronising it. Returns false, copying
// nothing, when the stream is being captured into a CUDA graph: validation of index
// contents is then skipped and the kernels must stay in bounds on their own.
bool copy_to_host_for_validation(void* dst, const void* src, std::size_t bytes, void* stream);
// Stream-ordered scratch allocation for calls given no workspace.
void* alloc_async(std::size_t bytes, void* stream);
void free_async(void* ptr, void* stream);
}  // namespace cuda

}  // namespace flashattn::detail
