// Element conversions of the decode kernel: two fp8 e4m3 bytes to an f16x2 register
// (exact; cvt.rn.f16x2.e4m3x2 on sm89+, cuda_fp8.h's software path before), and 16-bit
// values to / from float with the dtype (fp16 or bf16) chosen at run time. Used by the sm80
// decode kernel (decode_kernel.cuh: fp8 K / V fragments converted in registers before the
// f16 MMAs; the output store) and by the split-KV merge (split_kv_merge.cuh). Built on
// arch/sm80.cuh (and arch/pack.cuh's pack2), in the sm80 namespace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/arch/sm80.cuh"

namespace flashattn::detail::cuda::sm80 {

// Two e4m3 (low byte first) -> f16x2 (low half first), exact: bytes 0-1 or 2-3 of x. On
// sm89+ the PTX half selection becomes F2FP's .H1 operand (no shift); before sm89 there
// is no e4m3 conversion instruction and cuda_fp8.h's software path runs.
__device__ __forceinline__ std::uint32_t e4m3x2_to_f16x2_sw(std::uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  return static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
}
__device__ __forceinline__ std::uint32_t e4m3x2_lo_to_f16x2(std::uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(d) : "r"(x));
  return d;
#else
  return e4m3x2_to_f16x2_sw(x);
#endif
}
__device__ __forceinline__ std::uint32_t e4m3x2_hi_to_f16x2(std::uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(d) : "r"(x));
  return d;
#else
  return e4m3x2_to_f16x2_sw(x >> 16);
#endif
}

__device__ __forceinline__ float to_float(std::uint16_t bits, bool bf16) {
  if (bf16) return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}

__device__ __forceinline__ std::uint32_t pack_out(float lo, float hi, bool bf16) {
  return bf16 ? pack2<__nv_bfloat16>(lo, hi) : pack2<__half>(lo, hi);
}

}  // namespace flashattn::detail::cuda::sm80
