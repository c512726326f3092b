// The host side of the sm80 forward (fwd_kernel.cuh): launch_fwd launches one
// instantiation (the block-sparse copy where p.block_kinds is set, after checking that the
// mask's blocks hold whole tiles) with its dynamic shared memory and grid (query tile, head,
// sequence, or tile major; V slices side by side); run_fwd picks the head-dim bucket's tile
// (large / staggered, base, small) that fits p.smem_limit. What the generated translation
// units (fwd.inst.cu.in) include and instantiate; called from fwd_dispatch.cu through
// fwd_launch.hpp's declaration.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "core/params.hpp"
#include "cuda/collective/work_estimate.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm80/fwd_kernel.cuh"
#include "cuda/sm80/fwd_launch.hpp"
#include "cuda/sm80/fwd_traits.cuh"
#include "cuda/sm80/tile_size.hpp"
#include "flashattn/error.hpp"

namespace flashattn::detail::cuda::sm80 {

template <int kHeadDim, typename Element, int kKind>
void launch_fwd(const FwdParams& p) {
  using Tr = FwdTraits<kHeadDim, Element, kKind>;
  auto kernel = fwd_kernel<kHeadDim, Element, kKind, false>;
  // Staggered tiles have no block-sparse copy (run_fwd gives such calls the large tile, or
  // declines them in the 512 bucket).
  if constexpr (!Tr::kStaggered) {
    if (p.block_kinds != nullptr) kernel = fwd_kernel<kHeadDim, Element, kKind, true>;
  }
  constexpr int kSmem = Tr::kSmemBytes;
  // A block-sparse mask's blocks hold whole tiles (each (query tile, key tile) in one block).
  if (p.block_kinds != nullptr && (p.bs_block_q % Tr::kBlockM != 0 || p.bs_block_k % Tr::kBlockN != 0)) {
    throw Unsupported("forward", "opts.block_sparse",
                      "block_size_q a multiple of " + std::to_string(Tr::kBlockM) + " and block_size_k a multiple of " +
                          std::to_string(Tr::kBlockN) + " (the CUDA forward's tile at head dim " +
                          std::to_string(kHeadDim) + ")",
                      "block sizes " + std::to_string(p.bs_block_q) + " x " + std::to_string(p.bs_block_k));
  }
  if constexpr (kSmem > 48 * 1024) {
    FLASHATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  }
  const unsigned m_tiles = (p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  // Sliced V: the d_v slices of a query tile (or head) side by side in grid x (fwd_kernel).
  const unsigned slices = Tr::kVSliced ? (p.d_v + Tr::kVCols - 1) / Tr::kVCols : 1;
  const dim3 grid = fwd_tile_major(p) ? dim3(p.h_q * slices, p.batch, m_tiles)
                                      : dim3(m_tiles * slices, p.h_q, p.batch);
  kernel<<<grid, Tr::kThreads, kSmem, static_cast<cudaStream_t>(p.stream)>>>(p);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

template <int kHeadDim, typename Element>
void run_fwd(const FwdParams& p) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.h_q == 0) return;
  // The largest of the bucket's tiles that fits in p.smem_limit (the device's opt-in shared
  // memory per block, or the caller's cap): the large / staggered tiles on H100 / H200, the
  // base tile on A100-class parts, the 99 KiB tile on sm86 / sm89.
  const int limit = p.smem_limit;
  if constexpr (FwdTraits<kHeadDim, Element>::kVSliced) {
    if (p.block_kinds != nullptr) {
      throw Unsupported("forward", "opts.block_sparse",
                        "no block-sparse mask at head dims above 256 (CUDA: the forward's 512 bucket "
                        "has no block-sparse kernel)",
                        "a mask with d = " + std::to_string(p.d) + ", d_v = " + std::to_string(p.d_v));
    }
  }
  if constexpr (has_large_fwd_tile(kHeadDim)) {
    if (limit >= FwdTraits<kHeadDim, Element, kFwdLarge>::kSmemBytes) {
      // Block-sparse calls keep the large tile: the staggered tile's sparse copy spilled
      // 350 / 612 B (ptxas sm_90, bf16 hdim 256), the large tile's 4 / 12.
      if (p.block_kinds == nullptr &&
          mean_visible_keys(p.seqlen_q, p.seqlen_k, p.mask) >= double(kFwdStaggeredMinKeys)) {
        launch_fwd<kHeadDim, Element, kFwdStaggered>(p);
      } else {
        launch_fwd<kHeadDim, Element, kFwdLarge>(p);
      }
      return;
    }
  }
  constexpr int kSmem = FwdTraits<kHeadDim, Element>::kSmemBytes;
  if (limit >= kSmem) {
    launch_fwd<kHeadDim, Element, kFwdBase>(p);
    return;
  }
  if constexpr (has_small_fwd_tile(kHeadDim)) {
    if (limit >= FwdTraits<kHeadDim, Element, kFwdSmall>::kSmemBytes) {
      launch_fwd<kHeadDim, Element, kFwdSmall>(p);
      return;
    }
  }
  throw Unsupported("forward", "q",
                    "at least " + std::to_string(fwd_smem_bytes(fwd_tile_small(kHeadDim), kHeadDim)) +
                        " bytes of shared memory per block for head dim d = " + std::to_string(p.d) +
                        (p.d_v != p.d ? ", d_v = " + std::to_string(p.d_v) : std::string()) +
                        " (head-dim bucket " + std::to_string(kHeadDim) + ")",
                    std::to_string(limit) + " bytes (the device's limit or opts.smem_cap)");
}

}  // namespace flashattn::detail::cuda::sm80
