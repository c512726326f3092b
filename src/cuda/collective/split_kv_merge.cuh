// The split-KV merge of the decode kernel, in two forms. With a thread-block cluster per row
// chunk (sm90, up to 16 splits: merge_cluster_rows, below) the partials stay in the blocks'
// shared memory. Else each split of a row chunk writes fp32 partial O
// and lse to a workspace, counts itself in the chunk's arrival counter (arrive_split; the
// counters are zeroed in the call's stream before the launch), and the last split to
// arrive merges every split's partials by log-sum-exp (merge_split_row,
// semantics::merge_weight), one warp per row, in the same launch. Used by the sm80 decode
// kernel (decode_kernel.cuh; the workspace layout is decode_launch.hpp's DecodeArgs). In
// the sm80 namespace with the conversions it uses (convert.cuh).
//
// merge_split_row's SplitArgs: splits, ws_o ([splits][batch * h_q * seqlen_q][width] fp32,
// width the output's head dim: d for the decode kernel, d_v for the MLA kernel), ws_lse
// ([splits][batch * h_q * seqlen_q]) and q_bf16 (the output's dtype). Also used by the MLA
// kernel (sm80/mla_kernel.cuh).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/arch/sm90_cluster.cuh"
#include "cuda/collective/convert.cuh"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda::sm80 {

// Split-KV merge, in the decode kernel itself (no second launch): each split's block
// writes its fp32 partial O and lse, then counts itself in its row chunk's arrival counter
// (zero at the launch: run_decode_path clears the counters in the stream, captured with
// the call); the one that brings the count to `splits` merges every split's partials.
// Returns true in the merging block's thread (one thread per block calls it, after a
// barrier: the one fence there covers the whole block's stores, as in a grid barrier).
// (A separate combine kernel cost ~4 us of a 41 us decode step at 4k on the H200, its
// launch and ramp more than its loads; docs/performance.md.)
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
__device__ __forceinline__ bool arrive_split(unsigned int* counter, int splits) {
  fence_acq_rel_gpu();  // releases the block's partials (ordered before it by the barrier)
  const bool last = atomicAdd(counter, 1u) + 1u == static_cast<unsigned int>(splits);
  if (last) fence_acq_rel_gpu();  // acquires the other splits' partials, read after the barrier
  return last;
}

// One warp merges the split partials of one (b, h, i) row of the [batch, h_q, seqlen_q]
// rows by log-sum-exp and writes out (and lse; `width` columns, a multiple of 4): lane l holds split
// l's lse and merge weight (splits <= 32; more take the lanes in turn), then for each
// 4-column group the splits' partial O rows are loaded kBatch at a time, all in flight
// together, and summed in split order (the same bits whichever split merges) with the
// weights broadcast by shuffle. The loads go to L2 (ld.global.cg): the partials were
// written by other blocks.
template <class SplitArgs>
__device__ __forceinline__ void merge_split_row(const FwdParams& p, const SplitArgs& a, int b, int h, int i,
                                                int lane, int width) {
  constexpr int kBatch = 8;
  const std::int64_t rows = std::int64_t(p.batch) * p.h_q * p.seqlen_q;
  const std::int64_t row = (std::int64_t(b) * p.h_q + h) * p.seqlen_q + i;
  const float* lse_s = a.ws_lse + row;
  const int n = a.splits;
  const bool lane_held = n <= 32;  // every split's lse in its own lane
  const float my_ls = lane < n ? __ldcg(lse_s + std::int64_t(lane) * rows) : -INFINITY;
  // The first column group's first kBatch partial rows, in flight with the lse loads.
  auto load_o = [&](int c, int s0, float4 (&v)[kBatch]) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const float* src = a.ws_o + ((s0 + k) * rows + row) * width + c;
      v[k] = c < width && s0 + k < n ? __ldcg(reinterpret_cast<const float4*>(src)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  float4 first[kBatch];
  load_o(lane * 4, 0, first);
  float m = my_ls;
  for (int s = lane + 32; s < n; s += 32) m = fmaxf(m, __ldcg(lse_s + s * rows));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  // semantics::merged_lse: fmaxf skips a NaN lse_s, whose exp then makes the sum and lse
  // NaN (and every weight, so the merged row is NaN); base 0 when no split saw a key
  // (exp(-inf) = 0, sum 0, lse -inf).
  const float mb = m == -INFINITY ? 0.0f : m;
  float sum = expf(my_ls - mb);
  for (int s = lane + 32; s < n; s += 32) sum += expf(__ldcg(lse_s + s * rows) - mb);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  float lse = sum == 0.0f ? -INFINITY : m + logf(sum);
  // A learnable sink joins once, here (the splits' partials are over their keys only):
  // the weights below are taken against the lse that includes it (a NaN lse stays NaN).
  if (p.sink != nullptr) lse = semantics::lse_with_sink(lse, p.sink[h]);
  if (lane == 0 && p.lse) p.lse[p.lse_offset(b, h) + i] = lse;
  const float my_w = lse == -INFINITY ? 0.0f : semantics::merge_weight(my_ls, lse);
  auto* out = static_cast<std::uint16_t*>(p.out) + p.o_offset(b) + std::int64_t(i) * p.o_row_stride +
              std::int64_t(h) * p.o_head_stride;
  // Every lane runs every column group (those past d load and store nothing): the
  // weights come by shuffle from the lanes that hold them, so all 32 must take part. (A
  // loop over only the lanes with columns left read the weights of splits >= d / 4 from
  // lanes outside it: wrong partial weights for d < 128 and d / 4 < splits <= 32.)
  for (int c0 = 0; c0 < width; c0 += 128) {
    const int c = c0 + lane * 4;
    const bool col = c < width;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < n; s0 += kBatch) {
      float4 v[kBatch];
      if (c0 == 0 && s0 == 0) {
#pragma unroll
        for (int k = 0; k < kBatch; ++k) v[k] = first[k];
      } else {
        load_o(c, s0, v);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = s0 + k;
        float w = __shfl_sync(0xffffffffu, my_w, s & 31);
        if (!lane_held) w = s < n && lse != -INFINITY ? semantics::merge_weight(__ldcg(lse_s + s * rows), lse) : 0.0f;
        if (s < n && w != 0.0f) acc.x += w * v[k].x, acc.y += w * v[k].y, acc.z += w * v[k].z, acc.w += w * v[k].w;
      }
    }
    if (col) {
      const uint2 packed = make_uint2(pack_out(acc.x, acc.y, a.q_bf16), pack_out(acc.z, acc.w, a.q_bf16));
      *reinterpret_cast<uint2*>(out + c) = packed;
    }
  }
}

