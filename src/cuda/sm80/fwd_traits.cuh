// The sm80 forward's compile-time configuration: FwdTileKind (which of a head-dim bucket's
// tiles, tile_size.hpp) and FwdTraits (block shape, warps, pipeline stages, per-warp MMA
// tiles, shared-memory tiles and bytes of one instantiation). Used by fwd_kernel.cuh (the
// kernel) and fwd_run.cuh (its launch and the tile choice of run_fwd); the static_asserts
// check the tile against tile_size.hpp's shared-memory formula.
#pragma once

#include <type_traits>

#include "cuda/collective/smem_layout.cuh"
#include "cuda/sm80/tile_size.hpp"

namespace flashattn::detail::cuda::sm80 {

// The bucket's tiles (tile_size.hpp): kBase fwd_tile, where its shared memory fits (sm80 and
// sm90); kLarge fwd_tile_large and kStaggered fwd_tile_staggered, for GPUs with the shared
// memory for them (sm90); kSmall fwd_tile_small, for 99 KiB GPUs (sm86, sm89).
enum FwdTileKind : int { kFwdBase = 0, kFwdLarge = 1, kFwdStaggered = 2, kFwdSmall = 3 };

template <int kHeadDim_, typename Element_, int kKind = kFwdBase>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr FwdTile kTile = kKind == kFwdStaggered ? fwd_tile_staggered(kHeadDim)
                                   : kKind == kFwdLarge   ? fwd_tile_large(kHeadDim)
                                   : kKind == kFwdSmall   ? fwd_tile_small(kHeadDim)
                                                          : fwd_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kStages = kTile.stages;
  // One K and one V buffer, staggered (FwdTile::stages == 1): V_j is copied while S_j runs,
  // K_{j+1} while O += P V_j runs, so Q + K + V is all the shared memory a block needs.
  static constexpr bool kStaggered = kStages == 1;
  static constexpr int kThreads = 32 * kWarps;
  // V and O columns of one block (tile_size.hpp's fwd_v_cols): kHeadDim, or in the 512 bucket
  // a slice of 256 of d_v's columns (kVSliced), the slices spread over grid x.
  static constexpr int kVCols = fwd_v_cols(kHeadDim);
  static constexpr bool kVSliced = kVCols < kHeadDim;
  static constexpr int kMTiles = kBlockM / (16 * kWarps);  // 16-row tiles per warp
  static constexpr int kNTiles = kBlockN / 8;              // 8-key tiles of S per warp row tile
  static constexpr int kOTiles = kVCols / 8;               // 8-dim tiles of O
  // The lazy O rescale (OnlineSoftmax::update_lazy) saves kMTiles * kOTiles * 4 FMULs per
  // tile but costs ~45 instructions of address rematerialisation around its branch
  // (SASS, sm_90): worth it where the rescale is at least one FMUL per MMA of the tile
  // (hdim 128: 128 vs 128, 578 -> ~533 instructions; hdim 64: 64 vs 128, 643 -> ~668).
  static constexpr int kTileMmas = kMTiles * (kNTiles * kHeadDim / 16 + kOTiles * kBlockN / 16);
  static constexpr bool kLazyRescale = kMTiles * kOTiles * 4 >= kTileMmas;
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  using KTile = SwizzledTile<kBlockN, kHeadDim>;
  using VTile = SwizzledTile<kBlockN, kVCols>;
  // A stage: its K tile, then its V tile.
  static constexpr int kStageBytes = KTile::kBytes + VTile::kBytes;
  static constexpr int kSmemBytes = QTile::kBytes + kStages * kStageBytes;
  static_assert(is_head_dim_bucket(kHeadDim) && fwd_tile_valid(kHeadDim));
  static_assert(kSmemBytes == fwd_smem_bytes(kTile, kHeadDim));
};

}  // namespace flashattn::detail::cuda::sm80
