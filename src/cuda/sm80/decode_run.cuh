// The host side of the decode kernel (decode_kernel.cuh): launch_decode sets the dynamic
// shared memory and launches one instantiation with its grid (row chunks x splits, KV
// heads, sequences) and, when asked, programmatic dependent launch; run_decode /
// run_decode_fp8 pick the transposed (kT8) or 16-row form and the default or small
// (99 KiB) configuration, instantiating the small one only where it is a kernel of its
// own (decode_launch.hpp: kDecodeHasSmall); FLASHATTN_DECODE_INSTANTIATE is
// what the generated translation units (decode.inst.cu.in) expand. Called from
// decode_dispatch.cu through decode_launch.hpp's declarations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "core/params.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm80/decode_kernel.cuh"
#include "cuda/sm80/decode_launch.hpp"

namespace flashattn::detail::cuda::sm80 {

// The kernel attributes a launch of `cluster`-block clusters (0: none) needs: the dynamic
// shared memory above 48 KiB, and Hopper's non-portable sizes (9..16 blocks) where asked.
// Shared by the launch and the occupancy query (max_active_clusters), which must see the
// kernel as the launch does.
template <class Kernel>
cudaError_t set_decode_attributes(Kernel kernel, int smem, int cluster) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  if (cluster > kMaxPortableClusterSplits) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  }
  return cudaSuccess;
}

// The launch attribute of `splits`-block clusters along x (a row chunk's splits).
inline cudaLaunchAttribute decode_cluster_attribute(int splits) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(splits);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

template <int kHeadDim, typename Element, bool kFp8, bool kT8, bool kSmall>
void launch_decode(const FwdParams& p, const DecodeArgs& a) {
  using Tr = DecodeTraits<kHeadDim, kFp8, kT8, kSmall>;
  auto kernel = decode_kernel<kHeadDim, Element, kFp8, kT8, kSmall>;
  constexpr int kSmem = Tr::kSmemBytes;
  FLASHATTN_CUDA_CHECK(set_decode_attributes(kernel, kSmem, a.cluster ? a.splits : 0));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(a.row_chunks * a.splits), static_cast<unsigned>(p.h_k),
                     static_cast<unsigned>(p.batch));
  cfg.blockDim = dim3(Tr::kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = static_cast<cudaStream_t>(p.stream);
  cudaLaunchAttribute attr[2];
  unsigned n_attr = 0;
  if (a.pdl) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
    ++n_attr;
  }
  if (a.cluster) {  // a row chunk's splits in one cluster (blockIdx.x = chunk * splits + split)
    attr[n_attr++] = decode_cluster_attribute(a.splits);
  }
  cfg.attrs = attr;
  cfg.numAttrs = n_attr;
  FLASHATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, a));
}

// decode_launch.hpp: decode_max_active_clusters. One cache per kernel: the answer + 1 per
// (device < 64, cluster size), 0 until asked (a failed query is kept as 0 clusters, so
// that the workspace sizing and the call see the same plan). The query changes no stream
// work: the thread's capture mode is relaxed around it (a capture in another thread or of
// this thread's stream stays valid), the device switched to `device` and back where it
// differs; the kernel's attributes (dynamic shared memory, non-portable cluster sizes) are
// those launch_decode sets.
template <int kHeadDim, typename Element, bool kFp8, bool kT8, bool kSmall>
int max_active_clusters(int device, int cluster) {
  if (cluster < 1 || cluster > kMaxClusterSplits) return 0;
  static std::atomic<int> cached[64][kMaxClusterSplits + 1] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable) {
    const int v = cached[device][cluster].load(std::memory_order_relaxed);
    if (v > 0) return v - 1;
  }
  using Tr = DecodeTraits<kHeadDim, kFp8, kT8, kSmall>;
  auto kernel = decode_kernel<kHeadDim, Element, kFp8, kT8, kSmall>;
  constexpr int kSmem = Tr::kSmemBytes;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool relaxed = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  int n = 0;
  bool failed = false;
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && (previous == device || cudaSetDevice(device) == cudaSuccess)) {
    const bool ok = set_decode_attributes(kernel, kSmem, cluster) == cudaSuccess;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(cluster));
    cfg.blockDim = dim3(Tr::kThreads);
    cfg.dynamicSmemBytes = kSmem;
    cudaLaunchAttribute attr[1] = {decode_cluster_attribute(cluster)};
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (!ok || cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
      n = 0;
      failed = true;
    }
    if (previous != device) cudaSetDevice(previous);
  } else {
    failed = true;
  }
  if (failed) cudaGetLastError();  // the query's own error, not the caller's
  if (relaxed) cudaThreadExchangeStreamCaptureMode(&mode);
  n = n < 0 ? 0 : n;
  if (cacheable) cached[device][cluster].store(n + 1, std::memory_order_relaxed);
  return n;
}

