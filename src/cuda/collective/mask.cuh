// The visibility rule of semantics.hpp applied to register tiles: which elements of a
// (query tile, key tile) pair are visible, and which key tiles need per-element masking
// at all. Rows and columns are sequence-local indices.
#pragma once

#include <cstdint>

#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda {

struct TileMask {
  int s_q = 0, s_k = 0;
  int left = -1, right = -1;  // semantics::Mask; -1 unbounded

  __device__ __forceinline__ TileMask(int sq, int sk, semantics::Mask m)
      : s_q(sq), s_k(sk), left(m.left), right(m.right) {}

  // key_visible(i, j) of semantics.hpp for 0 <= j (the kernels never form j < 0).
  __device__ __forceinline__ bool visible(int i, int j) const {
    const int diag = i + s_k - s_q;
    return j < s_k && (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
  }

  // The visible keys of row i as the half-open column range [lo, hi) (empty when lo >= hi):
  // one pair of compares per element instead of the three tests of visible().
  __device__ __forceinline__ void row_range(int i, int& lo, int& hi) const {
    const int diag = i + s_k - s_q;
    lo = left >= 0 ? diag - left : 0;
    hi = right >= 0 ? min(diag + right + 1, s_k) : s_k;
  }

  // Whether some row of [i0, i1) sees a key of [n0, n1). Both ends of a row's visible
  // range move right with i, so the rows' union lies within [lo(i0), hi(i1 - 1)): false
  // means no row sees any of the keys (true may over-report for narrow windows).
  __device__ __forceinline__ bool rows_see_keys(int i0, int i1, int n0, int n1) const {
    if (i0 >= i1) return false;
    int lo0, hi0, lo1, hi1;
    row_range(i0, lo0, hi0);
    row_range(i1 - 1, lo1, hi1);
    return lo0 < n1 && hi1 > n0 && lo0 < hi1;
  }

  // Whether the key tile [n0, n0 + block_n) needs element masking for some query row of
  // [m0, m0 + block_m): it crosses the end of the keys or one of the window edges.
  __device__ __forceinline__ bool tile_needs_mask(int m0, int block_m, int n0, int block_n) const {
    const int shift = s_k - s_q;
    if (n0 + block_n > s_k) return true;
    if (right >= 0 && n0 + block_n - 1 > m0 + shift + right) return true;
    if (left >= 0 && n0 < m0 + block_m - 1 + shift - left) return true;
    return false;
  }
};

}  // namespace flashattn::detail::cuda
