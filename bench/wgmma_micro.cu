// wgmma throughput per SM (sm_90a): m64nNk16 bf16 products for N = 64, 80, 128, 256, A and B
// from shared memory (ss) or A from registers (rs), 1-3 warpgroups per SM, each running
// chains of 8 k-steps into one accumulator waited on to the end ("ss", "rs"), with one
// more chain in flight ("ss-w1"), or into two interleaved accumulators ("-2ch"). One block
// per SM (132), clock64 per warpgroup; the line's % is of 4,096 dense bf16 FLOP per cycle
// per SM. Operands are zeros (the rate does not depend on them). What it answered is in
// docs/performance.md (seventeenth session): a chain waited on to its end loses about one
// wgmma latency; m64n64 ss runs at the full rate from shared memory.
//   flashattn_wgmma_micro        (built with the sm90 family)
#include <cstdio>
#include <cstdint>
#include <cuda_bf16.h>
#include "cuda/arch/sm90_wgmma.cuh"

using namespace flashattn::detail::cuda::sm90;

__device__ __forceinline__ std::uint32_t saddr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// kMode 0: SS one chain; 1: SS two chains interleaved; 2: RS one chain; 3: RS two chains;
// 4: SS one chain, wait<1> (two groups in flight: chain i+1 issued before waiting for i)
template <int N, int kMode, int W>
__global__ void __launch_bounds__(128 * W, 1) micro(int iters, unsigned long long* cyc, float* sink) {
  extern __shared__ unsigned char smraw[];
  unsigned char* sm = smraw + ((1024u - (saddr(smraw) & 1023u)) & 1023u);
  // A: 64 x 128 bf16 (16 KB), B: N x 128 (N*256 bytes), zero-filled
  for (int i = threadIdx.x; i < (16384 + N * 256) / 16; i += blockDim.x) reinterpret_cast<uint4*>(sm)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const std::uint32_t a_lo = smem_desc_lo(saddr(sm), 0);
  const std::uint32_t b_lo = smem_desc_lo(saddr(sm + 16384), 0);
  float acc[N / 2], acc2[(kMode == 1 || kMode == 3) ? N / 2 : 1];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(acc2) / 4); ++i) acc2[i] = 0.f;
  std::uint32_t ra[4] = {threadIdx.x, 0u, 0u, 0u};
  __syncthreads();
  unsigned long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const std::uint32_t offa = ((ks / 4) * 64 * 128 + (ks % 4) * 32) >> 4;
      const std::uint32_t offb = ((ks / 4) * N * 128 + (ks % 4) * 32) >> 4;
      if constexpr (kMode == 0 || kMode == 4) {
        Wgmma<N>::template ss<__nv_bfloat16, 0>(acc, smem_desc_from_lo(a_lo + offa), smem_desc_from_lo(b_lo + offb), 1);
      } else if constexpr (kMode == 1) {
        Wgmma<N>::template ss<__nv_bfloat16, 0>(acc, smem_desc_from_lo(a_lo + offa), smem_desc_from_lo(b_lo + offb), 1);
        Wgmma<N>::template ss<__nv_bfloat16, 0>(acc2, smem_desc_from_lo(a_lo + offa), smem_desc_from_lo(b_lo + offb), 1);
      } else if constexpr (kMode == 2) {
        Wgmma<N>::template rs<__nv_bfloat16, 0>(acc, ra, smem_desc_from_lo(b_lo + offb), 1);
      } else {
        Wgmma<N>::template rs<__nv_bfloat16, 0>(acc, ra, smem_desc_from_lo(b_lo + offb), 1);
        Wgmma<N>::template rs<__nv_bfloat16, 0>(acc2, ra, smem_desc_from_lo(b_lo + offb), 1);
      }
    }
    wgmma_commit();
    if constexpr (kMode == 4) wgmma_wait<1>(); else wgmma_wait<0>();
  }
  wgmma_wait<0>();
  unsigned long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
#pragma unroll
  for (int i = 0; i < (int)(sizeof(acc2) / 4); ++i) s += acc2[i];
  if (s == 12345.f) sink[threadIdx.x] = s;
  if (threadIdx.x % 128 == 0) cyc[blockIdx.x * 3 + threadIdx.x / 128] = t1 - t0;
}

template <int N, int kMode, int wgs>
void run(const char* name) {
  const int iters = 2000, blocks = 132;
  unsigned long long* cyc; float* sink;
  cudaMalloc(&cyc, blocks * 3 * 8); cudaMalloc(&sink, 4096);
  const int smem = 16384 + N * 256 + 1024;
  cudaFuncSetAttribute(micro<N, kMode, wgs>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  micro<N, kMode, wgs><<<blocks, 128 * wgs, smem>>>(50, cyc, sink);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  micro<N, kMode, wgs><<<blocks, 128 * wgs, smem>>>(iters, cyc, sink);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  unsigned long long h[blocks * 3]; cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost);
  double mx = 0; for (int b = 0; b < blocks; ++b) for (int w = 0; w < wgs; ++w) mx = mx > h[b*3+w] ? mx : h[b*3+w];
  const int mults = (kMode == 1 || kMode == 3) ? 2 : 1;
  const double flop_sm = double(iters) * 8 * mults * wgs * 2.0 * 64 * N * 16;
  const double tflops = flop_sm * blocks / (ms * 1e-3) / 1e12;
  printf("%-10s N=%3d wgs=%d  %7.1f FLOP/clk/SM (%5.1f%% of 4096)  %6.1f TFLOP/s  %.3f ms  cyc/wgmma/wg=%.1f\n", name, N, wgs,
         flop_sm / mx, 100.0 * flop_sm / mx / 4096, tflops, ms, mx / (double(iters) * 8 * mults));
  cudaError_t e = cudaGetLastError(); if (e) printf("err %s\n", cudaGetErrorString(e));
  cudaFree(cyc); cudaFree(sink);
}

template <int N, int w>
void one() {
    run<N, 0, w>("ss");
    run<N, 4, w>("ss-w1");
    if constexpr (N <= 128) run<N, 1, w>("ss-2ch");
    // (At three warpgroups, 168 registers, ptxas serialises the wgmmas of rs at N = 256 and
    // of two rs chains at N >= 80: those are not run.)
    if constexpr (!(w == 3 && N == 256)) run<N, 2, w>("rs");
    if constexpr (N <= 128 && !(w == 3 && N >= 80)) run<N, 3, w>("rs-2ch");
}
template <int N>
void all() {
  one<N, 1>(); one<N, 2>(); one<N, 3>();
}
int main() {
  all<64>(); all<80>(); all<128>(); all<256>();
  return 0;
}
