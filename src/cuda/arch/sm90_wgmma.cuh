// Thin wrappers over Hopper's warpgroup matrix multiply-accumulate (wgmma, sm_90a), which
// CCCL's cuda::ptx does not cover: m64nNk16 with fp32 accumulators and fp16 / bf16
// operands, or m64nNk32 with e4m3 operands (Element __nv_fp8_e4m3: both K-major, no
// transposes), A from shared memory (ss) or from registers (rs), B from shared memory.
// The 8-bit register A (64 x 32) holds, per warp's 16 rows, columns 4 (l % 4) .. + 3 of
// rows l / 4 (register 0) and l / 4 + 8 (register 1), and those columns + 16 (registers 2,
// 3), first column in the low byte.
//
// The accumulator of one warpgroup is 64 x N fp32: thread t (warp w = t / 32, lane l)
// holds d[4 * c + e] at row 16 w + l / 4 + 8 (e / 2), column 8 c + 2 (l % 4) + e % 2, the
// m16n8 layout of mma.sync repeated over N / 8 column tiles. The register A operand of
// rs (64 x 16) is the m16n8k16 A fragment of each warp's 16 rows.
//
// Every wgmma is asynchronous: fence() before the first of a batch (after registers it
// reads were written), commit() after the batch, wait<n>() before its accumulators or
// register operands are touched again. ptxas checks the register hazards and serialises
// (with a warning) where it cannot prove them absent.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace flashattn::detail::cuda::sm90 {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of x across this point (accumulators
// and register operands around an asynchronous wgmma).
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_operand(std::uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// Shared-memory matrix descriptor for a tile written by TMA with the 128-byte swizzle
// (rows of 64 16-bit elements, 8-row groups 1024 bytes apart, tile base 1024-aligned).
//   K-major (Q, K: the reduction dimension contiguous): lbo unused, sbo = 1024.
//   MN-major (V as B of P V: the output dimension contiguous): lbo = bytes between
//   64-column blocks, sbo = 1024 (8 reduction rows).
// It is built from its low word (start address / 16, leading byte offset / 16) over
// a constant high word. Shared addresses stay below 2^18, so the start field (14 bits) of
// addr + off is the base's plus off / 16 with no carry: a k-step's descriptor is one
// 32-bit add to a base computed once. Built from a warp-uniform address (warp_uniform below), it
// stays in uniform registers; from a per-thread one, every wgmma paid a mask, a shift, a
// move of the high word and two register-to-uniform moves (ncu: 0.27 G R2UR of the
// backward's 2.9 G instructions at hdim 128).
__device__ __forceinline__ std::uint32_t smem_desc_lo(std::uint32_t smem_addr, std::uint32_t lbo_bytes) {
  return ((smem_addr & 0x3FFFF) >> 4) | (((lbo_bytes >> 4) & 0x3FFF) << 16);
}
__device__ __forceinline__ std::uint64_t smem_desc_from_lo(std::uint32_t lo) {
  return (std::uint64_t((1024 >> 4) | (1u << 30)) << 32) | lo;  // sbo 1024, 128-byte swizzle
}
// The same for rows of 64 bytes with the 64-byte swizzle (8-row groups 512 bytes apart, tile
// base 512-aligned; K-major only here: the fp8 forward's V^T).
__device__ __forceinline__ std::uint64_t smem_desc_sw64_from_lo(std::uint32_t lo) {
  return (std::uint64_t((512 >> 4) | (2u << 30)) << 32) | lo;  // sbo 512, 64-byte swizzle
}

// A value the compiler may treat as warp-uniform (e.g. the warpgroup index, which it cannot
// prove uniform from threadIdx): descriptors derived from it live in uniform registers.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// stmatrix: four 8 x 8 16-bit matrices from the m16n8 accumulator fragments (register i:
// lane l's two elements of row l / 4, columns 2 (l % 4), +1 of matrix i) to shared memory;
// lanes 8 i .. 8 i + 7 give the addresses of matrix i's rows.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t addr, std::uint32_t r0, std::uint32_t r1, std::uint32_t r2,
                                            std::uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// One 16-byte shared store (st.shared.v4.f32). A float4 store through a pointer was split
// by ptxas into four 4-byte stores for one of eight such stores of the backward's dQ block
// (4 x the wavefronts: ncu, 12.6 M excess per instruction at hdim 128).
__device__ __forceinline__ void st_shared_v4(std::uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// dst[0..3] += {a, b, c, d} in global memory, one 16-byte vector reduction (sm_90), no
// result: a lane's four accumulator floats of one 8-column slab straight to the backward's
// fp32 dQ workspace (sm80/bwd_kernel.cuh has its own, with an atomicAdd fallback).
__device__ __forceinline__ void red_global_add_v4(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

template <int N>
struct Wgmma;  // m64nNk16, fp32 accumulators float d[N / 2]

#define FA_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                   "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// scale_d = 0: d = A B; 1: d += A B. kTransB = 1: B is MN-major (V); kTransA = 1 (ss
// only): A is MN-major (the backward's dS read as the A of dQ = dS K).
#define FA_WGMMA_DEFINE(N, REGS, SS_TAIL, RS_TAIL, SS_P, RS_P, SS8_TAIL, RS8_TAIL, ...)                                  \
  template <>                                                                                      \
  struct Wgmma<N> {                                                                                \
    template <typename Element, int kTransB, int kTransA = 0>                                      \
    __device__ __forceinline__ static void ss(float (&d)[N / 2], std::uint64_t da, std::uint64_t db, \
                                              int scale_d) {                                       \
      if constexpr (std::is_same_v<Element, __nv_fp8_e4m3>) {                                      \
        static_assert(kTransA == 0 && kTransB == 0, "8-bit wgmma operands are K-major only");      \
        asm volatile("{\n.reg .pred p;\n" SS_P "wgmma.mma_async.sync.aligned.m64n" #N               \
                     "k32.f32.e4m3.e4m3 " REGS ", " SS8_TAIL "\n}\n"                               \
                     : __VA_ARGS__                                                                 \
                     : "l"(da), "l"(db), "r"(scale_d), "n"(kTransA), "n"(kTransB));                \
      } else if constexpr (std::is_same_v<Element, __nv_bfloat16>) {                               \
        asm volatile("{\n.reg .pred p;\n" SS_P "wgmma.mma_async.sync.aligned.m64n" #N               \
                     "k16.f32.bf16.bf16 " REGS ", " SS_TAIL "\n}\n"                                \
                     : __VA_ARGS__                                                                 \
                     : "l"(da), "l"(db), "r"(scale_d), "n"(kTransA), "n"(kTransB));                \
      } else {                                                                                     \
        asm volatile("{\n.reg .pred p;\n" SS_P "wgmma.mma_async.sync.aligned.m64n" #N               \
                     "k16.f32.f16.f16 " REGS ", " SS_TAIL "\n}\n"                                  \
                     : __VA_ARGS__                                                                 \
                     : "l"(da), "l"(db), "r"(scale_d), "n"(kTransA), "n"(kTransB));                \
      }                                                                                            \
    }                                                                                              \
    template <typename Element, int kTransB>                                                       \
    __device__ __forceinline__ static void rs(float (&d)[N / 2], const std::uint32_t (&a)[4],     \
                                              std::uint64_t db, int scale_d) {                     \
      if constexpr (std::is_same_v<Element, __nv_fp8_e4m3>) {                                      \
        static_assert(kTransB == 0, "8-bit wgmma operands are K-major only");                     \
        asm volatile("{\n.reg .pred p;\n" RS_P "wgmma.mma_async.sync.aligned.m64n" #N               \
                     "k32.f32.e4m3.e4m3 " REGS ", " RS8_TAIL "\n}\n"                               \
                     : __VA_ARGS__                                                                 \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d),          \
                       "n"(kTransB));                                                              \
      } else if constexpr (std::is_same_v<Element, __nv_bfloat16>) {                               \
        asm volatile("{\n.reg .pred p;\n" RS_P "wgmma.mma_async.sync.aligned.m64n" #N               \
                     "k16.f32.bf16.bf16 " REGS ", " RS_TAIL "\n}\n"                                \
                     : __VA_ARGS__                                                                 \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d),          \
                       "n"(kTransB));                                                              \
      } else {                                                                                     \
        asm volatile("{\n.reg .pred p;\n" RS_P "wgmma.mma_async.sync.aligned.m64n" #N               \
                     "k16.f32.f16.f16 " REGS ", " RS_TAIL "\n}\n"                                  \
                     : __VA_ARGS__                                                                 \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d),          \
                       "n"(kTransB));                                                              \
      }                                                                                            \
    }                                                                                              \
  };

