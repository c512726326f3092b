// The KV-cache decode / split-KV path (decode_kernel.cuh): tile traits shared by the
// host-side plan (split count, workspace size, configuration) and the kernel, and the
// entry points of the instantiations (decode.inst.cu.in: one translation unit per head-dim
// bucket x dtype, the fp16 one also holding the fp8-cache variant).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm80 {

// The shared memory per block of the smallest GPUs the sm80 family runs on (sm86, sm89:
// 99 KiB), which the small configuration (DecodeTraits' kSmall) fits where it can.
inline constexpr int kDecodeSmallSmemBytes = 99 * 1024;

// kT8: the transposed kernel for at most 8 packed rows (decode_kernel.cuh), which needs
// fewer registers and so fits more blocks per SM. kSmall: the same kernel with as many
// stages as fit in 99 KiB (at least 2, at most the default's), for GPUs whose shared
// memory per block does not hold the default configuration (decode_dispatch.cu chooses
// it from p.smem_limit); only the stage count differs (kMinBlocks, and so
// __launch_bounds__, stay the default's). A distinct kernel only where its stage count
// differs (kDecodeHasSmall).
//
// Up to d = 256 each warp holds every O column of its share of the keys (16 or 32 of a
// tile's 64 or 128). In the 512 bucket (d in 264 .. 512) O would need 256 fp32 registers
// per thread in the 16-row form: the warps split the columns of V and O instead
// (kColGroups = 4, 128 columns each) over one shared 16-key tile, each computing the tile's
// S = Q K^T over all of d (the same scores in every warp) and its columns' P V; the tile's
// K and V (16 rows of 1 KiB each, 16-bit) then fit two stages in 99 KiB.
template <int kHeadDim, bool kFp8, bool kT8 = false, bool kSmall = false>
struct DecodeTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16;                       // packed query rows per block
  static constexpr int kSub = kHeadDim <= 64 ? 2 : 1;    // 16-key sub-tiles per warp per tile
  static constexpr int kColGroups = kHeadDim > 256 ? 4 : 1;  // warps over V / O's columns
  static constexpr int kKeyWarps = kWarps / kColGroups;      // warps over a tile's keys
  static constexpr int kVCols = kHeadDim / kColGroups;       // O columns per warp
  static constexpr int kBlockN = kKeyWarps * 16 * kSub;  // keys per K/V tile
  // Whole warps per column group; a warp's columns in whole 32-column steps (fp8 V loads).
  static_assert(kWarps % kColGroups == 0 && kVCols % 32 == 0 && kVCols * kColGroups == kHeadDim,
                "DecodeTraits: head-dim bucket");
  static constexpr int kKvBytes = kFp8 ? 1 : 2;
  // K/V tiles in shared memory: each key row split into 128-byte segments; the tile's rows
  // in boxes (the whole tile when dense, one paged block's rows otherwise), a box's rows
  // stored segment by segment ([box][kSegs][box rows][128 B]), the 16-byte chunks of a row
  // XOR-swizzled by (row % 8): the layout TMA tensor copies with 128-byte swizzle write
  // (decode_loaders.cuh: TileLayout), read by ldmatrix without bank conflicts.
  static constexpr int kRowBytes = kHeadDim * kKvBytes;            // bytes used per key row
  static constexpr int kSegs = (kRowBytes + 127) / 128;
  static constexpr int kSegBytes = kBlockN * 128;                  // one segment of a tile
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kChunksTotal = kSegs * 8;                   // incl. a last segment's padding
  static constexpr int kSegElems = 128 / kKvBytes;                 // elements per segment row
  static constexpr int kTileBytes = kSegs * kSegBytes;  // K or V of one stage
  static constexpr int kScaleBytes = kFp8 ? 2 * kBlockN * 4 : 0;
  static constexpr int kStageBytes = (2 * kTileBytes + kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kQRowBytes = kHeadDim * 2 + 16;
  static constexpr int kQBytes = kRows * kQRowBytes;
  // Blocks per SM the kernel is built for (__launch_bounds__: registers <= 64K / (128 x
  // this)), and as many stages (2..8) as fit that many blocks in the H100/H200's 228 KB
  // (a 220 KB budget; 2 blocks: 110 KB each). Measured on the H200 at 32k (decode bench):
  // 16-row kernel, 16-bit d <= 128: 2 blocks x 3 stages (3 blocks measured no faster and
  // spill 80 B); fp8 d <= 128: 3 x 4 (2 x 6: latency-bound, 219.5 against 190.0 us; 4
  // blocks spill 340 B). Transposed kernel (158-163 registers unbounded), d <= 128: 3
  // blocks (16-bit: 2 stages, 248.5 against 254.4 us at 2 x 3; fp8: 4 stages, 141.0 us,
  // against 190.8 at 4 blocks, 32 B of spills). d > 128: 2 blocks (the 512 bucket: 82 KiB
  // each with 16-bit K/V, 2 stages of 16 keys; not measured on a device).
  static constexpr int kMinBlocks = kHeadDim <= 128 && (kFp8 || kT8) ? 3 : 2;
  static constexpr int kBarBytes = 64;  // the stages' mbarriers (sm90 tensor copies)
  static constexpr int kFitStages = (220 * 1024 / kMinBlocks - kQBytes - 1024 - 64) / kStageBytes;
  static constexpr int kDefaultStages = kFitStages < 2 ? 2 : (kFitStages > 8 ? 8 : kFitStages);
  // The small configuration: as many stages as fit in 99 KiB beside q, the barriers and
  // the alignment slack; 2 at least (16-bit K/V at d >= 160 do not fit even so: 3 or 4
  // 128-byte segments per key row, 64 keys, K and V), the default's at most.
  static constexpr int kSmallFitStages = (kDecodeSmallSmemBytes - kQBytes - kBarBytes - 1024) / kStageBytes;
  static constexpr int kStages =
      !kSmall ? kDefaultStages
              : (kSmallFitStages < 2 ? 2 : (kSmallFitStages > kDefaultStages ? kDefaultStages : kSmallFitStages));
  static constexpr int kOStride = kHeadDim + 8;  // fp32 merge rows, padded
  // The warps' merge (per key warp: O rows, max, sum; the column groups of a key warp write
  // their columns of its rows), then the block's partial O and lse for the cluster split
  // merge (DecodeArgs::cluster): [kRows][kHeadDim] and [kRows] fp32.
  static constexpr int kPartOffset = kKeyWarps * kRows * kOStride * 4 + 2 * kKeyWarps * kRows * 4;
  static constexpr int kMergeBytes = kPartOffset + kRows * kHeadDim * 4 + kRows * 4;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  // + 1024: the pipeline starts at the first 1024-byte boundary (the swizzle's period).
  static constexpr int kSmemBytes =
      kQBytes + kBarBytes + 1024 + (kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes);
};

