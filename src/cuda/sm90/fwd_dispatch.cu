// The sm90 forward's host side: which calls it runs, the tensor maps of a call, and the
// configuration per head-dim bucket.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>

#include "cuda/collective/work_estimate.hpp"
#include "cuda/runtime/device_attribute.hpp"
#include "cuda/runtime/device_guard.hpp"
#include "cuda/sm90/fwd.hpp"
#include "cuda/sm90/fwd_configs.hpp"
#include "cuda/sm90/tensor_map.hpp"

namespace flashattn::detail::cuda::sm90 {

bool fwd_built() noexcept { return true; }

const char* fwd_unsupported(const FwdParams& p) noexcept {
  // Compute capability 9.x is 9.0 alone (H100 / H200), whose minor 0 device_attribute
  // would read as missing: the major decides.
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(p.device_index, 0) != 9) {
    return "not a compute capability 9.0 GPU";
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return "dtype";
  const bool fp8 = p.q_dtype == DType::kFloat8E4M3;
  if (fp8) {
    // FlashAttention-3's fp8 forward: e4m3 q, k, v, 16-bit out.
    if (p.kv_dtype != DType::kFloat8E4M3) return "float8_e4m3 q with 16-bit k, v";
    if (p.cache_seqlens != nullptr) return "float8_e4m3 q through the KV-cache path";
    if (p.block_table != nullptr) return "float8_e4m3 with a paged KV cache (block_table)";  // V^T reads rows
    if (p.d != p.d_v) return "float8_e4m3 with d_v != d";
    if (p.d > 256 || p.d % 16 != 0) return "float8_e4m3 head dim (sm90: 16 to 256, a multiple of 16)";
  }
  if (p.smem_limit > 0 && p.smem_limit < FwdHdim256::kSmemBytes) return "shared memory limit below the sm90 tiles";
  if (p.d > 256 || p.d % 8 != 0 || p.d_v > 256 || p.d_v % 8 != 0) return "head dim";
  if (p.block_kinds != nullptr) return "block-sparse mask";
  if (!fp8 && p.kv_dtype != p.dtype) return "fp8 KV cache";
  if (p.dropout_p > 0.0f) return "dropout";
  if (p.probs != nullptr) return "return_probs";
  if (p.block_table != nullptr && p.block_size % 8 != 0) return "paged KV cache with block_size % 8 != 0";
  if (p.tree_mask != nullptr) return "tree mask";
  // Split-KV is the decode kernel's; a KV-cache call with d_v != d never takes it
  // (sm80::plan_decode), so num_splits is a speed hint here as in the sm80 fused forward.
  if (p.num_splits > 1 && p.d_v == p.d) return "split-KV";
  if (p.is_varlen() && (p.total_q <= 0 || p.total_k <= 0)) return "varlen without packed totals";
  if (p.is_varlen() != (p.cu_seqlens_k != nullptr)) return "mixed varlen layout";
  if (!p.is_varlen() && p.cache_seqlens == nullptr && p.seqlen_k == 0) return "no keys";
  return nullptr;
}

namespace {

template <class Cfg, typename Element, typename Out = Element>
void run(const FwdParams& p, FwdArgs& args, void* fp8_vt = nullptr) {
  constexpr int es = Cfg::kElemBytes;
  const DType in = es == 1 ? DType::kFloat8E4M3 : p.dtype;
  const std::int64_t q_rows = p.is_varlen() ? p.total_q : p.seqlen_q;
  const std::int64_t q_batches = p.is_varlen() ? 1 : p.batch;
  const std::int64_t k_rows = p.cu_seqlens_k ? p.total_k
                              : p.cache_seqlens ? p.kv_cache_len  // block_size when paged
                                                : p.seqlen_k;
  const std::int64_t k_batches = p.cu_seqlens_k ? 1 : p.cache_seqlens ? p.kv_cache_rows : p.batch;
  args.tmap_q = make_tensor_map_4d(
      p.q, in, {std::uint64_t(p.d), std::uint64_t(q_rows), std::uint64_t(p.h_q), std::uint64_t(q_batches)},
      {tma_stride(q_rows, p.q_row_stride, es), tma_stride(p.h_q, p.q_head_stride, es),
       tma_stride(q_batches, p.q_batch_stride, es)},
      Cfg::kBlockM, Cfg::kRowBytes);
  // out (16-bit): TMA stores where its base and strides are 16-byte aligned (fwd_kernel's epilogue).
  args.o_tma = false;
  if constexpr (Cfg::kTmaStore) {
    if (tma_layout_ok(p.out, q_rows, p.o_row_stride, p.h_q, p.o_head_stride, q_batches, p.o_batch_stride)) {
      args.tmap_o = make_tensor_map_4d(p.out, p.dtype,
                                       {std::uint64_t(p.d_v), std::uint64_t(q_rows), std::uint64_t(p.h_q),
                                        std::uint64_t(q_batches)},
                                       {tma_stride(q_rows, p.o_row_stride), tma_stride(p.h_q, p.o_head_stride),
                                        tma_stride(q_batches, p.o_batch_stride)},
                                       64);
      args.o_tma = true;
    }
  }
  // A paged cache is copied in chunks of page_rows rows: the whole tile where a block
  // holds whole tiles, else the largest common divisor of the block and tile heights.
  args.page_rows = 0;
  if (p.is_paged()) {
    args.page_rows = p.block_size % Cfg::kBlockN == 0 ? Cfg::kBlockN : std::gcd(p.block_size, Cfg::kBlockN);
  }
  const std::uint32_t box_k = args.page_rows > 0 ? std::uint32_t(args.page_rows) : std::uint32_t(Cfg::kBlockN);
  const std::uint64_t k_dims[4] = {std::uint64_t(p.d), std::uint64_t(k_rows), std::uint64_t(p.h_k),
                                   std::uint64_t(k_batches)};
  args.tmap_k = make_tensor_map_4d(p.k, in, k_dims,
                                   {tma_stride(k_rows, p.k_row_stride, es), tma_stride(p.h_k, p.k_head_stride, es),
                                    tma_stride(k_batches, p.k_batch_stride, es)},
                                   box_k, Cfg::kRowBytes);
  if constexpr (es == 1) {
    // V^T in the workspace (fwd.hpp, fp8_vt.cu): {rows, d_v, h_k, 1}, kHeadDim rows of 64 keys a box.
    static_assert(Cfg::kBlockN <= kFp8VtTile, "a key tile reads past its sequence's zeros");
    const std::uint64_t rows = std::uint64_t(fp8_vt_rows(p));
    const std::uint64_t vt_dims[4] = {rows, std::uint64_t(p.d_v), std::uint64_t(p.h_k), 1};
    args.tmap_v = make_tensor_map_4d(fp8_vt, in, vt_dims,
                                     {rows, rows * std::uint64_t(p.d_v), rows * std::uint64_t(p.d_v) * p.h_k},
                                     Cfg::kHeadDim, 64);
    return launch_fwd<Cfg, Element, Out>(args);
  }
  // v has its own head dim (d_v != d: DeepSeek-V3's (192, 128)); the tile's columns past it
  // are zero-filled by the copy, and out is stored for d_v columns. The same with a KV cache
  // (dense: rows of kv_cache_len, cache rows as batches; paged: rows of a block, blocks as
  // batches): a box of V is as wide as K's (64 columns), so a paged chunk's transaction
  // bytes (issue_tile: rows * kHeadDim) and the tail zeroing of the rows past the keys
  // hold for V's tile as for K's, the columns past d_v included.
  const std::uint64_t v_dims[4] = {std::uint64_t(p.d_v), std::uint64_t(k_rows), std::uint64_t(p.h_k),
                                   std::uint64_t(k_batches)};
  args.tmap_v = make_tensor_map_4d(p.v, in, v_dims,
                                   {tma_stride(k_rows, p.v_row_stride, es), tma_stride(p.h_k, p.v_head_stride, es),
                                    tma_stride(k_batches, p.v_batch_stride, es)},
                                   box_k);
  launch_fwd<Cfg, Element, Out>(args);
}

// Measured on the H200 (docs/performance.md): hdim 64 takes three consumer warpgroups
// (192 query rows) except for causal calls up to 2k queries, where the 128-row tile
// balances better; hdim 128 takes 176 keys per tile where queries see >= 8k keys on average.
template <typename Element>
void run_bucket(const FwdParams& p, FwdArgs& args) {
  const int kd = std::max(p.d, p.d_v);  // d_v != d: the bucket of the larger head dim
  if (kd <= 64) {
    const bool tall = p.mask.right < 0 || p.seqlen_q > 2048;
    if (tall) return run<FwdHdim64Tall, Element>(p, args);
    return run<FwdHdim64, Element>(p, args);
  }
  if (kd <= 128) {
    const bool wide = mean_visible_keys(p.seqlen_q, p.seqlen_k, p.mask) >= 8192;
    if (wide) return run<FwdHdim128Wide, Element>(p, args);
    return run<FwdHdim128, Element>(p, args);
  }
  return run<FwdHdim256, Element>(p, args);
}

// fp8 (e4m3) q, k, v: V^T first (fp8_vt.cu), then the 8-bit kernels of the bucket.
template <typename Out>
void run_fp8(const FwdParams& p, FwdArgs& args, void* vt) {
  transpose_v_fp8(p, vt);
  if (p.d <= 64) return run<FwdFp8Hdim64, __nv_fp8_e4m3, Out>(p, args, vt);
  if (p.d <= 128) return run<FwdFp8Hdim128, __nv_fp8_e4m3, Out>(p, args, vt);
  return run<FwdFp8Hdim256, __nv_fp8_e4m3, Out>(p, args, vt);
}

}  // namespace

void run_fwd(const FwdParams& p, void* fp8_vt) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.h_q == 0) return;
  DeviceGuard guard(p.device_index);
  FwdArgs args{};
  args.p = p;
  args.raw_scores = p.softcap <= 0.0f && p.alibi_slopes == nullptr && p.scale > 0.0f;
  constexpr float kLog2e = 1.4426950408889634f;
  args.to_log2 = args.raw_scores ? p.scale * kLog2e : kLog2e;
  args.v_tail_zero = !p.is_varlen() && p.cache_seqlens == nullptr && p.seqused_k == nullptr;
  if (p.q_dtype == DType::kFloat8E4M3) {
    if (p.dtype == DType::kBFloat16) return run_fp8<__nv_bfloat16>(p, args, fp8_vt);
    return run_fp8<__half>(p, args, fp8_vt);
  }
  if (p.dtype == DType::kBFloat16) {
    run_bucket<__nv_bfloat16>(p, args);
  } else {
    run_bucket<__half>(p, args);
  }
}

}  // namespace flashattn::detail::cuda::sm90
