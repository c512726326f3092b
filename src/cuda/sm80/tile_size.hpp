// Compile-time tile shapes of the sm80 forward, one per head-dim bucket. Only these
// shape choices are template parameters; every feature that leaves the shapes alone
// (masks, softcap, ALiBi, dropout, varlen, KV cache, GQA) is a run-time branch.
//
// Per-thread register footprint of the forward, with kMTilesPerWarp = block_m / (16 warps):
//   O accumulator  kMTilesPerWarp * fwd_v_cols(head_dim) / 8 * 4 fp32
//   S/P tile       kMTilesPerWarp * block_n / 8 * 4 fp32
// kept under ~160 fp32 so that nothing spills at 255 registers.
#pragma once

namespace flashattn::detail::cuda {

// The columns of V and O one thread block of the forward computes: the bucket's head dim up
// to 256. Above (the 512 bucket: d or d_v in 264 .. 512) the O accumulator of every column
// would not fit in registers, so d_v is split into slices of 256 columns over the grid's
// blocks (grid x), each computing the full S = Q K^T over d and the online softmax and its
// slice of O = P V (fwd_kernel.cuh); only slice 0 writes lse.
constexpr int fwd_v_cols(int head_dim) { return head_dim > 256 ? 256 : head_dim; }

struct FwdTile {
  int block_m;  // query rows per thread block
  int block_n;  // keys per pipeline stage
  int warps;    // warps per thread block, each owning block_m / warps query rows
  int stages;   // K/V tiles in flight (cp.async ring)
};

// Measured on the H200 (bench/cuda_fwd_bench.cpp): two 16-row tiles per warp (B fragments
// shared by both) beat one wherever the accumulators fit in 255 registers without
// spilling: hdim 64 at 128 x 64 (274 TFLOP/s vs 224 for 128 x 32 / 3 stages), hdim 128 at
// 128 x 32 (289 vs 243 for 128 x 64 / 8 warps; 128 x 64 / 4 warps spills). From 160 up the
// O accumulator alone needs one tile per warp.
// Not yet measured on the device: hdim 128 with 3 stages (80 KiB, still two blocks per
// SM; the third stage gave hdim 256 1.5-2.5%); hdim 256 at 64 x 32 / 4 warps / 2 stages
// (96 KiB: two independent blocks per H200 SM, the occupancy shape FlashAttention-2 picks
// on H100; one block per SM on sm80's 164 KiB) instead of 128 x 32 / 8 warps / 3 stages
// (226-234 TFLOP/s; 160 KiB, one block whose 8 warps all meet at every tile barrier).
constexpr FwdTile fwd_tile(int head_dim) {
  if (head_dim <= 32) return {128, 64, 4, 2};
  if (head_dim <= 64) return {128, 64, 4, 2};
  if (head_dim <= 96) return {128, 32, 4, 2};
  if (head_dim <= 128) return {128, 32, 4, 3};
  if (head_dim <= 160) return {128, 64, 8, 2};
  if (head_dim <= 192) return {128, 32, 8, 2};
  if (head_dim <= 224) return {128, 32, 8, 2};
  if (head_dim <= 256) return {64, 32, 4, 2};
  return {64, 32, 4, 1};
}

// The 512 bucket (V and O in 256-column slices, fwd_v_cols): 64 x 32 / 4 warps, one K and one
// V buffer, staggered as fwd_tile_staggered below: Q 64 KiB + K 32 KiB + V 16 KiB = 112 KiB,
// two blocks per sm90 SM (8 warps; 64 x 64 would take 160 KiB, one block of 4 warps per SM)
// and one per sm80 SM. Not measured on a device yet. No 99 KiB tile: Q alone is 64 KiB at 64
// rows, so sm86 / sm89 get an Unsupported error (run_fwd) rather than another instantiation.

// Buckets with a second, larger tile for GPUs with at least its shared memory per block
// (H100/H200: 227 KiB; run_fwd picks it at run time from the device's opt-in limit):
// hdim 256 at 128 x 64 / 8 warps / 2 stages (192 KiB, one block per SM), measured on the
// H200 against the 64 x 32 tile in the same run: +4-5% at every seqlen from 1k to 16k,
// causal or not (304.6 -> 319.0 TFLOP/s at 16k non-causal, 306.6 -> 321.2 causal), -0.7%
// only at causal 512; with the tile-major causal launch order (fwd_kernel.cuh) the large
// tile is ahead at every seqlen from 512 (non-causal 512: 252 against 239, causal 512:
// 189 against 171).
constexpr bool has_large_fwd_tile(int head_dim) { return head_dim > 224 && head_dim <= 256; }
constexpr FwdTile fwd_tile_large(int head_dim) {
  return has_large_fwd_tile(head_dim) ? FwdTile{128, 64, 8, 2} : fwd_tile(head_dim);
}
// And a third for the same buckets: 64 x 64 / 4 warps with one K and one V buffer,
// staggered (stages = 1: V_j copied under S_j, K_{j+1} under P V_j; 96 KiB, two blocks per
// SM, the shape FlashAttention-2 takes on H100). Measured on the H200 against the 128 x 64
// tile in the same call (hdim 256, 16k tokens): +1.7% (non-causal 512) to +4.4%, every
// seqlen, causal or not, except causal 512 (-9.5%: 4.5 key tiles per block on average, the
// one-tile lookahead's exposed copies). run_fwd takes it when the mean number of keys a
// query sees is at least kFwdStaggeredMinKeys (non-causal 512 and causal 1k: 512).
constexpr bool has_staggered_fwd_tile(int head_dim) { return head_dim > 224 && head_dim <= 256; }
constexpr FwdTile fwd_tile_staggered(int head_dim) {
  return has_staggered_fwd_tile(head_dim) ? FwdTile{64, 64, 4, 1} : fwd_tile(head_dim);
}
inline constexpr long kFwdStaggeredMinKeys = 512;
// Q [block_m x head_dim], then per stage K [block_n x head_dim] and V [block_n x v cols].
constexpr int fwd_smem_bytes(FwdTile t, int head_dim) {
  return (t.block_m * head_dim + t.stages * t.block_n * (head_dim + fwd_v_cols(head_dim))) * 2;
}
constexpr int fwd_smem_bytes(int head_dim) { return fwd_smem_bytes(fwd_tile(head_dim), head_dim); }

// GPUs with 99 KiB of shared memory per block (sm86, sm89; or a smem cap that low): the
// buckets whose base tile needs more take the shape of a neighbouring bucket that fits,
// hdim 160 that of 192 (128 x 32 / 8 warps / 2 stages, 80 KiB) and hdim 224 that of 256
// (64 x 32 / 4 warps / 2 stages, 84 KiB). Not measured for speed on such a GPU yet. The 512
// bucket has none (above).
inline constexpr int kFwdSmallSmem = 99 * 1024;
constexpr bool has_small_fwd_tile(int head_dim) {
  return head_dim <= 256 && fwd_smem_bytes(head_dim) > kFwdSmallSmem;
}
constexpr FwdTile fwd_tile_small(int head_dim) {
  if (!has_small_fwd_tile(head_dim)) return fwd_tile(head_dim);
  return head_dim <= 160 ? FwdTile{128, 32, 8, 2} : FwdTile{64, 32, 4, 2};
}

// The head-dim buckets the forward may be compiled for; any d % 8 == 0 up to 512 runs in
// the smallest compiled bucket >= max(d, d_v) with predicated loads and stores. 512 is the
// forward's and the backward's alone (manifest.cmake: FLASHATTN_CUDA_WIDE_BUCKETS; the
// backward's 512 tiles: bwd_config.cuh, kWide).
constexpr bool is_head_dim_bucket(int d) {
  return d == 32 || d == 64 || d == 96 || d == 128 || d == 160 || d == 192 || d == 224 ||
         d == 256 || d == 512;
}

// A tile's shape rules: whole 16-row tiles per warp, 16-key steps, one stage (K and V
// staggered) or a ring of two or more, the
// shared memory under smem_limit, and the accumulators under ~192 fp32 per thread.
constexpr bool fwd_tile_fits(FwdTile t, int d, int smem_limit) {
  const int m_tiles = t.block_m / (16 * t.warps);
  return t.block_m % (16 * t.warps) == 0 && m_tiles >= 1 && t.block_n % 16 == 0 &&
         t.stages >= 1 && fwd_smem_bytes(t, d) <= smem_limit &&
         m_tiles * (fwd_v_cols(d) / 8 + t.block_n / 8) * 4 <= 192;
}
// Limits every bucket must respect: the base tiles sm80's 163 KiB of shared memory per
// block, the 99 KiB tiles sm86 / sm89's, the large tiles sm90's 227 KiB.
constexpr bool fwd_tile_valid(int d) { return fwd_tile_fits(fwd_tile(d), d, 163 * 1024); }
constexpr bool fwd_tile_large_valid(int d) { return fwd_tile_fits(fwd_tile_large(d), d, 227 * 1024); }
static_assert(fwd_tile_large_valid(256), "fwd_tile_large: hdim 256 breaks the sm90 budget");
static_assert(fwd_tile_fits(fwd_tile_staggered(256), 256, 113 * 1024),
              "fwd_tile_staggered: hdim 256 must leave room for two blocks per sm90 SM");
constexpr bool fwd_tile_small_valid(int d) { return fwd_tile_fits(fwd_tile_small(d), d, kFwdSmallSmem); }
static_assert(fwd_tile_small_valid(32) && fwd_tile_small_valid(64) && fwd_tile_small_valid(96) &&
                  fwd_tile_small_valid(128) && fwd_tile_small_valid(160) &&
                  fwd_tile_small_valid(192) && fwd_tile_small_valid(224) &&
                  fwd_tile_small_valid(256),
              "fwd_tile_small: a bucket has no tile within 99 KiB (sm86 / sm89)");
static_assert(fwd_tile_valid(32) && fwd_tile_valid(64) && fwd_tile_valid(96) &&
                  fwd_tile_valid(128) && fwd_tile_valid(160) && fwd_tile_valid(192) &&
                  fwd_tile_valid(224) && fwd_tile_valid(256) && fwd_tile_valid(512),
              "fwd_tile: a bucket breaks the shared-memory or register budget");
static_assert(fwd_tile(512).stages == 1 && fwd_tile_fits(fwd_tile(512), 512, 113 * 1024),
              "fwd_tile: hdim 512 must be staggered and leave room for two blocks per sm90 SM");

}  // namespace flashattn::detail::cuda
