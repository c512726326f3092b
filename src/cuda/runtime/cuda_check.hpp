// CUDA runtime error handling of the backend: every failing runtime call becomes a
// flashattn::CudaError naming the call, the file and line, and the runtime's message.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "flashattn/error.hpp"

namespace flashattn::detail::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw CudaError(std::string("flashattn CUDA: ") + what + " failed at " + file + ":" +
                  std::to_string(line) + ": " + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ")");
}

}  // namespace flashattn::detail::cuda

#define FLASHATTN_CUDA_CHECK(expr)                                                          \
  do {                                                                                      \
    const cudaError_t flashattn_err_ = (expr);                                              \
    if (flashattn_err_ != cudaSuccess)                                                      \
      ::flashattn::detail::cuda::throw_cuda_error(flashattn_err_, #expr, __FILE__, __LINE__); \
  } while (0)