// The operand numbering of each N: accumulators %0 .. %(N/2 - 1), then the inputs.
FA_WGMMA_DEFINE(32,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}",
  "%16, %17, p, 1, 1, %19, %20;", "{%16, %17, %18, %19}, %20, p, 1, 1, %22;",
  "setp.ne.b32 p, %18, 0;\n", "setp.ne.b32 p, %21, 0;\n",
  "%16, %17, p, 1, 1;", "{%16, %17, %18, %19}, %20, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8))
FA_WGMMA_DEFINE(64,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}",
  "%32, %33, p, 1, 1, %35, %36;", "{%32, %33, %34, %35}, %36, p, 1, 1, %38;",
  "setp.ne.b32 p, %34, 0;\n", "setp.ne.b32 p, %37, 0;\n",
  "%32, %33, p, 1, 1;", "{%32, %33, %34, %35}, %36, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24))
FA_WGMMA_DEFINE(80,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}",
  "%40, %41, p, 1, 1, %43, %44;", "{%40, %41, %42, %43}, %44, p, 1, 1, %46;",
  "setp.ne.b32 p, %42, 0;\n", "setp.ne.b32 p, %45, 0;\n",
  "%40, %41, p, 1, 1;", "{%40, %41, %42, %43}, %44, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24), FA_ACC8(32))
