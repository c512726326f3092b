// Dropout on an m16n8 probability tile with the keep rule of semantics::DropoutRng.
// One Philox call yields the four words of the four elements a thread holds in one
// 16x8 accumulator tile: rows i and i + 8 (i % 16 < 8) and columns j and j + 1 (j even),
// in accumulator order c0 (i, j), c1 (i, j+1), c2 (i+8, j), c3 (i+8, j+1) -- exactly
// DropoutRng::word's order -- so the decisions match the CPU backend bit for bit.
#pragma once

#include <cstdint>

#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda {

// Zeroes the dropped elements of p[kMTiles][kNTiles][4]. row0: the sequence row of
// element c0 of m-tile 0 (m-tile mt adds 16 mt); col0: the sequence column of c0 of
// n-tile 0 (n-tile nt adds 8 nt). The 1 / (1 - p) scale is applied in the epilogue.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_dropout(float (&p)[kMTiles][kNTiles][4],
                                              const semantics::DropoutRng& rng, std::uint32_t bh,
                                              int row0, int col0) {
  static_assert(kNTiles <= 16, "apply_dropout: at most 64 keep bits per m-tile");
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    // The Philox calls run as a rolled loop collecting keep bits, so the 10 rounds do not
    // multiply the register pressure of the main loop; the bits are applied unrolled.
    std::uint64_t keep = 0;
#pragma unroll 1
    for (int nt = 0; nt < kNTiles; ++nt) {
      const semantics::Philox4 r = rng.block(bh, row0 + 16 * mt, col0 + 8 * nt);
      const std::uint64_t bits = std::uint64_t(r.x[0] >= rng.threshold) |
                                 (std::uint64_t(r.x[1] >= rng.threshold) << 1) |
                                 (std::uint64_t(r.x[2] >= rng.threshold) << 2) |
                                 (std::uint64_t(r.x[3] >= rng.threshold) << 3);
      keep |= bits << (4 * nt);
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (((keep >> (4 * nt + e)) & 1u) == 0) p[mt][nt][e] = 0.0f;
      }
  }
}

}  // namespace flashattn::detail::cuda
