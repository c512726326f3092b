// The KV-cache decode / split-KV path (decode_kernel.cuh): tile traits shared by the
// host-side plan (split count, workspace size) and the kernel, and the entry points of
// the instantiations (decode.inst.cu.in: one translation unit per head-dim bucket x dtype,
// the fp16 one also holding the fp8-cache variant).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm80 {

template <int kHeadDim, bool kFp8>
struct DecodeTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16;                       // packed query rows per block
  static constexpr int kSub = kHeadDim <= 64 ? 2 : 1;    // 16-key sub-tiles per warp per tile
  static constexpr int kBlockN = kWarps * 16 * kSub;     // keys per K/V tile
  static constexpr int kKvBytes = kFp8 ? 1 : 2;
  static constexpr int kRowBytes = kHeadDim * kKvBytes + 16;  // padded: ldmatrix conflict-free
  static constexpr int kChunksPerRow = kHeadDim * kKvBytes / 16;
#ifdef FLASHATTN_DECODE_STAGES
  static constexpr int kStages = FLASHATTN_DECODE_STAGES;
#else
  static constexpr int kStages = (kHeadDim > 128 && !kFp8) ? 2 : 3;
#endif
  static constexpr int kTileBytes = kBlockN * kRowBytes;  // K or V of one stage
  static constexpr int kStageBytes = 2 * kTileBytes + (kFp8 ? 2 * kBlockN * 4 : 0);
  static constexpr int kQRowBytes = kHeadDim * 2 + 16;
  static constexpr int kQBytes = kRows * kQRowBytes;
  static constexpr int kOStride = kHeadDim + 8;  // fp32 merge rows, padded
  static constexpr int kMergeBytes = kWarps * kRows * kOStride * 4 + 2 * kWarps * kRows * 4;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kBarBytes = 64;  // the stages' mbarriers (sm90 bulk copies)
  static constexpr int kSmemBytes =
      kQBytes + kBarBytes + (kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes);
};

// Run-time arguments of one decode launch besides FwdParams.
struct DecodeArgs {
  int splits = 1;      // key splits; > 1 writes partials to ws_o / ws_lse
  int row_chunks = 1;  // ceil(seqlen_q * h_ratio / 16)
  bool q_bf16 = false; // fp8 variant: q / out dtype
  bool interleave = true;  // splits take every splits-th key tile (else contiguous ranges)
  float* ws_o = nullptr;    // [splits, batch, h_q, seqlen_q, d] fp32
  float* ws_lse = nullptr;  // [splits, batch, h_q, seqlen_q] fp32
};

template <int kHeadDim, typename Element>
void run_decode(const FwdParams& p, const DecodeArgs& a);
template <int kHeadDim>
void run_decode_fp8(const FwdParams& p, const DecodeArgs& a);

}  // namespace flashattn::detail::cuda::sm80
