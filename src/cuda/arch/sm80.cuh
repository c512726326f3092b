// Thin wrappers over the sm80 warp-level instructions the kernels are built from:
// ldmatrix (plain and transposed), mma.sync m16n8k16 (fp16 / bf16 in, fp32 accumulate)
// and cp.async (16-byte global -> shared copies with zero fill); fp32 -> 16-bit packing
// is arch/pack.cuh's. They compile for every arch >= sm80 (sm90 runs them too).
//
// Fragment layouts of m16n8k16 (g = lane / 4, t = lane % 4), each register two 16-bit values:
//   A 16x16 (row-major):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  (k x n):      b0 (k 2t..2t+1, n g)             b1 (k 2t+8.., n g)
//   C 16x8  (fp32):       c0, c1 (g, 2t, 2t+1)             c2, c3 (g+8, 2t, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/arch/pack.cuh"  // pack2, used with these MMAs

namespace flashattn::detail::cuda::sm80 {

__device__ __forceinline__ std::uint32_t smem_u32(const void* ptr) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 b16 matrices; lane 8m + r supplies the address of row r of matrix m, and
// register m of every lane receives (row lane / 4, columns 2 (lane % 4), +1) of matrix m.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// The same with each matrix transposed: register m receives (rows 2 (lane % 4), +1;
// column lane / 4) of matrix m, i.e. a k-major B fragment out of an n-major tile.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(std::uint32_t addr, std::uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(std::uint32_t addr, std::uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// d += a * b on the tensor cores, fp32 accumulate. Element is __half or __nv_bfloat16.
// Not volatile: a pure function of registers, free to be scheduled among the loads.
template <typename Element>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4],
                                             std::uint32_t b0, std::uint32_t b1) {
  if constexpr (sizeof(Element) == 2 && __is_same(Element, __half)) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(__is_same(Element, __nv_bfloat16), "mma_m16n8k16: fp16 or bf16");
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}


// 16-byte asynchronous copy global -> shared, bypassing L1. With valid == false nothing is
// read and the 16 shared bytes are zero-filled (the source must still be a mapped address;
// callers pass a base pointer).
__device__ __forceinline__ void cp_async_16(std::uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The 8 x 8 16-bit matrix held as one register per lane (lane l: row l / 4, columns
// 2 (l % 4) and + 1), transposed across the warp (sm75+).
__device__ __forceinline__ std::uint32_t movmatrix_trans(std::uint32_t x) {
  std::uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(x));
  return d;
}

}  // namespace flashattn::detail::cuda::sm80
