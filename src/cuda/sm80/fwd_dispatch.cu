// cuda::forward: picks the compiled head-dim bucket and element type for a call and
// rejects what the CUDA forward does not do (yet) with a clear Unsupported error.
#include <string>

#include "core/backend.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/sm80/decode_dispatch.hpp"
#include "cuda/sm80/fwd_launch.hpp"
#include "cuda/sm90/fwd.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
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
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  if ((p.kv_dtype != p.dtype && !fp8) || (fp8 && (p.k_scale == nullptr || p.v_scale == nullptr))) {
    throw Unsupported(kFn, "k_cache", "a cache of q's dtype, or float8_e4m3 with k_scale / v_scale",
                      dtype_name(p.kv_dtype));
  }
  if ((fp8 || p.tree_mask != nullptr || p.num_splits > 1) && p.cache_seqlens == nullptr) {
    throw Unsupported(kFn, "num_splits",
                      "fp8 K/V, tree masks and num_splits > 1 on CUDA only through kvcache_forward",
                      std::to_string(p.num_splits));
  }
  if (p.d % 8 != 0 || !supports_head_dim(p.d)) {
    throw Unsupported(kFn, "q", "a head dim d % 8 == 0 within the compiled CUDA buckets",
                      std::to_string(p.d));
  }
  DeviceGuard guard(p.device_index);
  const sm80::DecodePlan plan = sm80::plan_decode(p);
  if (plan.use) {
    if (plan.workspace_bytes > 0 && (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes)) {
      throw Unsupported(kFn, "workspace", "at least " + std::to_string(plan.workspace_bytes) + " bytes",
                        std::to_string(p.workspace_bytes) + " bytes");
    }
    sm80::run_decode_path(p, plan);
    return;
  }
  static const bool sm80_forced = [] {
    const char* e = std::getenv("FLASHATTN_KERNEL_FAMILY");
    return e != nullptr && std::strcmp(e, "sm80") == 0;
  }();
  if (!sm80_forced && sm90::fwd_built()) {
    const char* why = sm90::fwd_unsupported(p);
    if (why == nullptr) {
      sm90::run_fwd(p);
      return;
    }
  }
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

// KV-cache calls on the decode path with splits > 1 need the fp32 partials (O, lse);
// computed from shapes and upper bounds only (the same during CUDA graph capture).
std::size_t forward_workspace_size(const FwdParams& p) { return sm80::plan_decode(p).workspace_bytes; }

}  // namespace flashattn::detail::cuda
