// The sm80 backward's configuration table: BwdTileConfig (per head-dim bucket and
// shared-memory limit: query / key tile, warp layouts of the S / dP, dK / dV and dQ
// products, pipeline stages, shared-memory bytes, with static_asserts on the shared-memory
// and register budgets), the warp groups of the named barriers between the P / dS stores
// and their readers (bwd_key_group*, bwd_named_barriers) and the bar.sync wrappers they
// use. Used by bwd_kernel.cuh (the main kernel) and bwd_run.cuh (its launch).
#pragma once

#include <cstdint>
#include <utility>

#include "cuda/collective/smem_layout.cuh"
#include "cuda/sm80/bwd_launch.hpp"

namespace flashattn::detail::cuda::sm80 {

// Tile shapes of the backward per head-dim bucket (8 warps always).
//   d <= 64: BM 128 x BN 128;  d <= 128: BM 64 x BN 128;  d > 128: BM 64 x BN 64, and
//   d = 256 on sm90: BM 128 x BN 64 (kTall: one Q / dO stage, dQ in two 64-row passes).
// Per-thread fp32 accumulators: dK + dV = 2 * BN * d / 256, S + dP = 2 * BM * BN / 256,
// dQ = (rows of a dQ pass) * d / 256 (live only after S/dP are consumed), at most ~224.
// d <= 64 takes 128 query rows: with 64 its pair did half the d = 128 pair's products
// for the same fixed cost (two barriers, lse / D, loop head, atomics); 128 x 128 brings
// its accumulators (S + dP 128, dK + dV 64) to the d = 128 footprint. The workspace stays
// in 64-row tiles (kBwdBlockM), so a 128-row query tile covers two of them.
// Opt-in shared memory per block: sm80's 163 KiB (the default build target) and sm90's
// 227 KiB, which gives the d = 224 bucket a second Q / dO stage and d = 256 its tall tile;
// sm86 / sm89's 99 KiB, where every bucket takes 64 query rows and the buckets above
// d = 64 64 keys (d <= 160 fit; d >= 192 do not: their K / V and one Q / dO stage alone
// need 112.5 KiB at 64 x 64, so those GPUs have no backward above d = 160).
//
// The 512 bucket (kWide: d or d_v in 264 .. 512; the forward's wide bucket, tile_size.hpp)
// keeps every column of dK, dV and dQ in one block (no slices over the grid, so nothing is
// recomputed): a 16-bit row of 512 columns is 1 KiB, and K, V, Q and dO must all be in
// shared memory, so the tiles are 32 keys by 64 query rows on sm90 (K + V 64 KiB, one Q / dO
// stage 128 KiB: 216.5 KiB with P / dS and the split-k buffer below) and by 32 query rows
// within sm80's 163 KiB (140.25 KiB; no 99 KiB tile: K, V and one 32-row Q / dO stage alone
// are 128 KiB). dK + dV of 32 keys x 512 columns are the d = 256 tall tile's 128 fp32 per
// thread (each warp one [32 x 128] part of one product). S and dP [BM x 32] over k = 512 are
// split over the head dim (kSdpSplitK): warps w and w + 4 compute the same S / dP warp tile
// over columns [0, 256) and [256, 512); the upper warp hands its fp32 partials to the lower
// one through shared memory (a named barrier per pair), which alone computes P and dS. dQ
// [BM x 512] runs in column passes of kDqCols (32 x 32 warp tiles, 32 fp32 each).
inline constexpr int kSm86SmemLimit = 99 * 1024;
inline constexpr int kSm80SmemLimit = 163 * 1024;
inline constexpr int kSm90SmemLimit = 227 * 1024;

template <int kHeadDim_, int kSmemLimit_ = kSm80SmemLimit>
struct BwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kSmemLimit = kSmemLimit_;
  // kTall: 128 query rows also above d = 64, where sm90's shared memory holds a 128-row Q / dO
  // stage (one stage; dQ in two 64-row passes). S / dP then run on 32 x 32 warp tiles
  // (4 ldmatrix per 8 mma instead of 3 per 4 on 32 x 16) and the per-pair fixed costs
  // (barriers, loop head, lse / D) are paid once per 128 rows. Measured on the H200 at
  // d = 256 against 64 x 64 with two stages, same run: +7.6% (non-causal 512) to +12.9%
  // (16k, 245.8 -> 277.6 TFLOP/s), causal +10-11% from 2k, equal at causal 512; at
  // d = 160 / 192 (4k) +15% / +11-13%. Not d = 224: there it spills 184 B and measured as
  // its 64-row kernel, while the d = 256 tall kernel runs d = 224 1.20-1.25x faster (the
  // dispatch sends it there, bwd_main_runs_tall).
  // kWide: the 512 bucket (above).
  static constexpr bool kWide = kHeadDim > 256;
  static constexpr bool kTall = !kWide && kHeadDim > 128 && kHeadDim != 224 && kSmemLimit >= kSm90SmemLimit;
  // kSmall: a 99 KiB part (sm86 / sm89): 64 query rows always, 128 keys only up to d = 64.
  static constexpr bool kSmall = kSmemLimit < kSm80SmemLimit;
  static constexpr int kBlockM = kWide ? (kSmemLimit >= kSm90SmemLimit ? kBwdBlockM : kBwdBlockM / 2)
                                 : (kHeadDim <= 64 && !kSmall) || kTall ? 2 * kBwdBlockM
                                                                         : kBwdBlockM;
  static constexpr int kBlockN = kWide ? 32 : kHeadDim <= (kSmall ? 64 : 128) ? 128 : 64;
  static constexpr int kWorkspaceTilesPerM = kBlockM / kBwdBlockM;  // dq_accum tiles per Q tile
  // kHalfTiles: a query tile is half a dq_accum tile (the wide bucket within sm80's shared
  // memory): the deterministic mode's counter of a 64-row workspace tile then orders a key
  // tile's visits of both halves together (bwd_kernel.cuh).
  static constexpr bool kHalfTiles = kBlockM < kBwdBlockM;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  // S and dP over the head dim in kSdpSplitK parts, each on kSdpWarps warps (kWide: 2).
  static constexpr int kSdpSplitK = kWide ? 2 : 1;
  static constexpr int kSdpWarps = kNWarps / kSdpSplitK;
  static constexpr int kSdpK = kHeadDim / kSdpSplitK;  // head-dim columns of one part
  // S and dP [kBlockM x kBlockN]: 2 (rows) x 4 (keys) warps. (For 128 rows, 4 x 2 warps
  // spilled 76 bytes at d = 64 where 2 x 4 spills nothing; ptxas, sm_90.) kWide: 2 x 2 warps
  // per part, [32 x 16] (64 rows) or [16 x 16] (32 rows) warp tiles.
  static constexpr int kWarpsNsdp = kTall || kWide ? 2 : 4;
  static constexpr int kWarpMsdp = kBlockM / (kSdpWarps / kWarpsNsdp);  // 32 or 64 query rows
  static constexpr int kWarpNsdp = kBlockN / kWarpsNsdp;                // 32 or 16 keys
  // dK / dV [kBlockN x kHeadDim] and dQ [kBlockM x kHeadDim]: (8 / kWarpsD) row groups x
  // kWarpsD head-dim parts. Rows or keys of a 64-wide tile split 4 ways would give
  // 16-row warp tiles that reload their B fragments (the wide side) for a single m16 tile:
  // at 64 x 256 a 16 x 128 tile needs 9 ldmatrix per 8 mma, a 32 x 64 tile 6. So a
  // 64-wide side is split 2 ways and the head dim 4 ways where d / 4 is a whole n16 pair
  // (d % 64 == 0); other buckets keep 2 head-dim halves.
  // kSplitDkDv: warps [0, kNWarps / 2) accumulate dV, the others dK, each product tiled
  // over half the warps. A warp then holds one [BN x d] part twice the size instead of two
  // parts of both (the same accumulators), and its operands are reloaded half as often:
  // the dV / dK phase reads (M_w + N_w) * BM * 2 bytes per warp once instead of twice for
  // a tile half as wide (d = 64: 192 instead of 256 KiB per pair, d = 128 and d = 256 tall:
  // 64 x 64 warp tiles, 128 instead of 192 / 256 instead of 384 KiB). Not the sm80-sized
  // tiles above d = 128 (their named key-group barriers assume both products per warp).
  static constexpr bool kSplitDkDv = kHeadDim <= 128 || kTall || kWide;
  static constexpr int kKvWarps = kSplitDkDv ? kNWarps / 2 : kNWarps;  // warps per product
  // Head-dim parts of a split product: of 1, 2, 4 the one with whole n16 / m16 warp tiles
  // and the least operand traffic (M_w + N_w), the narrower key slice on a tie.
  static constexpr int split_dkdv_parts() {
    int best = 0, best_cost = 1 << 30;
    for (int wd = 1; wd <= kKvWarps; wd *= 2) {
      const int wn = kKvWarps / wd;
      if (kBlockN % wn != 0 || kHeadDim % wd != 0) continue;
      const int mw = kBlockN / wn, nw = kHeadDim / wd;
      if (mw % 16 != 0 || nw % 16 != 0) continue;
      if (mw + nw < best_cost) best = wd, best_cost = mw + nw;
    }
    return best;
  }
  static constexpr int kWarpsDdkv =
      kSplitDkDv ? split_dkdv_parts() : (kBlockN == 64 && kHeadDim % 64 == 0 ? 4 : 2);
  static constexpr int kWarpNdkv = kBlockN / (kKvWarps / kWarpsDdkv);  // keys per warp
  static constexpr int kWarpDdkv = kHeadDim / kWarpsDdkv;
  // A dQ warp's 16 or 32 rows lie in one 64-row workspace tile. (d = 128 takes 32 x 32
  // since the interval mask freed registers; before it, 32 x 32 spilled 100 B / 232 B.)
  // dQ runs in passes of kDqRows query rows (each its own accumulators) where the whole
  // tile's would not fit beside dK / dV.
  // kWide: passes of kDqCols head-dim columns instead (kDqColPasses), 32 x 32 warp tiles.
  static constexpr int kDqRows = kTall ? kBwdBlockM : kBlockM;
  static constexpr int kDqPasses = kBlockM / kDqRows;
  static constexpr int kDqCols = kWide ? kBlockM == 64 ? 128 : 256 : kHeadDim;
  static constexpr int kDqColPasses = kHeadDim / kDqCols;
  static constexpr int kWarpsDdq = kWide ? kDqCols / 32 : kDqRows == 64 && kHeadDim % 64 == 0 ? 4 : 2;
  static constexpr int kWarpMdq = kDqRows / (kNWarps / kWarpsDdq);  // 32 or 16 rows
  static constexpr int kWarpDdq = kDqCols / kWarpsDdq;
  // Named barriers after the P / dS stores (bwd_named_barriers) renumber the dK / dV warps;
  // at d = 128 and 224 ptxas then spills (sm_90 bf16: 24 B st / 40 B ld against none at
  // d = 128, 204 B against 8 B in the one-stage d = 224 kernel), so those keep one
  // __syncthreads. At d = 64 one __syncthreads also measured faster than the named
  // barriers (H200, same run: +2.5-3% at 2k-16k) and at d = 256 slower (-2 to -2.5%), so
  // only the buckets above 128 keep them.
  static constexpr bool kNamedBarriersFit = kHeadDim > 128 && kHeadDim != 224;
  // warp_gemm's fragment double-buffering: measured on the H200 (same run) +1.4-3.6% at
  // d = 64 (16k non-causal 270.7 -> 280.5 TFLOP/s) and -0.5 to -1% at d = 128 / 256, so
  // only the 128-row buckets (d <= 64) take it.
  static constexpr bool kPrefetch = kHeadDim <= 64;

