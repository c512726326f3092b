// Tile loaders: cp.async copies of a [rows x head dim] tile from global memory into a
// swizzled shared-memory tile (smem_layout.cuh's SwizzledTile), rows past the end and
// columns past `d` (a head dim below the bucket) zero-filled. load_tile takes a per-row
// address (paged KV), load_tile_strided rows at a constant stride, FullTileCopy is the
// per-thread plan of a tile whose rows all exist (the steady-state key tile). Used by the
// sm80 forward (fwd_kernel.cuh) for Q, K and V, and by the backward (bwd_kernel.cuh:
// load_tile_async, which walks its tiles the same way). sm80 cp.async (arch/sm80.cuh), so
// in the sm80 namespace like the wrappers they are built on.
#pragma once

#include <cstdint>

#include "cuda/arch/sm80.cuh"
#include "cuda/collective/smem_layout.cuh"

namespace flashattn::detail::cuda::sm80 {

// Issues the cp.async copies of one [Tile::kRows x kHeadDim] tile. row_ptr(r) gives the
// global address of row r or nullptr for a row past the end (zero-filled); columns at or
// past `d` (a head dim below the bucket) are zero-filled too.
template <class Tile, int kThreads, typename Element, typename RowPtr>
__device__ __forceinline__ void load_tile(Element* smem, const RowPtr& row_ptr, int d,
                                          const void* any_mapped, int tid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;
  constexpr int kChunks = Tile::kRows * kChunksPerRow;
  constexpr int kPasses = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int idx = tid + pass * kThreads;
    if (kChunks % kThreads == 0 || idx < kChunks) {
      const int row = idx / kChunksPerRow;
      const int col = (idx % kChunksPerRow) * 8;
      const Element* src = row_ptr(row);
      const bool valid = src != nullptr && col < d;
      cp_async_16(smem_u32(smem + Tile::offset(row, col)), valid ? src + col : any_mapped, valid);
    }
  }
}

// The same for rows at a constant stride (dense, varlen, dense KV cache): rows_valid rows
// from `rows`. When the threads cover whole rows in steps of 8 rows, each thread keeps
// one column, one source pointer and one shared address, advanced by constants per pass.
template <class Tile, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_strided(Element* smem, const Element* rows,
                                                  std::int64_t row_stride, int rows_valid, int d,
                                                  const void* any_mapped, int tid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;
  if constexpr (kThreads % kChunksPerRow == 0 && (kThreads / kChunksPerRow) % 8 == 0) {
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    constexpr int kPasses = (Tile::kRows + kRowsPerPass - 1) / kRowsPerPass;
    const int row0 = tid / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * 8;
    const Element* src = rows + std::int64_t(row0) * row_stride + col;
    const std::uint32_t dst = smem_u32(smem + Tile::offset(row0, col));
    const bool col_ok = col < d;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = row0 + pass * kRowsPerPass;
      if (Tile::kRows % kRowsPerPass == 0 || row < Tile::kRows) {
        const bool valid = col_ok && row < rows_valid;
        // the swizzle reads row % 8 only, so a step of kRowsPerPass rows is a constant
        cp_async_16(dst + pass * kRowsPerPass * Tile::kBlockCols * 2,
                    valid ? src + pass * kRowsPerPass * row_stride : any_mapped, valid);
      }
    }
  } else {
    auto row_ptr = [&](int r) -> const Element* {
      return r < rows_valid ? rows + std::int64_t(r) * row_stride : nullptr;
    };
    load_tile<Tile, kThreads>(smem, row_ptr, d, any_mapped, tid);
  }
}

// Per-thread copy plan of a [Tile::kRows x kHeadDim] tile whose rows all exist and lie at a
// constant stride (a key tile below the last one of a dense, varlen or dense-cache call):
// each thread copies one 16-byte column chunk of every kRowsPerPass-th row, so a tile is
// the thread's source pointer plus a per-pass stride and no per-row test. The swizzle
// reads row % 8 only, so the shared address of a pass is one of kDstVariants per-thread
// addresses (the passes within 8 rows) plus a constant. A thread whose column lies at or
// past d reads nothing (src-size 0 zero-fills) from the mapped column 0.
template <class Tile, int kThreads>
struct FullTileCopy {
  static constexpr int kChunksPerRow = Tile::kCols / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr bool kApplies = kThreads % kChunksPerRow == 0 && kRowsPerPass > 0 &&
                                   (kRowsPerPass % 8 == 0 || 8 % kRowsPerPass == 0) &&
                                   Tile::kRows % kRowsPerPass == 0 && Tile::kRows % 8 == 0;
  static constexpr int kPasses = kApplies ? Tile::kRows / kRowsPerPass : 0;
  // passes per 8 rows (1 when a pass covers 8 or more rows)
  static constexpr int kDstVariants = kApplies && kRowsPerPass < 8 ? 8 / kRowsPerPass : 1;

