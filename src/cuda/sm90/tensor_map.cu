#include "cuda/sm90/tensor_map.hpp"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "flashattn/error.hpp"

namespace flashattn::detail::cuda::sm90 {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    } else {
      cudaGetLastError();
    }
  });
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map_4d(const void* base, DType dtype, const std::uint64_t (&dims)[4],
                               const std::uint64_t (&byte_strides)[3], std::uint32_t box_rows,
                               std::uint32_t row_bytes) {
  const auto fn = encode_fn();
  if (fn == nullptr) {
    throw Error("flashattn::forward: the CUDA driver has no cuTensorMapEncodeTiled (sm90 path)");
  }
  CUtensorMap map{};
  const cuuint64_t g_dims[4] = {dims[0], dims[1], dims[2], dims[3]};
  const cuuint64_t g_strides[3] = {byte_strides[0], byte_strides[1], byte_strides[2]};
  const bool bytes = dtype == DType::kFloat8E4M3;  // fp8: 128 one-byte columns per box row
  const cuuint32_t box[4] = {bytes ? row_bytes : row_bytes / 2, box_rows, 1u, 1u};
  const cuuint32_t elem_strides[4] = {1u, 1u, 1u, 1u};
  const CUresult r = fn(&map,
                        bytes                        ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                        : dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                    : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        4, const_cast<void*>(base), g_dims, g_strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("flashattn::forward: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) +
                ") for dims {" + std::to_string(dims[0]) + ", " + std::to_string(dims[1]) + ", " +
                std::to_string(dims[2]) + ", " + std::to_string(dims[3]) + "}");
  }
  return map;
}

}  // namespace flashattn::detail::cuda::sm90
