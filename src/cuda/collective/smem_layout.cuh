// Swizzled shared-memory tiles of 16-bit elements, conflict-free for 16-byte cp.async
// stores and for ldmatrix reads of 8 consecutive rows at one 16-byte column chunk.
//
// A tile of kRows x kCols (kCols % 32 == 0) is stored as column blocks of kBlockCols
// (64 when kCols % 64 == 0, else 32) elements; a block is row-major, and within each
// row the 16-byte chunks are permuted by an XOR with bits of the row:
//   64-wide blocks (128-byte rows):  chunk' = chunk ^ (row & 7)
//   32-wide blocks ( 64-byte rows):  chunk' = chunk ^ ((row >> 1) & 3)
// so 8 consecutive rows at one logical chunk land in 8 distinct 16-byte bank groups.
#pragma once

namespace flashattn::detail::cuda {

template <int kRows_, int kCols_>
struct SwizzledTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static_assert(kCols % 32 == 0, "SwizzledTile: columns must be a multiple of 32");
  static_assert(kRows % 8 == 0, "SwizzledTile: rows must be a multiple of 8");
  static constexpr int kBlockCols = kCols % 64 == 0 ? 64 : 32;
  static constexpr int kElements = kRows * kCols;
  static constexpr int kBytes = kElements * 2;

  // Element offset of (row, col); col may be any column, the swizzle moves whole chunks.
  __host__ __device__ __forceinline__ static int offset(int row, int col) {
    const int block = col / kBlockCols;
    const int chunk = (col % kBlockCols) >> 3;
    const int swizzle = kBlockCols == 64 ? (row & 7) : ((row >> 1) & 3);
    return block * (kRows * kBlockCols) + row * kBlockCols + ((chunk ^ swizzle) << 3) + (col & 7);
  }

  // ldmatrix addressing split into a per-lane register part and a compile-time part, so a
  // fully unrolled loop needs kColVariants address registers per tile instead of one per
  // access (ldmatrix takes [reg + imm]). For a row r = row8 + lane_row (row8 % 8 == 0) and
  // a column c = col16 + 8 * half (col16 % 16 == 0, half in {0, 1}):
  //   2 * offset(r, c) == lane_bytes(lane_row, half, variant(col16)) + const_bytes(row8, col16)
  // because the swizzle only reads row % 8 and col16's chunk is even.
  static constexpr int kColVariants = kBlockCols / 16;
  __host__ __device__ __forceinline__ static constexpr int variant(int col16) {
    return (col16 % kBlockCols) / 16;
  }
  __host__ __device__ __forceinline__ static constexpr int const_bytes(int row8, int col16) {
    return 2 * ((col16 / kBlockCols) * (kRows * kBlockCols) + row8 * kBlockCols);
  }
  __host__ __device__ __forceinline__ static int lane_bytes(int lane_row, int half, int var) {
    const int swizzle = kBlockCols == 64 ? (lane_row & 7) : ((lane_row >> 1) & 3);
    return 2 * (lane_row * kBlockCols + (((2 * var + half) ^ swizzle) << 3));
  }
};

}  // namespace flashattn::detail::cuda
