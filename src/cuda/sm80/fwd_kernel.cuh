// The sm80 fused attention forward (FlashAttention-2 style), one thread block per
// (query tile, query head, sequence):
//
//   Q tile [kBlockM x kHeadDim] -> shared memory once; each warp owns kMTiles 16-row tiles.
//   K tiles [kBlockN x kHeadDim], V tiles [kBlockN x kVCols] stream through a kStages-deep
//   cp.async ring (or one staggered K and V buffer).
//   S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k16, fp32 accumulate);
//   K fragments by ldmatrix, V fragments by ldmatrix.trans, P stays in registers and is
//   repacked as the A operand of P V.
//   Online softmax in registers (exp2 with scale * log2(e) folded in, quad shuffles).
//   Masks only on the key tiles that cross a bound; the key loop runs only over the
//   tiles some row of the query tile can see.
//   O and lse written once at the end, O through shared memory as 16-byte stores.
//   The 512 bucket (Tr::kVSliced): each block computes the scores over all of d but only a
//   256-column slice of O = P V (V's columns v_col0 ..), the slices of one query tile and head
//   in neighbouring blocks of grid x (their Q and K reads meet in L2); slice 0 writes lse.
//
// Everything that does not change a tile shape (masks, softcap, ALiBi, dropout, GQA,
// varlen, KV cache, paged KV) is a uniform run-time branch.
//
// The global addressing and the K/V tile loaders are a fragment of the kernel's text,
// fwd_kernel_loaders.inc, included in place; the host side (launch_fwd, run_fwd's tile
// choice) is fwd_run.cuh, which the generated translation units include.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/params.hpp"
#include "cuda/collective/dropout.cuh"
#include "cuda/collective/mask.cuh"
#include "cuda/arch/sm80.cuh"
#include "cuda/collective/online_softmax.cuh"
#include "cuda/collective/smem_layout.cuh"
#include "cuda/collective/tile_copy.cuh"
#include "cuda/sm80/tile_size.hpp"
#include "cuda/sm80/fwd_traits.cuh"

