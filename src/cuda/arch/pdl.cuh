// Programmatic dependent launch, device side (sm90 and newer; no-ops below).
#pragma once

namespace flashattn::detail::cuda {

// Programmatic dependent launch (sm90; launch_decode sets the launch attribute there):
// the kernel may start while the previous kernel in the stream finishes, and waits for it
// (its completion and memory flush) before the first global memory access; it lets the
// next kernel launch once all its blocks have started. Without the attribute both are
// no-ops.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace flashattn::detail::cuda
