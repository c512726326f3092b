// Multi-head latent attention (MLA, FlashAttention-3's qv) on the sm80 family
// (mla_kernel.cuh): the tile traits shared by the host-side plan (mla_dispatch.cu: split
// count, workspace, shared-memory check) and the kernel, the run-time arguments of a launch
// and the entry points of the two instantiations (mla_fp16.cu, mla_bf16.cu).
#pragma once

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm80 {

// One block: 64 GQA-packed query rows of one KV head (row r = i * h_ratio + hh) against
// 32-key tiles. The score runs over [q | qv] . [k | v]: q / k padded to kDimK = 64 dims and
// qv / v to kDimV = 512 (zero-filled past d and d_v), one 576-dim row per key, the latent
// (v) part serving both the score and the value from one copy in shared memory.
struct MlaTraits {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 64;     // packed query rows per block
  static constexpr int kBlockN = 32;   // keys per tile
  static constexpr int kDimK = 64;     // q / k (rope) dims, the most the kernel takes
  static constexpr int kDimV = 512;    // qv / v (latent) dims, the most the kernel takes
  static constexpr int kDimS = kDimK + kDimV;  // the score's dot product
  static constexpr int kChunks = kDimS / 8;    // 16-byte chunks of a row (8 of k, 64 of v)
  // Rows of q' = [q | qv] and k' = [k | v] in shared memory, padded by 16 bytes: a row
  // stride of 1168 bytes (16 mod 128) puts the 8 rows of an ldmatrix on 8 distinct 16-byte
  // bank groups.
  static constexpr int kRowBytes = kDimS * 2 + 16;
  static constexpr int kQBytes = kRows * kRowBytes;       // 74752
  static constexpr int kTileBytes = kBlockN * kRowBytes;  // 37376
  // Two stages: the most that fit beside q in the 163 KiB of an A100 (sm80); on sm90 the
  // next tile's 37 KB in flight per SM cover the latency of its DRAM reads.
  static constexpr int kStages = 2;
  // Scores S (fp32, 64 rows x 32 keys) exchanged between the two warps of a row group;
  // a 40-float row stride keeps the float2 accesses free of bank conflicts.
  static constexpr int kSStride = kBlockN + 8;
  static constexpr int kSBytes = kRows * kSStride * 4;
  static constexpr int kSmemBytes = kQBytes + kStages * kTileBytes + kSBytes;  // 159744
};

// Run-time arguments of one MLA launch besides FwdParams (the split-KV merge's
// SplitArgs: collective/split_kv_merge.cuh).
struct MlaArgs {
  int splits = 1;      // key splits; > 1 writes partials to ws_o / ws_lse, the last merges
  int row_chunks = 1;  // ceil(seqlen_q * h_ratio / 64)
  bool q_bf16 = false;       // the output's dtype (the split merge's)
  float* ws_o = nullptr;     // [splits, batch, h_q, seqlen_q, d_v] fp32
  float* ws_lse = nullptr;   // [splits, batch, h_q, seqlen_q] fp32
  unsigned int* ws_count = nullptr;  // [batch, h_k, row_chunks], zeroed before the launch
};

template <typename Element>
void run_mla(const FwdParams& p, const MlaArgs& a);

}  // namespace flashattn::detail::cuda::sm80