FA_WGMMA_DEFINE(96,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}",
  "%48, %49, p, 1, 1, %51, %52;", "{%48, %49, %50, %51}, %52, p, 1, 1, %54;",
  "setp.ne.b32 p, %50, 0;\n", "setp.ne.b32 p, %53, 0;\n",
  "%48, %49, p, 1, 1;", "{%48, %49, %50, %51}, %52, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24), FA_ACC8(32), FA_ACC8(40))
FA_WGMMA_DEFINE(128,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}",
  "%64, %65, p, 1, 1, %67, %68;", "{%64, %65, %66, %67}, %68, p, 1, 1, %70;",
  "setp.ne.b32 p, %66, 0;\n", "setp.ne.b32 p, %69, 0;\n",
  "%64, %65, p, 1, 1;", "{%64, %65, %66, %67}, %68, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24), FA_ACC8(32), FA_ACC8(40), FA_ACC8(48), FA_ACC8(56))
FA_WGMMA_DEFINE(176,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87}",
  "%88, %89, p, 1, 1, %91, %92;", "{%88, %89, %90, %91}, %92, p, 1, 1, %94;",
  "setp.ne.b32 p, %90, 0;\n", "setp.ne.b32 p, %93, 0;\n",
  "%88, %89, p, 1, 1;", "{%88, %89, %90, %91}, %92, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24), FA_ACC8(32), FA_ACC8(40), FA_ACC8(48), FA_ACC8(56), FA_ACC8(64), FA_ACC8(72), FA_ACC8(80))
FA_WGMMA_DEFINE(192,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}",
  "%96, %97, p, 1, 1, %99, %100;", "{%96, %97, %98, %99}, %100, p, 1, 1, %102;",
  "setp.ne.b32 p, %98, 0;\n", "setp.ne.b32 p, %101, 0;\n",
  "%96, %97, p, 1, 1;", "{%96, %97, %98, %99}, %100, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24), FA_ACC8(32), FA_ACC8(40), FA_ACC8(48), FA_ACC8(56), FA_ACC8(64), FA_ACC8(72), FA_ACC8(80), FA_ACC8(88))
FA_WGMMA_DEFINE(256,
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}",
  "%128, %129, p, 1, 1, %131, %132;", "{%128, %129, %130, %131}, %132, p, 1, 1, %134;",
  "setp.ne.b32 p, %130, 0;\n", "setp.ne.b32 p, %133, 0;\n",
  "%128, %129, p, 1, 1;", "{%128, %129, %130, %131}, %132, p, 1, 1;",
  FA_ACC8(0), FA_ACC8(8), FA_ACC8(16), FA_ACC8(24), FA_ACC8(32), FA_ACC8(40), FA_ACC8(48), FA_ACC8(56), FA_ACC8(64), FA_ACC8(72), FA_ACC8(80), FA_ACC8(88), FA_ACC8(96), FA_ACC8(104), FA_ACC8(112), FA_ACC8(120))

#undef FA_WGMMA_DEFINE
#undef FA_ACC8

}  // namespace flashattn::detail::cuda::sm90
