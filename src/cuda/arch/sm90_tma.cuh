// Hopper's asynchronous copies and their barriers, over CCCL's cuda::ptx: mbarrier
// init / arrive / expect-tx / parity wait, tensor-map (TMA) loads into shared memory,
// and the register reallocation and named barriers of warp-specialized kernels.
#pragma once

#include <cstdint>

#include <cuda/ptx>

namespace flashattn::detail::cuda::sm90 {

namespace ptx = ::cuda::ptx;

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, std::uint32_t count) {
  ptx::mbarrier_init(bar, count);
}
// Makes the initialised barriers visible to the async proxy (TMA) and the other threads;
// follow with a block-wide barrier.
__device__ __forceinline__ void mbar_init_fence() {
  ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) { (void)ptx::mbarrier_arrive(bar); }
// One arrival that also announces `bytes` of TMA transactions completing on the barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  (void)ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar, bytes);
}
// Waits until the phase of parity `phase` has completed. A fresh barrier is in phase 0,
// so waiting on parity 1 returns at once (the producer's first pass over empty slots).
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t phase) {
  while (!ptx::mbarrier_try_wait_parity(bar, phase)) {
  }
}
// Whether the phase of parity `phase` has completed, without waiting (a poll; a thread that
// goes on to use what the phase guards waits on it with mbar_wait as well).
__device__ __forceinline__ bool mbar_test(std::uint64_t* bar, std::uint32_t phase) {
  return ptx::mbarrier_test_wait_parity(bar, phase);
}

// ---- TMA: a 4-D box of the tensor map into shared memory, completing on `bar`
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const void* tensor_map, int c0, int c1,
                                            int c2, int c3, std::uint64_t* bar) {
  const std::int32_t coords[4] = {c0, c1, c2, c3};
  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, smem_dst, tensor_map, coords, bar);
}
// ---- TMA: a 4-D box from shared memory to the tensor map's tensor, in this thread's bulk group
// (coordinates past the tensor's extents are not written; bulk_commit, then bulk_wait_read
// before the shared memory is written again).
__device__ __forceinline__ void tma_store_4d(const void* tensor_map, const void* smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<std::uint64_t>(tensor_map)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(tensor_map)) : "memory");
}

// ---- bulk reduction: dst[i] += src[i] for `bytes / 4` floats, shared memory to global,
// by the TMA engine (16-byte aligned, bytes % 16 == 0), in this thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, std::uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's bulk groups still read their shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Waits until at most kPending of this thread's bulk groups are incomplete (writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy
// (TMA, wgmma) accesses of the same memory.
__device__ __forceinline__ void fence_proxy_async_smem() { ptx::fence_proxy_async(ptx::space_shared); }

// ---- warp specialization
// Register reallocation of a whole warpgroup (sm_90a; the kernel needs a register cap at
// entry: __launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Named barriers (ids 1..15; 0 is __syncthreads): sync waits for `threads` arrivals,
// arrive adds this warp's without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace flashattn::detail::cuda::sm90
