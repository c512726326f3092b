// Device attributes for host-side dispatch decisions, queried once per device (the first
// 64) and cached; `fallback` where the query fails (its error is cleared) or the value is
// not positive. Safe to call from several host threads.
#pragma once

#include <atomic>

#include <cuda_runtime_api.h>

namespace flashattn::detail::cuda {

template <cudaDeviceAttr kAttr>
int device_attribute(int device, int fallback) {
  static std::atomic<int> cached[64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable) {
    const int v = cached[device].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int v = 0;
  if (cudaDeviceGetAttribute(&v, kAttr, device) != cudaSuccess || v <= 0) {
    cudaGetLastError();
    return fallback;
  }
  if (cacheable) cached[device].store(v, std::memory_order_relaxed);
  return v;
}

// Compute capability as major * 10 + minor (the minor alone may be 0, which the cache
// above does not keep); 0 where the query fails.
inline int device_compute_capability(int device) {
  const int major = device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0);
  if (major == 0) return 0;
  static std::atomic<int> cached[64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable) {
    const int v = cached[device].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int minor = 0;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const int cc = major * 10 + minor;
  if (cacheable) cached[device].store(cc, std::memory_order_relaxed);
  return cc;
}

}  // namespace flashattn::detail::cuda