// Whether the small configuration is a kernel of its own (fewer stages than the default):
// 16-bit K/V at d 64 .. 128 (16-row form: 3 stages -> 2), fp8 K/V at d > 128 (3 -> 2; the
// 512 bucket 5 -> 4).
template <int kHeadDim, bool kFp8, bool kT8>
inline constexpr bool kDecodeHasSmall =
    DecodeTraits<kHeadDim, kFp8, kT8, true>::kStages != DecodeTraits<kHeadDim, kFp8, kT8>::kStages;

// The most splits the cluster merge takes (DecodeArgs::cluster): up to the portable cluster
// size (8) everywhere on sm90; above it (9..16, Hopper's non-portable cluster sizes) only
// where the device can hold every cluster of the grid at once (decode_max_active_clusters).
inline constexpr int kMaxPortableClusterSplits = 8;
inline constexpr int kMaxClusterSplits = 16;

// A CUtensorMap (cuda.h), kept opaque here: 128 bytes, 64-byte aligned.
struct alignas(64) TensorMapBytes {
  unsigned char bytes[128];
};

// Run-time arguments of one decode launch besides FwdParams.
struct DecodeArgs {
  // sm90: K/V tiles by TMA tensor copies over k_map / v_map, box_rows rows per copy (a paged
  // cache's blocks hold whole boxes). map_rank 5 (d a whole number of 128-byte segments):
  // (segment elements, rows of a cache row or block, segments, h_k, cache rows or blocks),
  // one copy per box; 4: (d, rows, h_k, cache rows or blocks), one copy per box and segment.
  // Else (sm80, block sizes % 8 != 0, small or unaligned rows) 16-byte cp.async.
  TensorMapBytes k_map{}, v_map{};
  bool tma = false;
  int map_rank = 4;
  int box_rows = 0;
  int splits = 1;      // key splits; > 1 writes partials to ws_o / ws_lse, the last merges
  // sm90, 2 <= splits <= kMaxClusterSplits: a row chunk's splits are one thread-block
  // cluster (blockIdx.x = chunk * splits + split) and merge through each other's shared
  // memory after a cluster barrier (split_kv_merge.cuh: merge_cluster_rows); no workspace.
  // Above kMaxPortableClusterSplits the launch opts the kernel into non-portable cluster
  // sizes (decode_run.cuh).
  bool cluster = false;
  int row_chunks = 1;  // ceil(seqlen_q * h_ratio / 16)
  bool t8 = false;     // seqlen_q * h_ratio <= 8: the transposed kernel (decode_kernel.cuh)
  bool q_bf16 = false; // q / out dtype, out's with fp8 q (read by the fp8 variant and the split merge)
  // fp8 variant only: float8_e4m3 q (FlashAttention-3's fp8 KV-cache call), converted to f16
  // as it is loaded; the [b, h_k] descales p.q_descale, p.k_scale, p.v_scale (null: 1) fold
  // into the softmax scale (q, k) and the output (v); no per-key scales (the dispatch runs
  // it with p.scale_block_stride 0).
  bool q_fp8 = false;
  bool interleave = true;  // splits take every splits-th key tile (else contiguous ranges)
  bool pdl = false;        // sm90: programmatic dependent launch (decode_kernel.cuh: griddep_wait)
  float* ws_o = nullptr;    // [splits, batch, h_q, seqlen_q, d] fp32
  float* ws_lse = nullptr;  // [splits, batch, h_q, seqlen_q] fp32
  // [batch, h_k, row_chunks] arrival counters of the split merge (split_kv_merge.cuh:
  // arrive_split), zeroed in the stream before each launch.
  unsigned int* ws_count = nullptr;
};

// small: the small configuration (DecodeTraits' kSmall), where the default does not fit in
// p.smem_limit (decode_dispatch.cu); the default where the two are the same kernel.
template <int kHeadDim, typename Element>
void run_decode(const FwdParams& p, const DecodeArgs& a, bool small);
template <int kHeadDim>
void run_decode_fp8(const FwdParams& p, const DecodeArgs& a, bool small);

// How many clusters of `cluster` blocks (2..kMaxClusterSplits) of the decode kernel that
// run_decode / run_decode_fp8 would launch for (a.t8, small) can be resident at once on
// `device` (cudaOccupancyMaxActiveClusters with the kernel's block size and dynamic shared
// memory, the kernel opted into non-portable sizes above 8); 0 where the query fails
// (e.g. below sm90). Queried once per (device, kernel, cluster size) and cached: no
// device synchronisation, safe during CUDA graph capture (the query itself runs under
// cudaStreamCaptureModeRelaxed for the calling thread, as it is no stream work).
template <int kHeadDim, typename Element>
int decode_max_active_clusters(int device, bool t8, bool small, int cluster);
template <int kHeadDim>
int decode_fp8_max_active_clusters(int device, bool t8, bool small, int cluster);

}  // namespace flashattn::detail::cuda::sm80
