// One warp's GEMM over swizzled shared-memory tiles: acc[kM x kN] += A[kM x kK] *
// B[kK x kN] on mma.sync m16n8k16, A and B by ldmatrix (or ldmatrix.trans for an operand
// stored transposed), the lane's base addresses computed once (WarpGemmLanes) so that an
// ldmatrix costs one XOR and an immediate, optionally double-buffered fragments. Also
// zero_acc for the accumulators. Used by the sm80 backward (bwd_kernel.cuh: S, dP, dV, dK
// and dQ); built on arch/sm80.cuh's wrappers, so in the sm80 namespace like them.
#pragma once

#include <cstdint>

#include "cuda/arch/sm80.cuh"
#include "cuda/collective/smem_layout.cuh"

namespace flashattn::detail::cuda::sm80 {

// Address arithmetic of warp_gemm. A SwizzledTile permutes 16-byte chunks by an XOR with
// bits of the row that a step of 8 rows cannot change, so the address of
// (row0 + lr, col0 + lcc * 8), row0 % 8 == 0, col0 % 16 == 0, is the lane's base address
// (of (lr, lcc * 8)) XOR the chunk bits of col0 plus a compile-time row / block offset:
// one LOP3 per ldmatrix and an immediate, instead of recomputing the swizzle.
// Whether a warp's column offset (a multiple of the warp tile width kWidth) can be folded
// into the lane's base offset: the column steps inside the warp tile must then change the
// swizzled chunk bits by XOR alone, which holds when kWidth is a power of two (the
// offset's bits and the steps' bits are disjoint, and no step leaves a column block).
template <int kWidth>
inline constexpr bool kFoldableColumnOffset = (kWidth & (kWidth - 1)) == 0;

// A warp's ldmatrix addressing for acc[kM x kN] += A[kM x kK] * B[kK x kN] (warp_gemm):
// the lane's byte offsets into the A and B tiles and the address of fragment (row0, col0).
template <int kM, int kN, bool kATrans, bool kBTrans, class TileA, class TileB>
struct WarpGemmLanes {
  static constexpr bool kAFold = !kATrans || kFoldableColumnOffset<kM>;
  static constexpr bool kBFold = !kBTrans || kFoldableColumnOffset<kN>;
  std::uint32_t a_off, b_off;  // add to a tile's base
  int a_col_rt, b_col_rt;      // unfolded (run-time) column offsets