  using TileQ = SwizzledTile<kBlockM, kHeadDim>;  // Q and dO, [BM, d]
  using TileK = SwizzledTile<kBlockN, kHeadDim>;  // K and V, [BN, d]
  using TileP = SwizzledTile<kBlockM, kBlockN>;   // P and dS, [BM, BN]
  static constexpr int kSmemKV = 2 * TileK::kBytes;
  static constexpr int kSmemPdS = 2 * TileP::kBytes;
  // A stage: Q, dO, and the tile's lse and D rows (fp32).
  static constexpr int kSmemQdOStage = 2 * TileQ::kBytes + 2 * kBlockM * 4;
  // The split-k partials of S and dP (fp32, [BM x BN] each), after the stages.
  static constexpr int kSmemSdpPartials = kSdpSplitK > 1 ? 2 * kBlockM * kBlockN * 4 : 0;
  // Two Q/dO stages (prefetch the next pair during this one) when they fit in
  // kSmemLimit; otherwise one, refilled as soon as dK's product has consumed it.
  static constexpr int kStages =
      kSmemKV + kSmemPdS + 2 * kSmemQdOStage + kSmemSdpPartials <= kSmemLimit ? 2 : 1;
  static constexpr int kSmemBytes = kSmemKV + kSmemPdS + kStages * kSmemQdOStage + kSmemSdpPartials;
  // Whether the bucket has a configuration within kSmemLimit (only the 99 KiB tiles of
  // d >= 192 do not: run_bwd_main declines those calls, and never instantiates them).
  static constexpr bool kFits = kSmemBytes <= kSmemLimit;

