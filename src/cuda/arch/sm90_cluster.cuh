// Thin wrappers over the sm90 thread-block-cluster instructions the decode kernel's split
// merge uses: the cluster barrier (release / acquire), the block's rank in its cluster, and
// loads from another block's shared memory (distributed shared memory, mapa + ld.shared::
// cluster). Compiled to nothing below sm90 (kHasClusters false there): the host launches
// clusters only on sm90 and newer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashattn::detail::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASHATTN_ARCH_CLUSTER 1
#else
#define FLASHATTN_ARCH_CLUSTER 0
#endif

inline constexpr bool kHasClusters = FLASHATTN_ARCH_CLUSTER;

// Every thread of every block of the cluster: the shared-memory writes before it are
// visible to every block's reads after it.
__device__ __forceinline__ void cluster_sync_all() {
#if FLASHATTN_ARCH_CLUSTER
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
#endif
}

// The address in block `rank`'s shared memory of what lies at `smem_addr` in this block's.
__device__ __forceinline__ std::uint32_t cluster_map(std::uint32_t smem_addr, std::uint32_t rank) {
  std::uint32_t out = 0;
#if FLASHATTN_ARCH_CLUSTER
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_addr), "r"(rank));
#endif
  return out;
}

__device__ __forceinline__ float ld_cluster_f32(std::uint32_t addr) {
  float v = 0.0f;
#if FLASHATTN_ARCH_CLUSTER
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}

__device__ __forceinline__ float4 ld_cluster_f32x4(std::uint32_t addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if FLASHATTN_ARCH_CLUSTER
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
#endif
  return v;
}

#undef FLASHATTN_ARCH_CLUSTER

}  // namespace flashattn::detail::cuda