namespace flashattn::detail::cuda::sm80 {

// Which halves of a key tile a copy issues (fwd_kernel's loaders).
inline constexpr int kLoadK = 1, kLoadV = 2, kLoadKV = 3;

// The compile-time copies of the key-tile step (see key_tile in fwd_kernel).
enum class FwdMode { kGeneral, kPlainMasked, kPlainInterior };
template <FwdMode kMode>
using FwdModeTag = std::integral_constant<FwdMode, kMode>;

// The launch order (fwd_kernel: grid (query tile, head, sequence) or tile major): tile
// major where a mask bounds the keys a tile sees.
__host__ __device__ inline bool fwd_tile_major(const FwdParams& p) { return !p.mask.unbounded(); }

// kSparse: the instantiation for block-sparse masks (p.block_kinds), apart so that the
// others keep their registers (with the block-sparse code in every kernel ptxas spilled 100 B more at
// d = 128 and up to 228 B at d = 256, sm_90).
template <int kHeadDim, typename Element, int kKind, bool kSparse = false>
__global__ void __launch_bounds__(FwdTraits<kHeadDim, Element, kKind>::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams p) {
  using Tr = FwdTraits<kHeadDim, Element, kKind>;
  using QTile = typename Tr::QTile;
  using KTile = typename Tr::KTile;
  using VTile = typename Tr::VTile;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStages = Tr::kStages;
  constexpr int kMTiles = Tr::kMTiles, kNTiles = Tr::kNTiles, kOTiles = Tr::kOTiles;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* const sQ = reinterpret_cast<Element*>(smem_raw);
  Element* const sKV = sQ + QTile::kElements;  // stage s at s * kStageBytes: K, then V

  // Heavier query tiles (more keys under causal masks) are launched first. Without a
  // mask every tile costs the same and the grid is (query tile, head, sequence): the
  // blocks go head by head and the query tiles of a head share its K/V in L2. With causal
  // / window masks the tiles' costs differ and the grid is (head, sequence, query tile)
  // (launch_fwd): the heaviest query tile of every head first, the lightest last, so the
  // last blocks to start are the shortest (with one block of a 128-row tile per SM, a
  // heavy tile started last would run alone at the end).
  // Sliced V (Tr::kVSliced): grid x holds `slices` blocks per query tile (or head), x * slices +
  // slice; a block computes V's and O's columns [v_col0, v_col0 + kVCols), p.d_v - v_col0 of
  // them real (the rest zero-filled, not stored).
  const bool tile_major = fwd_tile_major(p);
  const unsigned slices = Tr::kVSliced ? (p.d_v + Tr::kVCols - 1) / Tr::kVCols : 1;
  const int m_block = static_cast<int>(tile_major ? gridDim.z - 1 - blockIdx.z
                                                  : gridDim.x / slices - 1 - blockIdx.x / slices);
  const int h = tile_major ? blockIdx.x / slices : blockIdx.y;
  // (read again at each use: a register held from here to the epilogue spilled, sm_90)
  auto v_col0 = [&] { return static_cast<int>(blockIdx.x % slices) * Tr::kVCols; };
  const int b = tile_major ? blockIdx.y : blockIdx.z;
  const int s_q = p.seq_len_q(b);
  const int m0 = m_block * kBlockM;
  if (m0 >= s_q) return;
  const int s_k = p.seq_len_k(b);
  const int g = h / p.h_ratio;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp_row0 = (tid >> 5) * kMTiles * 16;  // first tile row this warp owns
  const int rows_here = min(kBlockM, s_q - m0);

  const TileMask mask(s_q, s_k, p.mask);
  int tile_begin = 0, tile_end = 0;  // key tiles [tile_begin, tile_end) seen by some row
  // Block-sparse: this query tile lies in one row of mask blocks and each key tile in one
  // block (the mask's blocks are multiples of the tiles, checked at launch): the key tiles
  // visited are those of the row's listed blocks (p.block_list, highest first), each
  // block's tiles from its last, below s_k. Keys of unlisted blocks are never loaded.
  constexpr bool sparse = kSparse;
  const std::int64_t bs_offset =
      !sparse ? 0
              : std::int64_t(b) * p.bs_batch_stride + std::int64_t(h) * p.bs_head_stride +
                    std::int64_t(m0 / p.bs_block_q) * p.bs_blocks_k;
  const std::uint8_t* const bs_row = sparse ? p.block_kinds + bs_offset : nullptr;
  const std::int32_t* bs_list = sparse ? p.block_list + bs_offset : nullptr;
  const int tiles_per_block = sparse ? p.bs_block_k / kBlockN : 1;
  auto sparse_kind = [&](int t) { return static_cast<int>(bs_row[t / tiles_per_block]); };
  int n_tiles = 0;
  int bs_skew = 0;  // tiles of the first visited block past s_k (its visits start there)
  if constexpr (sparse) {
    tile_end = (s_k + kBlockN - 1) / kBlockN;
    int len = p.block_list_len[bs_offset / p.bs_blocks_k];
    // Listed blocks wholly past s_k (a varlen sequence shorter than the grid's) are not
    // visited; they come first in the list.
    while (len > 0 && bs_list[0] * tiles_per_block >= tile_end) {
      ++bs_list;
      --len;
    }
    if (len > 0) {
      bs_skew = tiles_per_block - min(tiles_per_block, tile_end - bs_list[0] * tiles_per_block);
      n_tiles = len * tiles_per_block - bs_skew;
    }
  } else {
    if (s_k > 0) {
      const semantics::KeyRange keys =
          semantics::visible_keys_of_rows(m0, m0 + rows_here, s_q, s_k, p.mask);
      if (!keys.empty()) {
        tile_begin = static_cast<int>(keys.begin) / kBlockN;
        tile_end = static_cast<int>((keys.end + kBlockN - 1) / kBlockN);
      }
    }
    n_tiles = tile_end - tile_begin;
  }
  // The key tile of visit x: tile_end - 1 - x, or with a block-sparse mask the x-th
  // listed tile from the top (one load of the list, no walk).
  auto tile_of = [&](int x) {
    if constexpr (!sparse) {
      return tile_end - 1 - x;
    } else {
      const int xs = x + bs_skew;
      return bs_list[xs / tiles_per_block] * tiles_per_block + tiles_per_block - 1 - xs % tiles_per_block;
    }
  };

  // ---- global addressing and the K/V tile loaders (fwd_kernel_loaders.inc): q_rows,
  // paged, load_kv (any tile, paged too), load_kv_full (full tiles).
#include "cuda/sm80/fwd_kernel_loaders.inc"

  // ---- score mode: raw dot products with the scale folded into exp2 (the common
  // case), or explicitly scaled (softcap, ALiBi, non-positive scale) then log2(e).
  const bool has_softcap = p.softcap > 0.0f;
  const float slope = p.alibi_slope(b, h);
  const bool has_alibi = slope != 0.0f;
  const bool raw_scores = !has_softcap && !has_alibi && p.scale > 0.0f;
  const float to_log2 = raw_scores ? p.scale * kLog2e : kLog2e;
  const bool has_dropout = p.rng.threshold != 0u;
  const std::uint32_t dropout_bh = p.dropout_bh(b, h);
  const int shift = s_k - s_q;
  const bool general_path = paged || !raw_scores || has_dropout;

  OnlineSoftmax<kMTiles> softmax;
  softmax.init();
  float acc_o[kMTiles][kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][ot][e] = 0.0f;

  // ---- prologue: Q with the first key tile in one group, then kStages - 2 more tiles.
  // Key tiles are visited from the last to the first, so the tiles that cross the end
  // of the keys or the causal diagonal come first.
  // Staggered: Q and the first K, then the first V in a group of its own (the first tile
  // visited is the last key tile, which may end past s_k: bounds-checked copies, here once
  // rather than in the key loop); each later tile's V is issued at the top of its step.
  if (n_tiles > 0) {
    load_tile_strided<QTile, Tr::kThreads>(sQ, q_rows, p.q_row_stride, rows_here, p.d, p.q, tid);
    load_kv(0, tile_of(0), Tr::kStaggered ? kLoadK : kLoadKV);
    cp_async_commit();
    if constexpr (Tr::kStaggered) {
      load_kv(0, tile_of(0), kLoadV);
      cp_async_commit();
    }
#pragma unroll
    for (int s = 1; s < kStages - 1; ++s) {
      if (s < n_tiles) load_kv(s, tile_of(s), kLoadKV);
      cp_async_commit();
    }
  }

  // Per-lane ldmatrix base addresses (stage 0): Q rows as the A operand (rows lane % 16,
  // column half lane / 16), K as the non-transposed B operand (keys lane % 8 + 8 (lane / 16),
  // column half (lane / 8) % 2), V as the transposed B operand (keys lane % 16, column
  // half lane / 16).
  static_assert(KTile::kColVariants == VTile::kColVariants);  // (a sliced V: 64-column blocks, as K)
  std::uint32_t q_lane[QTile::kColVariants], k_lane0[KTile::kColVariants],
      v_lane0[VTile::kColVariants];
#pragma unroll
  for (int var = 0; var < QTile::kColVariants; ++var) {
    q_lane[var] = smem_u32(sQ) + QTile::lane_bytes(warp_row0 + (lane & 15), lane >> 4, var);
  }
#pragma unroll
  for (int var = 0; var < KTile::kColVariants; ++var) {
    k_lane0[var] = smem_u32(sKV) +
                   KTile::lane_bytes((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, var);
    v_lane0[var] =
        smem_u32(sKV + KTile::kElements) + VTile::lane_bytes(lane & 15, lane >> 4, var);
  }

  // One key tile: wait for it, refill the ring, S = Q K^T, scores, mask, online softmax,
  // dropout, O += P V. kMode picks a compile-time copy: kGeneral carries every feature as
  // a uniform run-time branch (paged loads, softcap, ALiBi, non-positive scale, dropout,
  // the per-tile mask test); the plain copies (dense loads, raw scores with the scale in
  // exp2, no dropout) either mask every element (kPlainMasked, boundary tiles) or nothing
  // (kPlainInterior), so the interior loop has no feature or mask branch at all.
  auto key_tile = [&](int it, auto mode_tag) {
    constexpr FwdMode kMode = decltype(mode_tag)::value;
    constexpr bool kGeneral = kMode == FwdMode::kGeneral;
    // Interior tiles (every one below the last) take the per-thread full-tile copy plan.
    auto issue = [&](int stage, int tile, int parts) {
      if constexpr (kGeneral && Tr::kVSliced) {
        // (the 512 bucket: its dense loads' generic per-chunk copy of a 512-column K tile
        // spilled in the general copy, ptxas sm_90; its refills are full tiles too)
        if (paged) {
          load_kv(stage, tile, parts);
        } else {
          load_kv_full(stage, tile, parts);
        }
      } else if constexpr (kGeneral) {
        load_kv(stage, tile, parts);
      } else {
        load_kv_full(stage, tile, parts);
      }
    };
    // Staggered, after the scores: V_it has landed and every warp is done with K_it, so the
    // next tile's K goes into the one K buffer while O += P V_it runs.
    auto staggered_mid = [&] {
      if constexpr (Tr::kStaggered) {
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_tiles) issue(0, tile_of(it + 1), kLoadK);
        cp_async_commit();
      }
    };
    if constexpr (Tr::kStaggered) {
      // The first V came with the prologue (its own group, still in flight here).
      if (it == 0) {
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // K_it is visible to all; every warp is done with V_{it-1}
      if (it > 0) issue(0, tile_of(it), kLoadV);
      cp_async_commit();
    } else {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile `it` is visible to all; the stage read at it - 1 is free
      const int ahead = it + kStages - 1;
      if (ahead < n_tiles) issue(ahead % kStages, tile_of(ahead), kLoadKV);
      cp_async_commit();
    }
    const int tile = tile_of(it);
    const int n0 = tile * kBlockN;
    // A warp whose rows see none of this tile's keys (its rows above the causal diagonal,
    // or past the queries' end) skips the tile: its softmax state and O are what a tile of
    // -inf scores leaves them, and the SM sub-partition's tensor cores go to the other
    // warps (warp-uniform; the tile's barrier and refill above stay shared). Plain masked
    // tiles only: in the general copy the test cost hdim 256 28 B of spills.
    if constexpr (kMode == FwdMode::kPlainMasked) {
      const int wr0 = m0 + warp_row0;
      if (!mask.rows_see_keys(wr0, min(wr0 + kMTiles * 16, s_q), n0, n0 + kBlockN)) {
        staggered_mid();  // the block's barrier and the next K's copies still need this warp
        return;
      }
    }
    const int stage = it % kStages;
    std::uint32_t k_lane[KTile::kColVariants], v_lane[VTile::kColVariants];
#pragma unroll
    for (int var = 0; var < KTile::kColVariants; ++var) {
      k_lane[var] = k_lane0[var] + stage * Tr::kStageBytes;
      v_lane[var] = v_lane0[var] + stage * Tr::kStageBytes;
    }

    // S[kMTiles][kNTiles] = Q K^T: 16 query rows x 8 keys per (mt, nt).
    float s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
    // Fragments are double-buffered in registers over the flattened (ks, np) steps: the
    // ldmatrix of step + 1 (and of the next k-step's Q rows) is issued before the MMAs of
    // step, so shared-memory latency hides behind tensor work at a cost of 8 registers
    // for K and 4 kMTiles for Q.
    constexpr int kKSteps = kHeadDim / 16;
    constexpr int kNPairs = kNTiles / 2;
    constexpr int kQKSteps = kKSteps * kNPairs;
    std::uint32_t qa[2][kMTiles][4], kb[2][4];
    auto load_q = [&](int ks, std::uint32_t(&a)[kMTiles][4]) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ldmatrix_x4(q_lane[QTile::variant(ks * 16)] + QTile::const_bytes(mt * 16, ks * 16), a[mt]);
      }
    };
    auto load_k = [&](int step, std::uint32_t(&bk)[4]) {  // n-tiles 2np, 2np + 1; k halves 0, 1
      const int ks = step / kNPairs, np = step % kNPairs;
      ldmatrix_x4(k_lane[KTile::variant(ks * 16)] + KTile::const_bytes(np * 16, ks * 16), bk);
    };
    load_q(0, qa[0]);
    load_k(0, kb[0]);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
      for (int np = 0; np < kNPairs; ++np) {
        const int step = ks * kNPairs + np;
        if (step + 1 < kQKSteps) {
          if (np + 1 == kNPairs) load_q(ks + 1, qa[(ks + 1) & 1]);
          load_k(step + 1, kb[(step + 1) & 1]);
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_m16n8k16<Element>(s[mt][2 * np], qa[ks & 1][mt], kb[step & 1][0], kb[step & 1][1]);
          mma_m16n8k16<Element>(s[mt][2 * np + 1], qa[ks & 1][mt], kb[step & 1][2],
                                kb[step & 1][3]);
        }
      }
    }