  static_assert(kHeadDim % 32 == 0 && (kHeadDim <= 256 || kHeadDim == 512), "BwdTileConfig: head-dim bucket");
  static_assert(kWarpNsdp % 16 == 0 && kWarpDdkv % 16 == 0 && kWarpDdq % 16 == 0 &&
                    kWarpNdkv % 16 == 0 && kWarpMdq % 16 == 0 && kWarpMsdp % 16 == 0,
                "BwdTileConfig: warp tiles must be whole m16 / n16 pairs");
  static_assert((kBlockM % kBwdBlockM == 0 || (kHalfTiles && 2 * kBlockM == kBwdBlockM)) &&
                    kBwdBlockM % kWarpMdq == 0,
                "BwdTileConfig: a query tile is whole workspace tiles (or half of one), a dQ warp tile in one");
  static_assert(kHeadDim % kDqCols == 0 && kDqCols % kWarpsDdq == 0 && kSdpWarps % kWarpsNsdp == 0 &&
                    (kSdpSplitK == 1 || (kSdpK % TileQ::kBlockCols == 0 && kSdpK % TileK::kBlockCols == 0)),
                "BwdTileConfig: dQ column passes and S / dP head-dim parts of whole warp tiles / tile blocks");
  static_assert(kFits || kSmall, "BwdTileConfig: shared memory beyond the limit");
  static_assert(kWarpsDdkv > 0, "BwdTileConfig: no whole-tile split of the dK / dV products");
  static_assert(2 * kBlockN * kHeadDim / kNThreads + 2 * kBlockM * kBlockN / kNThreads <= 192,
                "BwdTileConfig: accumulators would not fit in registers");
};

