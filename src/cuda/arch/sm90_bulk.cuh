// Thin wrappers over the sm90 asynchronous-copy instructions the decode kernel uses: TMA
// tensor copies (tile mode, 4-d and 5-d) completing on an mbarrier, the mbarrier itself and
// the proxy fence between generic and async shared-memory accesses. Compiled to nothing
// below sm90 (kHasBulkCopies false there): callers keep a cp.async path beside them.
#pragma once

#include <cstdint>

namespace flashattn::detail::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASHATTN_ARCH_BULK 1
#else
#define FLASHATTN_ARCH_BULK 0
#endif

// sm90: one-row bulk copies (the TMA engine, no per-thread request tracking) completing
// on a per-stage mbarrier.
__device__ __forceinline__ void mbar_init(std::uint32_t bar) {
#if FLASHATTN_ARCH_BULK
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
#if FLASHATTN_ARCH_BULK
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
#if FLASHATTN_ARCH_BULK
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
__device__ __forceinline__ void fence_mbarrier_init() {
#if FLASHATTN_ARCH_BULK
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One TMA tensor copy (tile mode, 4-d coordinates) into shared memory at dst, completing
// on the mbarrier at bar.
__device__ __forceinline__ void tensor_copy_4d(std::uint32_t dst, const void* tmap, int c0, int c1, int c2, int c3,
                                               std::uint32_t bar) {
#if FLASHATTN_ARCH_BULK
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#endif
}

__device__ __forceinline__ void tensor_copy_5d(std::uint32_t dst, const void* tmap, int c0, int c1, int c2, int c3,
                                               int c4, std::uint32_t bar) {
#if FLASHATTN_ARCH_BULK
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
#endif
}

// Brings a tensor map (a __grid_constant__ kernel parameter) into the TMA unit's cache
// before its first copy.
__device__ __forceinline__ void tensor_map_prefetch(const void* tmap) {
#if FLASHATTN_ARCH_BULK
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tmap) : "memory");
#endif
}

// Whether the wrappers above do anything in this compilation pass (sm90 and newer).
inline constexpr bool kHasBulkCopies = FLASHATTN_ARCH_BULK;

__device__ __forceinline__ void fence_proxy_async() {
#if FLASHATTN_ARCH_BULK
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#undef FLASHATTN_ARCH_BULK

}  // namespace flashattn::detail::cuda