template <int kHeadDim, typename Element, bool kFp8, bool kT8>
int max_active_clusters_config(int device, bool small, int cluster) {
  if constexpr (kDecodeHasSmall<kHeadDim, kFp8, kT8>) {
    if (small) return max_active_clusters<kHeadDim, Element, kFp8, kT8, true>(device, cluster);
  }
  return max_active_clusters<kHeadDim, Element, kFp8, kT8, false>(device, cluster);
}

template <int kHeadDim, typename Element>
int decode_max_active_clusters(int device, bool t8, bool small, int cluster) {
  return t8 ? max_active_clusters_config<kHeadDim, Element, false, true>(device, small, cluster)
            : max_active_clusters_config<kHeadDim, Element, false, false>(device, small, cluster);
}

template <int kHeadDim>
int decode_fp8_max_active_clusters(int device, bool t8, bool small, int cluster) {
  return t8 ? max_active_clusters_config<kHeadDim, __half, true, true>(device, small, cluster)
            : max_active_clusters_config<kHeadDim, __half, true, false>(device, small, cluster);
}

// The small configuration where asked for and a kernel of its own, else the default.
template <int kHeadDim, typename Element, bool kFp8, bool kT8>
void launch_decode_config(const FwdParams& p, const DecodeArgs& a, bool small) {
  if constexpr (kDecodeHasSmall<kHeadDim, kFp8, kT8>) {
    if (small) {
      launch_decode<kHeadDim, Element, kFp8, kT8, true>(p, a);
      return;
    }
  }
  launch_decode<kHeadDim, Element, kFp8, kT8, false>(p, a);
}

template <int kHeadDim, typename Element>
void run_decode(const FwdParams& p, const DecodeArgs& a, bool small) {
  if (a.t8) {
    launch_decode_config<kHeadDim, Element, false, true>(p, a, small);
  } else {
    launch_decode_config<kHeadDim, Element, false, false>(p, a, small);
  }
}

template <int kHeadDim>
void run_decode_fp8(const FwdParams& p, const DecodeArgs& a, bool small) {
  if (a.t8) {
    launch_decode_config<kHeadDim, __half, true, true>(p, a, small);
  } else {
    launch_decode_config<kHeadDim, __half, true, false>(p, a, small);
  }
}

}  // namespace flashattn::detail::cuda::sm80

// One generated translation unit per (head dim, dtype): fp16 also holds the fp8 variant.
#define FLASHATTN_DECODE_INSTANTIATE_fp16(D)                                                     \
  template void run_decode<D, __half>(const FwdParams&, const DecodeArgs&, bool);              \
  template void run_decode_fp8<D>(const FwdParams&, const DecodeArgs&, bool);                  \
  template int decode_max_active_clusters<D, __half>(int, bool, bool, int);                    \
  template int decode_fp8_max_active_clusters<D>(int, bool, bool, int);
#define FLASHATTN_DECODE_INSTANTIATE_bf16(D)                                                \
  template void run_decode<D, __nv_bfloat16>(const FwdParams&, const DecodeArgs&, bool); \
  template int decode_max_active_clusters<D, __nv_bfloat16>(int, bool, bool, int);
#define FLASHATTN_DECODE_INSTANTIATE(D, DTYPE) FLASHATTN_DECODE_INSTANTIATE_##DTYPE(D)