// The cluster form (sm90; the decode kernel's DecodeArgs::cluster): the `splits` blocks of
// a row chunk form one thread-block cluster, block `rank` holding split `rank`'s partials in
// its shared memory at `part` (the same offset in every block): O rows [kRows][kHeadDim] fp32
// (columns < width), then lse [kRows]. Between two cluster barriers (the first makes every
// block's partials visible, the second keeps every block's shared memory alive until the
// others have read it), block `rank` merges items rank, rank + splits, ... of the chunk's
// nr rows x width / 4 column groups, one per thread at a time: every split's lse (up to
// kMaxSplits, 16: one register each), merged as merge_split_row merges (log-sum-exp by
// semantics::merged_lse, the sink once, the weights of semantics::merge_weight), then the
// O groups kGroup (8) splits at a time, a group's loads in flight together (the first
// group's with the lse loads), summed in split order: the same sum, in the same order, as
// one pass over every split (the per-split O registers of a group, not of all 16 splits);
// then out (and lse, by the item of column 0) stored. All threads of every block call it.
template <int kRows, int kHeadDim, int kThreads, int kMaxSplits>
__device__ __forceinline__ void merge_cluster_rows(const FwdParams& p, const float* part, int splits, int rank,
                                                   bool out_bf16, int width, int b, int g_kv, int h_ratio, int r0,
                                                   int nr, int tid) {
  constexpr int kGroup = kMaxSplits < 8 ? kMaxSplits : 8;
  static_assert(kMaxSplits % kGroup == 0, "whole groups of splits");
  cluster_sync_all();  // every split's partials are in its block's shared memory
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(part));
  const int groups = width / 4;
  const int items = nr * groups;
  for (int it = rank + splits * tid; it < items; it += splits * kThreads) {
    const int rr = it / groups, c = (it - rr * groups) * 4;
    const std::uint32_t lse_at = static_cast<std::uint32_t>((kRows * kHeadDim + rr) * 4);
    const std::uint32_t o_at = static_cast<std::uint32_t>((rr * kHeadDim + c) * 4);
    // Split s's O group, zero past `splits`.
    auto load_o = [&](int s) {
      return s < splits ? ld_cluster_f32x4(cluster_map(base, static_cast<std::uint32_t>(s)) + o_at)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    float ls[kMaxSplits];
    float4 v[kGroup];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      ls[s] = -INFINITY;
      if (s < splits) ls[s] = ld_cluster_f32(cluster_map(base, static_cast<std::uint32_t>(s)) + lse_at);
      if (s < kGroup) v[s] = load_o(s);
    }
    float lse = semantics::merged_lse(ls, kMaxSplits, 1);  // the unused splits' -inf add nothing
    const int r = r0 + rr;
    const int i = r / h_ratio, h = g_kv * h_ratio + r % h_ratio;
    if (p.sink != nullptr) lse = semantics::lse_with_sink(lse, p.sink[h]);
    if (c == 0 && p.lse) p.lse[p.lse_offset(b, h) + i] = lse;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s0 = 0; s0 < kMaxSplits; s0 += kGroup) {
      if (s0 >= splits) break;
      if (s0 > 0) {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) v[k] = load_o(s0 + k);
      }
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const int s = s0 + k;
        const float w = s < splits && lse != -INFINITY ? semantics::merge_weight(ls[s], lse) : 0.0f;
        if (w != 0.0f) acc.x += w * v[k].x, acc.y += w * v[k].y, acc.z += w * v[k].z, acc.w += w * v[k].w;
      }
    }
    auto* out = static_cast<std::uint16_t*>(p.out) + p.o_offset(b) + std::int64_t(i) * p.o_row_stride +
                std::int64_t(h) * p.o_head_stride + c;
    *reinterpret_cast<uint2*>(out) = make_uint2(pack_out(acc.x, acc.y, out_bf16), pack_out(acc.z, acc.w, out_bf16));
  }
  cluster_sync_all();  // no block leaves while another may still read its shared memory
}

}  // namespace flashattn::detail::cuda::sm80
