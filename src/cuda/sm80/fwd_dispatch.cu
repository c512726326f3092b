// cuda::forward: picks the compiled head-dim bucket and element type for a call and
// rejects what the CUDA forward does not do (yet) with a clear Unsupported error.
#include <string>

#include "core/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/sm80/fwd_launch.hpp"
#include "flashattn/error.hpp"
#include "flashattn_cuda_manifest.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashattn::detail::cuda {

void forward(const FwdParams& p) {
  constexpr const char* kFn = "flashattn::forward";
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Unsupported(kFn, "q", "dtype float16 or bfloat16 on CUDA", dtype_name(p.dtype));
  }
  if (p.probs != nullptr) {
    throw Unsupported(kFn, "return_probs", "no debug probabilities on CUDA (CPU backend only)",
                      "a return_probs tensor");
  }
  if (p.kv_dtype != p.dtype || p.k_scale != nullptr || p.tree_mask != nullptr) {
    throw Unsupported(kFn, "k_cache", "a float16/bfloat16 cache without tree mask on CUDA (for now)",
                      dtype_name(p.kv_dtype));
  }
  if (p.num_splits > 1) {
    throw Unsupported(kFn, "num_splits",
                      "num_splits == 1 (num_splits > 1 on CUDA comes with the inference path)",
                      std::to_string(p.num_splits));
  }
  if (p.d % 8 != 0 || !supports_head_dim(p.d)) {
    throw Unsupported(kFn, "q", "a head dim d % 8 == 0 within the compiled CUDA buckets",
                      std::to_string(p.d));
  }
  DeviceGuard guard(p.device_index);
  const bool bf16 = p.dtype == DType::kBFloat16;
#define FLASHATTN_FWD_BUCKET(D)                           \
  if (p.d <= D) {                                         \
    if (bf16) sm80::run_fwd<D, __nv_bfloat16>(p);         \
    else sm80::run_fwd<D, __half>(p);                     \
    return;                                               \
  }
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_FWD_BUCKET)
#undef FLASHATTN_FWD_BUCKET
}

// Split-KV is not on CUDA yet (forward rejects num_splits > 1), so no workspace.
std::size_t forward_workspace_size(const FwdParams&) { return 0; }

}  // namespace flashattn::detail::cuda