// The shared memory per block the bucket's smallest configuration needs (the 99 KiB one
// where it fits, else sm80's): the backward declines a call whose limit is below it
// before it launches anything (sm80::backward, through bwd_smem_need).
template <int kHeadDim>
inline constexpr int kBwdSmemNeed = BwdTileConfig<kHeadDim, kSm86SmemLimit>::kFits
                                        ? BwdTileConfig<kHeadDim, kSm86SmemLimit>::kSmemBytes
                                        : BwdTileConfig<kHeadDim>::kSmemBytes;

// Named barriers between the P / dS stores and their readers. S / dP warp
// w = wm * kWarpsNsdp + wn writes P / dS rows wm, keys wn (kWarpNsdp wide). dV / dK warps
// are numbered so that warp w works on the key slice that contains its own S / dP keys
// ("key group" wn / r, r = kWarpNdkv / kWarpNsdp), head-dim part wm * r + wn % r: the
// warps of a key group are then exactly the writers and the readers of that slice of P /
// dS. dQ warp w reads its rows over all keys, written by the kWarpsNsdp warps of its S /
// dP row slab, which are also the dQ warps of those rows ("row group"). Each group syncs
// itself (2 or 4 warps) instead of one barrier of all 8, so a warp waits for the warps
// whose data it reads, not for the slowest of 8. The top-of-pair __syncthreads still
// orders every warp past the previous pair (P / dS and the Q / dO stage are free).
// Barrier 0 is __syncthreads; key groups take 1.., row groups follow.
template <class Cfg>
constexpr int bwd_key_group(int w) {
  return (w % Cfg::kWarpsNsdp) / (Cfg::kWarpNdkv / Cfg::kWarpNsdp);
}
template <class Cfg>
constexpr int bwd_key_group_part(int w) {
  constexpr int r = Cfg::kWarpNdkv / Cfg::kWarpNsdp;
  return (w / Cfg::kWarpsNsdp) * r + (w % Cfg::kWarpsNsdp) % r;
}
template <class Cfg>
constexpr bool bwd_named_barriers() {
  // S / dP key slices nest in dK / dV key slices, one key group per dK / dV key slice
  // holding kWarpsDdkv warps, and every dQ warp's rows in its own S / dP slab.
  // (if constexpr: a tile whose dK / dV key slice is narrower than its S / dP one, as the
  // tall d = 160 tile's, never instantiates the divisions by r = 0.)
  if constexpr (Cfg::kSplitDkDv || Cfg::kWarpNdkv < Cfg::kWarpNsdp ||
                Cfg::kWarpNdkv % Cfg::kWarpNsdp != 0 || Cfg::kDqPasses != 1) {
    return false;
  } else {
    constexpr int r = Cfg::kWarpNdkv / Cfg::kWarpNsdp;
    if ((Cfg::kNWarps / Cfg::kWarpsNsdp) * r != Cfg::kWarpsDdkv) return false;
    for (int w = 0; w < Cfg::kNWarps; ++w)
      if ((w / Cfg::kWarpsDdq) * Cfg::kWarpMdq / Cfg::kWarpMsdp != w / Cfg::kWarpsNsdp) return false;
    return Cfg::kNamedBarriersFit &&
           1 + Cfg::kNWarps / Cfg::kWarpsDdkv + Cfg::kNWarps / Cfg::kWarpsNsdp <= 16;
  }
}

template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
// bar.sync (kFirstId + group), warp-uniform group < sizeof...(kGroups), with immediate
// operands: a register id would hold one more register across the loop.
template <int kFirstId, int kThreads, int... kGroups>
__device__ __forceinline__ void named_barrier_sync_group(int group,
                                                         std::integer_sequence<int, kGroups...>) {
  ((group == kGroups ? named_barrier_sync<kFirstId + kGroups, kThreads>() : void()), ...);
}

}  // namespace flashattn::detail::cuda::sm80
