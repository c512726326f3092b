// The sm80 forward: the decode kernel for the KV-cache calls it suits, else the fused
// forward of the compiled head-dim bucket and element type; what it does not do (yet) is a
// clear Unsupported error. The fused forward also takes the KV-cache calls that no decode
// configuration fits within p.smem_limit (16-bit caches at d 160 .. 256 on 99 KiB GPUs),
// those with more packed query rows than the decode kernel takes, and those whose v has its
// own head dim (d_v != d, in the bucket of max(d, d_v), 512 included: the decode kernel
// has one head dim) — dense or paged, appended to before, cache_batch_idx, GQA,
// masks, softcap, ALiBi, sinks: the same per-sequence helpers of FwdParams as the decode
// kernel; num_splits, a speed hint, is not used there.
#include <algorithm>
#include <string>

#include "cuda/sm80/decode_dispatch.hpp"
#include "cuda/sm80/family.hpp"
#include "cuda/sm80/mla_dispatch.hpp"
#include "cuda/sm80/fwd_launch.hpp"
#include "flashattn/error.hpp"
#include "flashattn_cuda_manifest.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashattn::detail::cuda::sm80 {

void forward(const FwdParams& p) {
  constexpr const char* kFn = "forward";
  if (p.qv != nullptr) {
    run_mla_path(p, plan_mla(p));
    return;
  }
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  // fp8 q (FlashAttention-3's fp8 KV-cache call): its descales may be null (1).
  const bool fp8_q = p.q_dtype == DType::kFloat8E4M3;
  if ((p.kv_dtype != p.dtype && !fp8) || (fp8 && !fp8_q && (p.k_scale == nullptr || p.v_scale == nullptr)) ||
      (fp8_q && !fp8)) {
    throw Unsupported(kFn, "k_cache", "a cache of q's dtype, or float8_e4m3 with k_scale / v_scale or fp8 q",
                      dtype_name(p.kv_dtype));
  }
  if ((fp8 || p.tree_mask != nullptr || p.num_splits > 1) && p.cache_seqlens == nullptr) {
    throw Unsupported(kFn, "num_splits",
                      "fp8 K/V, tree masks and num_splits > 1 on CUDA only through kvcache_forward",
                      std::to_string(p.num_splits));
  }
  const DecodePlan plan = plan_decode(p);
  if (plan.use) {
    if (plan.workspace_bytes > 0 && (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes)) {
      throw Unsupported(kFn, "workspace", "at least " + std::to_string(plan.workspace_bytes) + " bytes",
                        std::to_string(p.workspace_bytes) + " bytes");
    }
    run_decode_path(p, plan);
    return;
  }
  const bool bf16 = p.dtype == DType::kBFloat16;
#define FLASHATTN_FWD_BUCKET(D)                           \
  if (std::max(p.d, p.d_v) <= D) {                        \
    if (bf16) run_fwd<D, __nv_bfloat16>(p);               \
    else run_fwd<D, __half>(p);                           \
    return;                                               \
  }
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_FWD_BUCKET)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_FWD_BUCKET)
#undef FLASHATTN_FWD_BUCKET
}

std::size_t forward_workspace_size(const FwdParams& p) {
  return p.qv != nullptr ? plan_mla(p).workspace_bytes : plan_decode(p).workspace_bytes;
}

}  // namespace flashattn::detail::cuda::sm80