    // Scores: scale, softcap, ALiBi (semantics::score order), then the mask.
    const int row_base = m0 + warp_row0 + (lane >> 2);  // sequence row of c0 in m-tile 0
    const int col_base = n0 + (lane & 3) * 2;           // sequence column of c0 in n-tile 0
    if (kGeneral && !raw_scores) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[mt][nt][e] * p.scale;
            if (has_softcap) x = p.softcap * tanhf(x / p.softcap);
            if (has_alibi) {
              const int i = row_base + mt * 16 + (e >> 1) * 8;
              const int j = col_base + nt * 8 + (e & 1);
              x -= slope * static_cast<float>(abs(i + shift - j));
            }
            s[mt][nt][e] = x;
          }
    }
    if constexpr (kGeneral && sparse) {
      // Block-sparse: the tile's one block is full (every key below s_k) or partial (the
      // call's rule widened to the prefix keys, and-ed with equal document ids).
      const bool full = sparse_kind(tile) == semantics::kBlockFull;
      const int prefix = p.prefix_keys != nullptr ? p.prefix_keys[std::int64_t(b) * p.prefix_batch_stride] : 0;
      const bool docs = p.doc_ids_q != nullptr && !full;
      int doc_k[kNTiles][2];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = col_base + nt * 8 + e;
          doc_k[nt][e] = docs && j < s_k ? p.doc_ids_k[p.cu_seqlens_k ? p.k_start(b) + j
                                                                      : std::int64_t(b) * p.doc_k_batch_stride + j]
                                         : 0;
        }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = row_base + mt * 16 + half * 8;
          int lo = 0, hi = s_k;  // the call's visible range of row i (absolute keys)
          if (!full) mask.row_range(i, lo, hi);
          const int doc_q = docs && i < s_q ? p.doc_ids_q[p.cu_seqlens_q ? p.q_start(b) + i
                                                                        : std::int64_t(b) * p.doc_q_batch_stride + i]
                                            : 0;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = col_base + nt * 8 + e;
              const bool seen = j < s_k && (full || ((j < prefix || (j >= lo && j < hi)) &&
                                                     (!docs || doc_q == doc_k[nt][e])));
              if (!seen) s[mt][nt][2 * half + e] = -INFINITY;
            }
        }
    } else if (kMode == FwdMode::kPlainMasked ||
               (kGeneral && mask.tile_needs_mask(m0, kBlockM, n0, kBlockN))) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          int lo, hi;  // visible columns of this row, relative to col_base
          mask.row_range(row_base + mt * 16 + half * 8, lo, hi);
          lo -= col_base;
          hi -= col_base;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = nt * 8 + e;
              if (j < lo || j >= hi) s[mt][nt][2 * half + e] = -INFINITY;
            }
        }
    }

    if constexpr (kGeneral || !Tr::kLazyRescale) {
      softmax.update(s, acc_o, to_log2);
    } else {
      softmax.update_lazy(s, acc_o, to_log2);
    }
    if (kGeneral && has_dropout) apply_dropout(s, p.rng, dropout_bh, row_base, col_base);
    staggered_mid();

    // O += P V: P's accumulator tiles 2kk, 2kk + 1 form the A operand of k-step kk. The V
    // fragments (k halves 0, 1 of d-tiles 2dp, 2dp + 1) are double-buffered over the
    // flattened (kk, dp) steps.
    constexpr int kDSteps = Tr::kVCols / 16;
    constexpr int kPVSteps = (kBlockN / 16) * kDSteps;
    std::uint32_t vb[2][4];
    auto load_v = [&](int step, std::uint32_t(&bv)[4]) {
      const int kk = step / kDSteps, dp = step % kDSteps;
      ldmatrix_x4_trans(v_lane[VTile::variant(dp * 16)] + VTile::const_bytes(kk * 16, dp * 16), bv);
    };
    load_v(0, vb[0]);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = pack2<Element>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<Element>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<Element>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<Element>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDSteps; ++dp) {
        const int step = kk * kDSteps + dp;
        if (step + 1 < kPVSteps) load_v(step + 1, vb[(step + 1) & 1]);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_m16n8k16<Element>(acc_o[mt][2 * dp], a[mt], vb[step & 1][0], vb[step & 1][1]);
          mma_m16n8k16<Element>(acc_o[mt][2 * dp + 1], a[mt], vb[step & 1][2], vb[step & 1][3]);
        }
      }
    }
  };

  // Plain calls: the tiles that cross the end of the keys or the causal / right window
  // edge come first in visit order and those crossing the left window edge last, so the
  // visit is masked tiles, one interior run, masked tiles.
  if (general_path) {
    for (int it = 0; it < n_tiles; ++it) key_tile(it, FwdModeTag<FwdMode::kGeneral>{});
  } else if constexpr (sparse) {
    // Block-sparse, plain scores: a full block's tile below s_k has no mask (the interior
    // copy); a partial block's tile is the plain rule's when the mask has no prefix keys
    // and no document ids (the interior or the masked copy, as without a block mask);
    // other tiles take the general copy. Only the first tile visited can cross s_k, so
    // the plain copies' full-tile loads of the tiles ahead stay in bounds.
    const bool plain_partial =
        p.doc_ids_q == nullptr && (p.prefix_keys == nullptr || p.prefix_keys[std::int64_t(b) * p.prefix_batch_stride] == 0);
    for (int it = 0; it < n_tiles; ++it) {
      const int tile = tile_of(it);
      const int n0 = tile * kBlockN;
      if (sparse_kind(tile) == semantics::kBlockFull && n0 + kBlockN <= s_k) {
        key_tile(it, FwdModeTag<FwdMode::kPlainInterior>{});
      } else if (plain_partial && !mask.tile_needs_mask(m0, kBlockM, n0, kBlockN)) {
        key_tile(it, FwdModeTag<FwdMode::kPlainInterior>{});
      } else {
        key_tile(it, FwdModeTag<FwdMode::kGeneral>{});
      }
    }
  } else {
    auto interior = [&](int it) {
      return !mask.tile_needs_mask(m0, kBlockM, (tile_end - 1 - it) * kBlockN, kBlockN);
    };
    for (int it = 0; it < n_tiles;) {
      if (!interior(it)) {
        key_tile(it, FwdModeTag<FwdMode::kPlainMasked>{});
        ++it;
      } else {
        for (; it < n_tiles && interior(it); ++it) {
          key_tile(it, FwdModeTag<FwdMode::kPlainInterior>{});
        }
      }
    }
  }

  // ---- epilogue: normalise, stage this warp's rows in its own (now unused) Q rows,
  // then 16-byte stores of the rows and columns that exist.
  float inv[2 * kMTiles], lse[2 * kMTiles];
  // The learnable sink joins each row's max and sum here, in log2 units (-inf: none).
  softmax.finalize(has_dropout ? p.rp_dropout : 1.0f, to_log2, inv, lse,
                   p.sink != nullptr ? p.sink[h] * kLog2e : -INFINITY);
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + mt * 16 + (lane >> 2) + half * 8;
        const int col = ot * 8 + (lane & 3) * 2;
        const float f = inv[2 * mt + half];
        *reinterpret_cast<std::uint32_t*>(sQ + QTile::offset(row, col)) = pack2<Element>(
            acc_o[mt][ot][2 * half] * f, acc_o[mt][ot][2 * half + 1] * f);
      }
  __syncwarp();
  Element* const o_rows = static_cast<Element*>(p.out) + p.o_offset(b) +
                          std::int64_t(h) * p.o_head_stride + std::int64_t(m0) * p.o_row_stride + v_col0();
  constexpr int kChunksPerRow = Tr::kVCols / 8;
  constexpr int kWarpChunks = kMTiles * 16 * kChunksPerRow;
  static_assert(kWarpChunks % 32 == 0);
#pragma unroll
  for (int pass = 0; pass < kWarpChunks / 32; ++pass) {
    const int idx = lane + 32 * pass;
    const int row = warp_row0 + idx / kChunksPerRow;
    const int col = (idx % kChunksPerRow) * 8;
    if (row < rows_here && col < p.d_v - v_col0()) {
      *reinterpret_cast<uint4*>(o_rows + std::int64_t(row) * p.o_row_stride + col) =
          *reinterpret_cast<const uint4*>(sQ + QTile::offset(row, col));
    }
  }
  if (p.lse != nullptr && v_col0() == 0 && (lane & 3) == 0) {
    float* const lse_row = p.lse + p.lse_offset(b, h) + m0;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + mt * 16 + (lane >> 2) + half * 8;
        if (row < rows_here) lse_row[row] = lse[2 * mt + half];
      }
  }
}

}  // namespace flashattn::detail::cuda::sm80
