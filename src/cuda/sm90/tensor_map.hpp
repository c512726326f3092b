// Host side of the sm90 tensor copies: a 4-D tiled tensor map over a 16-bit or 8-bit (fp8)
// tensor with the 128-byte swizzle, encoded through the driver entry point (no link to libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "flashattn/tensor.hpp"

namespace flashattn::detail::cuda::sm90 {

// dims (innermost first) and the byte strides of dims 1..3; box = {one 128-byte row (64
// 16-bit or 128 fp8 columns), box_rows, 1, 1}. Columns past dims[0] and rows past dims[1] read as zero.
// row_bytes 64: rows of 64 bytes with the 64-byte swizzle (the fp8 forward's V^T).
CUtensorMap make_tensor_map_4d(const void* base, DType dtype, const std::uint64_t (&dims)[4],
                               const std::uint64_t (&byte_strides)[3], std::uint32_t box_rows,
                               std::uint32_t row_bytes = 128);

// The byte stride of a tensor-map dimension: TMA strides are multiples of 16 bytes, and a
// dimension of extent 1 may carry any stride (the API checks only the strides of longer
// dimensions), so it gets a harmless one.
inline std::uint64_t tma_stride(std::int64_t extent, std::int64_t stride_elems, int elem_bytes = 2) {
  return extent > 1 ? std::uint64_t(stride_elems) * std::uint64_t(elem_bytes) : 16;
}

// Whether TMA takes the stride tma_stride gives a dimension of elem_bytes-byte elements: a
// multiple of 16 bytes below 2^40, or any stride at extent 1.
inline bool tma_stride_ok(std::int64_t extent, std::int64_t stride_elems, int elem_bytes = 2) {
  if (extent <= 1) return true;
  const std::int64_t bytes = stride_elems * elem_bytes;
  return bytes > 0 && bytes % 16 == 0 && bytes < (std::int64_t(1) << 40);
}
// A tensor-map base address: 16-byte aligned.
inline bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// Whether a tensor of `rows` rows, `heads` heads and `batches` batches at base, with those
// element strides, takes a tensor map (TMA stores and the sm90 MLA kernel's copies check
// it; the API's layout rules cover the other maps): a 16-byte aligned base and strides
// tma_stride_ok takes.
inline bool tma_layout_ok(const void* base, std::int64_t rows, std::int64_t row_stride, std::int64_t heads,
                          std::int64_t head_stride, std::int64_t batches, std::int64_t batch_stride) {
  return aligned16(base) && tma_stride_ok(rows, row_stride) && tma_stride_ok(heads, head_stride) &&
         tma_stride_ok(batches, batch_stride);
}

}  // namespace flashattn::detail::cuda::sm90
