// The host side of the sm80 backward's main kernel (bwd_kernel.cuh): the __global__ entry
// per (element type, head-dim bucket, shared-memory limit, block-sparse), its launch
// (dynamic shared memory, grid of key tiles x KV heads x sequences) and run_bwd_main, which
// picks the bucket's configuration for the call's shared-memory limit (sm90's, sm80's or the
// 99 KiB one) or declines. Included by the generated translation units (bwd.inst.cu.in).
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "core/params.hpp"
#include "cuda/runtime/device_attribute.hpp"
#include "cuda/sm80/bwd_config.cuh"
#include "cuda/sm80/bwd_kernel.cuh"
#include "cuda/sm80/bwd_launch.hpp"
#include "flashattn/error.hpp"

namespace flashattn::detail::cuda::sm80 {

// The kernel; a variant sized for sm90's shared memory traps if it ever ran below sm90
// (the host only launches it on devices that grant its shared memory), so its sm80
// compilation is empty.
template <typename Element, int kHeadDim, int kSmemLimit, bool kSparse = false>
__global__ void __launch_bounds__(BwdTileConfig<kHeadDim, kSmemLimit>::kNThreads, 1)
    bwd_main_kernel(const __grid_constant__ BwdParams p, const BwdWorkspace ws) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (kSmemLimit > kSm80SmemLimit) {
    __trap();
  } else
#endif
  {
    bwd_main_block<Element, kHeadDim, kSmemLimit, kSparse>(p, ws);
  }
}

template <typename Element, int kHeadDim, int kSmemLimit>
void launch_bwd_main(const BwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  using Cfg = BwdTileConfig<kHeadDim, kSmemLimit>;
  static_assert(Cfg::kFits, "launch_bwd_main: a configuration beyond its shared-memory limit");
  auto kernel = bwd_main_kernel<Element, kHeadDim, kSmemLimit, false>;
  if constexpr (Cfg::kWide) {
    // No block-sparse instantiation in the 512 bucket (sm80::backward declines those calls
    // before anything runs; as the forward's 512 bucket, which has none either).
    if (p.block_kinds != nullptr) {
      throw Unsupported("backward", "opts.block_sparse",
                        "no block-sparse mask at head dims above 256 (CUDA: the 512 bucket has no "
                        "block-sparse kernel)",
                        "a mask with d = " + std::to_string(p.d) + ", d_v = " + std::to_string(p.d_v));
    }
  } else if (p.block_kinds != nullptr) {
    // A block-sparse mask's blocks hold whole tiles (each (query tile, key tile) in one block).
    if (p.bs_block_q % Cfg::kBlockM != 0 || p.bs_block_k % Cfg::kBlockN != 0) {
      throw Unsupported("backward", "opts.block_sparse",
                        "block_size_q a multiple of " + std::to_string(Cfg::kBlockM) +
                            " and block_size_k a multiple of " + std::to_string(Cfg::kBlockN) +
                            " (the CUDA backward's tile at head dim " + std::to_string(kHeadDim) + ")",
                        "block sizes " + std::to_string(p.bs_block_q) + " x " + std::to_string(p.bs_block_k));
    }
    kernel = bwd_main_kernel<Element, kHeadDim, kSmemLimit, true>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Cfg::kSmemBytes);
  if (err != cudaSuccess) {
    throw CudaError(std::string("flashattn::backward: cannot reserve ") +
                    std::to_string(Cfg::kSmemBytes) +
                    " bytes of shared memory: " + cudaGetErrorString(err));
  }
  const dim3 grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.h_k, p.batch);
  kernel<<<grid, Cfg::kNThreads, Cfg::kSmemBytes, stream>>>(p, ws);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw CudaError(std::string("flashattn::backward: main kernel launch failed: ") +
                    cudaGetErrorString(err));
  }
}

// Whether the call takes the bucket's sm90 configuration: an sm90-or-newer device (the
// configuration's sm80 compilation traps) whose shared-memory limit for the call
// (p.smem_limit: opt-in, or the caller's cap) holds it, and it differs from sm80's.
// (kHasSm90Config false: the bucket has one configuration, compiled once.)
template <int kHeadDim>
inline constexpr bool kHasSm90Config =
    BwdTileConfig<kHeadDim, kSm90SmemLimit>::kSmemBytes != BwdTileConfig<kHeadDim>::kSmemBytes;

template <int kHeadDim>
bool bwd_sm90_config_launches(const BwdParams& p) {
  return kHasSm90Config<kHeadDim> &&
         device_attribute<cudaDevAttrComputeCapabilityMajor>(p.device_index, 0) >= 9 &&
         p.smem_limit >= BwdTileConfig<kHeadDim, kSm90SmemLimit>::kSmemBytes;
}

template <typename Element, int kHeadDim>
bool bwd_main_runs_tall(const BwdParams& p) {
  return BwdTileConfig<kHeadDim, kSm90SmemLimit>::kTall && bwd_sm90_config_launches<kHeadDim>(p);
}

template <typename Element, int kHeadDim>
void run_bwd_main(const BwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  if constexpr (kHasSm90Config<kHeadDim>) {
    if (bwd_sm90_config_launches<kHeadDim>(p)) {
      launch_bwd_main<Element, kHeadDim, kSm90SmemLimit>(p, ws, stream);
      return;
    }
  }
  if (p.smem_limit >= BwdTileConfig<kHeadDim>::kSmemBytes) {
    launch_bwd_main<Element, kHeadDim, kSm80SmemLimit>(p, ws, stream);
    return;
  }
  // 99 KiB parts (sm86 / sm89): the small tiles, where the bucket has them.
  if constexpr (BwdTileConfig<kHeadDim, kSm86SmemLimit>::kFits) {
    if (p.smem_limit >= BwdTileConfig<kHeadDim, kSm86SmemLimit>::kSmemBytes) {
      launch_bwd_main<Element, kHeadDim, kSm86SmemLimit>(p, ws, stream);
      return;
    }
  }
  throw Unsupported("backward", "q",
                    "at least " + std::to_string(kBwdSmemNeed<kHeadDim>) +
                        " bytes of shared memory per block for head-dim bucket " + std::to_string(kHeadDim),
                    std::to_string(p.smem_limit) + " bytes (the device's limit or opts.smem_cap)");
}

}  // namespace flashattn::detail::cuda::sm80
