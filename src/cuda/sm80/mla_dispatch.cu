// The MLA path on the host (mla_dispatch.hpp): the checks of what the MLA kernel covers,
// its split count (as the decode path's: num_splits, or 0 for a heuristic from the SM
// count and the work), the workspace (from upper bounds only), and the launch.
#include "cuda/sm80/mla_dispatch.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_attribute.hpp"
#include "cuda/sm80/mla_launch.hpp"
#include "flashattn/error.hpp"

namespace flashattn::detail::cuda::sm80 {

namespace {

constexpr const char* kFn = "forward";
constexpr int kMaxSplits = 256;
constexpr int kMinTilesPerSplit = 4;
constexpr std::size_t kAlign = 256;
// The kernel's static shared memory (the split merge's flag, padded; ptxas -v), which the
// device's limit per block counts too.
constexpr int kMlaStaticSmem = 128;

std::size_t round_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

void check_mla(const FwdParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Unsupported(kFn, "q", "dtype float16 or bfloat16 with opts.qv (CUDA MLA kernel)", dtype_name(p.dtype));
  }
  if (p.q_dtype != p.dtype) {
    throw Unsupported(kFn, "q", "q of out's dtype with opts.qv (no fp8 q with qv)", dtype_name(p.q_dtype));
  }
  if (p.kv_dtype != p.dtype) {
    throw Unsupported(kFn, p.cache_seqlens ? "k_cache" : "k",
                      std::string("dtype ") + dtype_name(p.dtype) +
                          " (same as q) with opts.qv on CUDA (the MLA kernel reads 16-bit K/V)",
                      dtype_name(p.kv_dtype));
  }
  if (p.d < 8 || p.d % 8 != 0 || p.d > MlaTraits::kDimK) {
    throw Unsupported(kFn, "q", "head dim with d % 8 == 0 and 8 <= d <= 64 with opts.qv (CUDA MLA kernel)",
                      "d = " + std::to_string(p.d));
  }
  if (p.d_v < 8 || p.d_v % 8 != 0 || p.d_v > MlaTraits::kDimV) {
    throw Unsupported(kFn, p.cache_seqlens ? "v_cache" : "v",
                      "head dim with d_v % 8 == 0 and 8 <= d_v <= 512 with opts.qv (CUDA MLA kernel)",
                      "d_v = " + std::to_string(p.d_v));
  }
  if (p.tree_mask != nullptr) {
    throw Unsupported(kFn, "tree_mask", "no draft-tree mask with opts.qv (CUDA MLA kernel)", "a tree mask");
  }
  if (p.dropout_p > 0.0f) {
    throw Unsupported(kFn, "opts.dropout_p", "0 with opts.qv (CUDA MLA kernel)", std::to_string(p.dropout_p));
  }
  if (p.bs_lists[0].cnt != nullptr || p.block_kinds != nullptr) {
    throw Unsupported(kFn, "opts.block_sparse", "no block-sparse mask with opts.qv (CUDA MLA kernel)",
                      "a block-sparse mask");
  }
  if (p.cache_leftpad != nullptr) {
    throw Unsupported(kFn, "cache_leftpad", "an undefined tensor with opts.qv (CUDA MLA kernel)", "a tensor");
  }
  if (p.num_splits > 1 && p.cache_seqlens == nullptr) {
    throw Unsupported(kFn, "num_splits", "num_splits > 1 on CUDA only through kvcache_forward",
                      std::to_string(p.num_splits));
  }
  const int need = MlaTraits::kSmemBytes + kMlaStaticSmem;
  if (p.smem_limit > 0 && need > p.smem_limit) {
    throw Unsupported(kFn, "opts.qv",
                      "a GPU with at least " + std::to_string(need) +
                          " bytes of shared memory per block for the MLA kernel (sm80 A100, sm90 H100 / "
                          "H200; not the 99 KiB sm86 / sm89 GPUs)",
                      std::to_string(p.smem_limit) + " bytes (the device's limit or opts.smem_cap)");
  }
}

}  // namespace

MlaPlan plan_mla(const FwdParams& p) {
  check_mla(p);
  MlaPlan plan;
  const std::int64_t rows = std::int64_t(p.seqlen_q) * p.h_ratio;
  plan.row_chunks = static_cast<int>(std::max<std::int64_t>(1, (rows + MlaTraits::kRows - 1) / MlaTraits::kRows));
  int splits = 1;
  if (p.cache_seqlens != nullptr) {
    splits = p.num_splits;
    if (splits == 0) {
      // One block per SM (159 KB of shared memory): as many splits as leave no SM idle,
      // at least kMinTilesPerSplit key tiles each.
      const std::int64_t max_tiles = (std::int64_t(p.seqlen_k) + MlaTraits::kBlockN - 1) / MlaTraits::kBlockN;
      const std::int64_t slots = device_attribute<cudaDevAttrMultiProcessorCount>(p.device_index, 108);
      const std::int64_t units = std::int64_t(p.batch) * p.h_k * plan.row_chunks;
      std::int64_t s = units > 0 ? slots / units : 1;
      s = std::min<std::int64_t>(s, std::max<std::int64_t>(1, max_tiles / kMinTilesPerSplit));
      splits = static_cast<int>(std::clamp<std::int64_t>(s, 1, kMaxSplits));
    }
  }
  plan.splits = std::max(1, splits);
  if (plan.splits > 1) {
    const std::size_t partial_rows =
        std::size_t(plan.splits) * std::size_t(p.batch) * std::size_t(p.h_q) * std::size_t(p.seqlen_q);
    plan.o_bytes = round_up(partial_rows * std::size_t(p.d_v) * sizeof(float));
    plan.lse_bytes = round_up(partial_rows * sizeof(float));
    plan.counter_bytes = std::size_t(p.batch) * std::size_t(p.h_k) * std::size_t(plan.row_chunks) * sizeof(unsigned);
    plan.workspace_bytes = plan.o_bytes + plan.lse_bytes + round_up(plan.counter_bytes);
  }
  return plan;
}

MlaArgs mla_args(const FwdParams& p, const MlaPlan& plan) {
  if (plan.workspace_bytes > 0 && (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes)) {
    throw Unsupported(kFn, "workspace", "at least " + std::to_string(plan.workspace_bytes) + " bytes",
                      std::to_string(p.workspace_bytes) + " bytes");
  }
  MlaArgs a;
  a.splits = plan.splits;
  a.row_chunks = plan.row_chunks;
  a.q_bf16 = p.dtype == DType::kBFloat16;
  if (plan.splits > 1) {
    a.ws_o = static_cast<float*>(p.workspace);
    a.ws_lse = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.o_bytes);
    a.ws_count = reinterpret_cast<unsigned int*>(static_cast<char*>(p.workspace) + plan.o_bytes + plan.lse_bytes);
    FLASHATTN_CUDA_CHECK(cudaMemsetAsync(a.ws_count, 0, plan.counter_bytes, static_cast<cudaStream_t>(p.stream)));
  }
  return a;
}

void run_mla_path(const FwdParams& p, const MlaPlan& plan) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.h_q == 0) return;
  const MlaArgs a = mla_args(p, plan);
  if (p.dtype == DType::kBFloat16) {
    run_mla<__nv_bfloat16>(p, a);
  } else {
    run_mla<__half>(p, a);
  }
}

}  // namespace flashattn::detail::cuda::sm80
