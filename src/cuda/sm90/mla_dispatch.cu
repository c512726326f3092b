// The sm90 MLA kernel's host side (mla.hpp): which calls with qv it takes, its tensor maps
// and its launch with the sm80 MLA path's plan (sm80::plan_mla, sm80::mla_args).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <numeric>

#include "cuda/runtime/device_attribute.hpp"
#include "cuda/sm80/mla_dispatch.hpp"
#include "cuda/sm90/mla.hpp"
#include "cuda/sm90/mla_kernel.cuh"
#include "cuda/sm90/tensor_map.hpp"

namespace flashattn::detail::cuda::sm90 {

template <typename Element>
void launch_mla(const FwdParams& p, const MlaArgs& a);

namespace {

// The K / V tensors as TMA sees them: rows of a sequence (varlen: the packed keys; KV
// cache: a cache row or a block; dense: seqlen_k), and the batches (cache rows or blocks).
std::int64_t kv_rows(const FwdParams& p) {
  return p.cu_seqlens_k ? p.total_k : p.cache_seqlens ? p.kv_cache_len : p.seqlen_k;
}
std::int64_t kv_batches(const FwdParams& p) {
  return p.cu_seqlens_k ? 1 : p.cache_seqlens ? p.kv_cache_rows : p.batch;
}

// Rows of one TMA copy: a whole 64-key tile (dense), or with a paged cache the largest
// divisor of the tile that no block boundary crosses.
int page_rows(const FwdParams& p) { return p.is_paged() ? std::gcd(p.block_size, MlaConfig::kBlockN) : 0; }

}  // namespace

const char* mla_unsupported(const FwdParams& p) noexcept {
  // Compute capability 9.x is 9.0 alone (H100 / H200), whose minor 0 device_attribute
  // would read as missing: the major decides.
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(p.device_index, 0) != 9) {
    return "not a compute capability 9.0 GPU";
  }
  // What neither kernel takes is left to the sm80 path, whose plan names the argument.
  if ((p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) || p.q_dtype != p.dtype || p.kv_dtype != p.dtype) {
    return "dtype";
  }
  if (p.d < 8 || p.d % 8 != 0 || p.d > MlaConfig::kDimK || p.d_v < 8 || p.d_v % 8 != 0 || p.d_v > MlaConfig::kDimV) {
    return "head dim";
  }
  if (p.smem_limit > 0 && p.smem_limit < MlaConfig::kSmemBytes) return "shared memory limit below the sm90 MLA tiles";
  if (p.is_paged() && page_rows(p) < 8) return "paged KV cache with gcd(block_size, 64) < 8 (TMA boxes of 8 rows)";
  if (p.is_varlen() != (p.cu_seqlens_k != nullptr)) return "mixed varlen layout";
  if (p.is_varlen() && p.total_k <= 0) return "varlen without packed totals";
  const std::int64_t rows = kv_rows(p), batches = kv_batches(p);
  if (rows <= 0 || batches <= 0) return "no keys";
  if (!tma_layout_ok(p.k, rows, p.k_row_stride, p.h_k, p.k_head_stride, batches, p.k_batch_stride) ||
      !tma_layout_ok(p.v, rows, p.v_row_stride, p.h_k, p.v_head_stride, batches, p.v_batch_stride)) {
    return "K / V layout outside TMA's rules (16-byte aligned base and strides)";
  }
  return nullptr;
}

void run_mla(const FwdParams& p) {
  const sm80::MlaPlan plan = sm80::plan_mla(p);  // the sm80 path's errors, and its plan
  if (p.batch == 0 || p.seqlen_q == 0 || p.h_q == 0) return;
  MlaArgs a{};
  a.split = sm80::mla_args(p, plan);
  a.page_rows = page_rows(p);
  a.v_segs = (p.d_v + 63) / 64;
  a.v_tail_zero = !p.is_varlen() && p.cache_seqlens == nullptr && p.seqused_k == nullptr;
  const std::int64_t rows = kv_rows(p), batches = kv_batches(p);
  const std::uint32_t box_rows = a.page_rows > 0 ? std::uint32_t(a.page_rows) : std::uint32_t(MlaConfig::kBlockN);
  a.tmap_k = make_tensor_map_4d(p.k, p.dtype,
                                {std::uint64_t(p.d), std::uint64_t(rows), std::uint64_t(p.h_k), std::uint64_t(batches)},
                                {tma_stride(rows, p.k_row_stride), tma_stride(p.h_k, p.k_head_stride),
                                 tma_stride(batches, p.k_batch_stride)},
                                box_rows);
  a.tmap_v = make_tensor_map_4d(p.v, p.dtype,
                                {std::uint64_t(p.d_v), std::uint64_t(rows), std::uint64_t(p.h_k), std::uint64_t(batches)},
                                {tma_stride(rows, p.v_row_stride), tma_stride(p.h_k, p.v_head_stride),
                                 tma_stride(batches, p.v_batch_stride)},
                                box_rows);
  if (p.dtype == DType::kBFloat16) {
    launch_mla<__nv_bfloat16>(p, a);
  } else {
    launch_mla<__half>(p, a);
  }
}

}  // namespace flashattn::detail::cuda::sm90
