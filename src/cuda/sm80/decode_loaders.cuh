// The shared-memory layout of the decode kernel's K and V tiles (decode_kernel.cuh):
// TileLayout, the tile's rows in boxes with their 128-byte segments XOR-swizzled by
// row % 8 (the layout TMA's 128-byte swizzle writes, and that ldmatrix reads without bank
// conflicts), LdsmRow, a thread's ldmatrix row of it, and the cp.async forms the kernel's
// loader uses where TMA does not (16 bytes with a byte count, zero-filling the rest; 4
// bytes for the fp8 per-key scales). Used by decode_kernel only (its K/V tile loader,
// decode_kernel_loaders.inc, and its fragment loads).
#pragma once

#include <cstdint>

#include "cuda/arch/sm80.cuh"

namespace flashattn::detail::cuda::sm80 {

namespace decode_detail {

// 16-byte async copy of src_bytes (0..16) bytes, the rest zero-filled.
__device__ __forceinline__ void cp_async_n(std::uint32_t smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_4(std::uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 4 : 0));
}

// Where the 16-byte chunks of a K or V tile live (decode_launch.hpp): the tile's rows in
// boxes of 2^box_shift rows (a whole tile when dense, a paged cache's block otherwise),
// each box holding its rows' 128-byte segments one after another ([box][segment][row]
// [128 B]), the chunks of a row XOR-swizzled by row % 8: the layout that TMA tensor copies
// with 128-byte swizzle write, one copy per box (or per box and segment), and that
// ldmatrix reads without bank conflicts.
template <class Tr>
struct TileLayout {
  int box_shift;  // log2 rows per box, >= 3
  __device__ __forceinline__ std::uint32_t seg_stride() const { return 1u << (box_shift + 7); }
  __device__ __forceinline__ std::uint32_t box_bytes() const { return Tr::kSegs * seg_stride(); }
  __device__ __forceinline__ std::uint32_t row_base(int row) const {
    return static_cast<std::uint32_t>(row >> box_shift) * box_bytes() +
           (static_cast<std::uint32_t>(row & ((1 << box_shift) - 1)) << 7);
  }
  __device__ __forceinline__ std::uint32_t offset(int row, int chunk) const {
    return row_base(row) + static_cast<std::uint32_t>(chunk >> 3) * seg_stride() +
           static_cast<std::uint32_t>(((chunk & 7) ^ (row & 7)) << 4);
  }
};
// One thread's ldmatrix row of a tile: chunk 2 * s + bit for s = 0, 1, ... with a
// per-thread bit, the row part computed once.
struct LdsmRow {
  std::uint32_t base, seg_stride;
  int x;  // (row % 8) ^ bit
  template <class Tr>
  __device__ __forceinline__ LdsmRow(const TileLayout<Tr>& l, int row, int bit)
      : base(l.row_base(row)), seg_stride(l.seg_stride()), x((row & 7) ^ bit) {}
  __device__ __forceinline__ std::uint32_t at(int s) const {
    return base + static_cast<std::uint32_t>(s >> 2) * seg_stride + static_cast<std::uint32_t>((((2 * s) & 7) ^ x) << 4);
  }
};

}  // namespace decode_detail

}  // namespace flashattn::detail::cuda::sm80