  __device__ __forceinline__ WarpGemmLanes(int a_m0, int b_n0, int lane) {
    // Lane roles of ldmatrix.x4: the row within a 16-row slab and which 8-column half.
    const int a_lr = kATrans ? (lane >> 4) * 8 + (lane & 7) : (lane & 15);
    const int a_lc = kATrans ? ((lane >> 3) & 1) : (lane >> 4);
    const int b_lr = kBTrans ? ((lane >> 3) & 1) * 8 + (lane & 7) : (lane >> 4) * 8 + (lane & 7);
    const int b_lc = kBTrans ? (lane >> 4) : ((lane >> 3) & 1);
    // Folded warp offsets: rows of a non-transposed operand, columns of a transposed one.
    const int a_row_w = kATrans ? 0 : a_m0, a_col_w = kATrans && kAFold ? a_m0 : 0;
    const int b_row_w = kBTrans ? 0 : b_n0, b_col_w = kBTrans && kBFold ? b_n0 : 0;
    a_off = 2u * TileA::offset(a_lr + a_row_w, a_lc * 8 + a_col_w);
    b_off = 2u * TileB::offset(b_lr + b_row_w, b_lc * 8 + b_col_w);
    a_col_rt = kATrans && !kAFold ? a_m0 : 0;
    b_col_rt = kBTrans && !kBFold ? b_n0 : 0;
  }
  template <class T>
  __device__ __forceinline__ static std::uint32_t addr(std::uint32_t lane_addr, int row0, int col0) {
    return (lane_addr ^ (2u * (col0 % T::kBlockCols))) +
           2u * ((col0 / T::kBlockCols) * (T::kRows * T::kBlockCols) + row0 * T::kBlockCols);
  }
  // A fragments of k-step kk (all m16 tiles), B fragments of (kk, n16 pair np).
  __device__ __forceinline__ void load_a(std::uint32_t a_lane, int kk, std::uint32_t (&a)[kM / 16][4]) const {
#pragma unroll
    for (int mt = 0; mt < kM / 16; ++mt) {
      if constexpr (!kATrans) {
        ldmatrix_x4(addr<TileA>(a_lane, mt * 16, kk * 16), a[mt]);
      } else {
        ldmatrix_x4_trans(addr<TileA>(a_lane, kk * 16, a_col_rt + mt * 16), a[mt]);
      }
    }
  }
  __device__ __forceinline__ void load_b(std::uint32_t b_lane, int kk, int np, std::uint32_t (&bf)[4]) const {
    if constexpr (!kBTrans) {
      ldmatrix_x4(addr<TileB>(b_lane, np * 16, kk * 16), bf);
    } else {
      ldmatrix_x4_trans(addr<TileB>(b_lane, kk * 16, b_col_rt + np * 16), bf);
    }
  }
};

template <typename Element, int kM, int kN>
__device__ __forceinline__ void mma_row_pair(float (&acc)[kM / 16][kN / 8][4], int np,
                                             const std::uint32_t (&a)[kM / 16][4], const std::uint32_t (&bf)[4]) {
#pragma unroll
  for (int mt = 0; mt < kM / 16; ++mt) {
    mma_m16n8k16<Element>(acc[mt][2 * np], a[mt], bf[0], bf[1]);
    mma_m16n8k16<Element>(acc[mt][2 * np + 1], a[mt], bf[2], bf[3]);
  }
}

// acc[kM x kN] += A[kM x kK] * B[kK x kN] for one warp, operands in swizzled shared tiles.
//   A: kATrans = false: stored [m][k] (TileA rows = m); true: stored [k][m] (ldmatrix.trans).
//   B: kBTrans = false: stored [n][k] (TileB rows = n); true: stored [k][n] (ldmatrix.trans).
// a_m0 / b_n0 (multiples of kM / kN) select the warp's rows of A / columns of B; k runs
// 0..kK. Warp offsets along rows (and power-of-two column offsets) go into the lane base
// once, so each ldmatrix costs one XOR and an immediate. kPrefetch: the fragments are
// double-buffered over the flattened (kk, np) steps, as in the forward (the ldmatrix of
// step + 1, at a k-step's last step also the next k-step's A, issued before the MMAs of
// step); else each k-step loads its A, each step its B, just before their MMAs.
template <typename Element, int kM, int kN, int kK, bool kATrans, bool kBTrans, class TileA,
          class TileB, bool kPrefetch>
__device__ __forceinline__ void warp_gemm(float (&acc)[kM / 16][kN / 8][4], std::uint32_t a_base,
                                          int a_m0, std::uint32_t b_base, int b_n0, int lane) {
  static_assert(kM % 16 == 0 && kN % 16 == 0 && kK % 16 == 0, "warp_gemm: tile shape");
  const WarpGemmLanes<kM, kN, kATrans, kBTrans, TileA, TileB> g(a_m0, b_n0, lane);
  const std::uint32_t a_lane = a_base + g.a_off, b_lane = b_base + g.b_off;
  constexpr int kNP = kN / 16, kSteps = (kK / 16) * kNP;
  if constexpr (kPrefetch) {
    std::uint32_t a[2][kM / 16][4], bf[2][4];
    g.load_a(a_lane, 0, a[0]);
    g.load_b(b_lane, 0, 0, bf[0]);
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kNP; ++np) {
        const int step = kk * kNP + np;
        if (step + 1 < kSteps) {
          if (np + 1 == kNP) g.load_a(a_lane, kk + 1, a[(kk + 1) & 1]);
          g.load_b(b_lane, (step + 1) / kNP, (step + 1) % kNP, bf[(step + 1) & 1]);
        }
        mma_row_pair<Element, kM, kN>(acc, np, a[kk & 1], bf[step & 1]);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
      std::uint32_t a[kM / 16][4];
      g.load_a(a_lane, kk, a);
#pragma unroll
      for (int np = 0; np < kNP; ++np) {
        std::uint32_t bf[4];
        g.load_b(b_lane, kk, np, bf);
        mma_row_pair<Element, kM, kN>(acc, np, a, bf);
      }
    }
  }
}

template <int kM, int kN>
__device__ __forceinline__ void zero_acc(float (&acc)[kM][kN][4]) {
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}

}  // namespace flashattn::detail::cuda::sm80