  __device__ __forceinline__ static int row(int tid) { return tid / kChunksPerRow; }
  __device__ __forceinline__ static int col(int tid) { return (tid % kChunksPerRow) * 8; }
  // Shared byte offset of this thread's chunk in pass `variant` (< kDstVariants).
  __device__ __forceinline__ static int dst_bytes(int tid, int variant) {
    return 2 * Tile::offset(row(tid) + variant * kRowsPerPass, col(tid));
  }

  // src: this thread's chunk in the tile's first row; dst: dst_bytes() + the tile's base.
  template <typename Element>
  __device__ __forceinline__ static void issue(const std::uint32_t (&dst)[kDstVariants],
                                               std::uint32_t base, const Element* src,
                                               std::int64_t row_stride, bool col_ok) {
    const std::int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      constexpr int kGroupBytes = kDstVariants * kRowsPerPass * Tile::kBlockCols * 2;
      cp_async_16(dst[pass % kDstVariants] + base + (pass / kDstVariants) * kGroupBytes, src,
                  col_ok);
      src += pass_stride;
    }
  }
};

// rows x kCols tile from global memory (row stride in elements) into a swizzled tile;
// rows >= rows_valid and columns >= d are zero-filled, so padded rows and the head-dim
// padding of a bucket contribute exact zeros to every product. When the row's 16-byte
// chunks divide the thread count, each thread owns one column chunk and every
// kRowsPerPass-th row: a pass moves kRowsPerPass (a multiple of 8) rows, which leaves the
// swizzle unchanged, so the shared address of pass k is the thread's first address plus a
// constant. Other widths (d = 96, 160, 192, 224) walk the chunks generically.
template <class Tile, int kNThreads, typename Element>
__device__ __forceinline__ void load_tile_async(std::uint32_t s_base, const Element* g_base,
                                                std::int64_t row_stride, int rows_valid, int d,
                                                int tid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;
  constexpr int kRowsPerPass = kNThreads / kChunksPerRow;
  if constexpr (kNThreads % kChunksPerRow == 0 && kRowsPerPass % 8 == 0 &&
                Tile::kRows % kRowsPerPass == 0) {
    const int row = tid / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * 8;
    const bool col_ok = col < d;
    const std::uint32_t s_thread = s_base + 2u * Tile::offset(row, col);
    const Element* const g_thread = g_base + row * row_stride + col;
    if (rows_valid >= Tile::kRows && d >= Tile::kCols) {
      // Interior tile (block-uniform): every chunk is valid, so no per-pass row test and
      // no clamped source address; the pointer steps by a uniform pass stride.
      const Element* src = g_thread;
      const std::int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
      for (int k = 0; k < Tile::kRows / kRowsPerPass; ++k) {
        cp_async_16(s_thread + 2u * (k * kRowsPerPass * Tile::kBlockCols), src, true);
        src += pass_stride;
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < Tile::kRows / kRowsPerPass; ++k) {
      const bool valid = col_ok && row + k * kRowsPerPass < rows_valid;
      const Element* src = valid ? g_thread + k * kRowsPerPass * row_stride : g_base;
      cp_async_16(s_thread + 2u * (k * kRowsPerPass * Tile::kBlockCols), src, valid);
    }
  } else if constexpr (kNThreads % kChunksPerRow == 0 && kRowsPerPass > 0 && 8 % kRowsPerPass == 0 &&
                       Tile::kRows % 8 == 0) {
    // Rows wider than the threads cover 8 at a time (512 columns: 4 rows per pass): the
    // passes within 8 rows take kVariants shared addresses, each 8-row group adds a
    // constant, so the loop keeps kVariants addresses and a pointer instead of one
    // address per chunk.
    constexpr int kVariants = 8 / kRowsPerPass;
    const int row = tid / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * 8;
    const bool col_ok = col < d;
    std::uint32_t s_thread[kVariants];
#pragma unroll
    for (int v = 0; v < kVariants; ++v) s_thread[v] = s_base + 2u * Tile::offset(row + v * kRowsPerPass, col);
    const Element* const g_thread = g_base + row * row_stride + col;
    const std::int64_t pass_stride = kRowsPerPass * row_stride;
    const bool interior = rows_valid >= Tile::kRows && d >= Tile::kCols;  // block-uniform
#pragma unroll
    for (int k = 0; k < Tile::kRows / kRowsPerPass; ++k) {
      const bool valid = interior || (col_ok && row + k * kRowsPerPass < rows_valid);
      const Element* src = valid ? g_thread + k * pass_stride : g_base;
      cp_async_16(s_thread[k % kVariants] + 2u * ((k / kVariants) * 8 * Tile::kBlockCols), src, valid);
    }
  } else {
    constexpr int kChunks = Tile::kRows * kChunksPerRow;
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += kNThreads) {
      const int c = c0 + tid;
      if (kChunks % kNThreads != 0 && c >= kChunks) break;
      const int row = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = row < rows_valid && col < d;
      const Element* src = valid ? g_base + row * row_stride + col : g_base;
      cp_async_16(s_base + 2u * Tile::offset(row, col), src, valid);
    }
  }
}

}  // namespace flashattn::detail::cuda::sm80
