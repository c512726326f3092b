// A device attribute for host-side dispatch decisions, queried once per device (the first
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

}  // namespace flashattn::detail::cuda
