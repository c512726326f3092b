// The KV-cache decode / split-KV kernel (issue 4): bandwidth-oriented attention of a few
// query rows against a long dense or paged cache, fp16/bf16 or fp8 e4m3.
//
// One block per (16-row query chunk, split) x KV head x sequence. GQA packing: the
// s_q * h_ratio query rows that share KV head g are packed as row r = i * h_ratio + hh
// (query token i, head g * h_ratio + hh) into the 16 rows of one m16n8k16 row block, so a
// KV byte is read once per 16 rows. The 4 warps split the keys of each K/V tile (16 or 32
// keys each, not the rows); each keeps its own online softmax state, and the warps merge
// (max, sum, O) through shared memory at the end. K/V tiles arrive through a multi-stage
// pipeline: on sm90 by TMA tensor copies (a box per tile when dense, per block when paged
// with block sizes that are multiples of 8; the warps share the issue) completing on a
// per-stage mbarrier, with the block-table entries loaded one tile ahead; else (sm80,
// other block sizes, unaligned layouts) by 16-byte cp.async with per-row addresses.
// Rows beyond the sequence's key count are zero-filled, never read.
//
// Two forms of the products. With up to 8 packed rows (decode: one token, GQA ratio <= 8)
// the transposed one (kT8): S^T = K Q^T and O^T = V^T P^T on m16n8k16, keys and dims as
// the 16 MMA rows and the query rows as the 8 columns (P^T's halves transposed across the
// warp by movmatrix): half the MMAs and half the O registers of the 16-row form, so three
// blocks per SM fit. With more rows the 16-row form: S = Q K^T, O = P V.
//
// fp8: K/V stay e4m3 in shared memory (half the bytes of the copy) and are converted in
// registers to f16 (exact, collective/convert.cuh), so the fp8 variant runs f16 MMAs
// whatever q's dtype (q is rounded to f16 once). K fragments come from ldmatrix over e4m3
// bytes (a dim permutation, the same for q, keeps dots exact); V from ldmatrix.trans plus a
// byte permute, which interleaves even and odd dims of the output (undone at the store).
// Per-key scales (per (block, head)) multiply S columns and P before PV; per-head scales
// fold into the softmax scale and the output. fp8 q (FlashAttention-3's fp8 KV-cache call,
// DecodeArgs::q_fp8, a run-time flag of the same instantiations): q's e4m3 bytes are
// converted to f16 (exact) as they are loaded, and the per-(sequence, KV head) descales
// fold like per-head scales: q_descale * k_descale into the softmax scale, v_descale into
// the output.
//
// The 512 bucket (d in 264 .. 512; DecodeTraits::kColGroups): O of every column would not
// fit in registers, so the 4 warps share each 16-key tile and split V's and O's columns
// (128 each) instead of the keys: every warp computes the tile's S over all of d (the same
// scores and softmax state in each) and its columns' P V; the warps' merge then has one
// key share whose rows each column group writes in part.
//
// The pieces: the K/V tile loader (decode_loaders.cuh and its in-kernel part
// decode_kernel_loaders.inc), the warps' merge and the store (decode_kernel_epilogue.inc),
// and with splits > 1 the split-KV merge (collective/split_kv_merge.cuh), one launch per
// call: on sm90 with up to 8 splits (16 where the device holds the grid's clusters at
// once: decode_dispatch.cu) a row chunk's splits are one thread-block cluster and
// merge through each other's shared memory (no workspace, no arrival counter); else the
// last split of each row chunk to finish merges the partials in the workspace. The launch
// is decode_run.cuh.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/params.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/collective/index_report.cuh"
#include "cuda/arch/pdl.cuh"
#include "cuda/arch/sm80.cuh"
#include "cuda/arch/sm90_bulk.cuh"
#include "cuda/arch/sm90_cluster.cuh"
#include "cuda/sm80/decode_launch.hpp"
#include "cuda/collective/convert.cuh"
#include "cuda/collective/split_kv_merge.cuh"
#include "cuda/sm80/decode_loaders.cuh"

namespace flashattn::detail::cuda::sm80 {

namespace decode_detail {

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace decode_detail

// kT8 (at most 8 packed rows): the transposed products S^T = K Q^T and O^T = V^T P^T, keys
// and dims as the MMAs' 16 rows and the query rows as their 8 columns: half the MMAs and
// half the O registers of the 16-row form (decode with GQA ratios up to 8). kSmall: fewer
// pipeline stages, for 99 KiB of shared memory per block (decode_launch.hpp).
template <int kHeadDim, typename Element, bool kFp8, bool kT8, bool kSmall>
__global__ void __launch_bounds__(DecodeTraits<kHeadDim, kFp8, kT8, kSmall>::kThreads,
                                  DecodeTraits<kHeadDim, kFp8, kT8, kSmall>::kMinBlocks)
    decode_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ DecodeArgs a) {
  using Tr = DecodeTraits<kHeadDim, kFp8, kT8, kSmall>;
  using namespace decode_detail;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kSub = Tr::kSub;
  constexpr int kVCols = Tr::kVCols;  // the columns of O a warp holds: d up to 256
  constexpr int kOTiles = kVCols / 8;
  constexpr int kKSteps = kHeadDim / 16;
  // (fp8 with q's fragments re-read from shared memory, which removes the 48 B of spills at
  // 168 registers, together with the split S below measured 189.5 against 186.2 us at 32k.)
  constexpr bool kQInRegs = kHeadDim <= 128;
  extern __shared__ __align__(128) unsigned char smem[];
  // ---- shared memory: q (16 packed rows, loaded after the prologue's K/V copies are
  // issued), the stages' mbarriers, the K/V pipeline
  unsigned char* q_smem = smem;
  unsigned char* bars = smem + Tr::kQBytes;  // kStages mbarriers (sm90)
  // The pipeline at the first 1024-byte boundary past q and the barriers (swizzle period).
  unsigned char* pipe = bars + Tr::kBarBytes;
  pipe += (1024u - (smem_u32(pipe) & 1023u)) & 1023u;

  // What needs no global memory runs before the wait, overlapping the kernel before this
  // one in the stream (programmatic dependent launch): the stages' mbarriers, and the
  // tensor maps (kernel parameters) into the TMA unit's cache ahead of the first copy.
  if (kHasBulkCopies && a.tma && threadIdx.x == 0) {
    for (int st = 0; st < Tr::kStages; ++st) mbar_init(smem_u32(bars + 8 * st));
    fence_mbarrier_init();
    tensor_map_prefetch(&a.k_map);
    tensor_map_prefetch(&a.v_map);
  }
  griddep_wait();  // nothing in global memory is touched before this
  griddep_launch_dependents();
  // The call's index check when it enqueued no check kernel (FwdParams::row_check_call):
  // one thread per sequence (the kernel clamps the values regardless).
  if (p.row_check_call >= 0 && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    const index_record::Reporter rep{static_cast<index_record::IndexErrorRecord*>(p.row_check_record),
                                     p.row_check_lock, p.row_check_call};
    index_record::check_cache_row(rep, nullptr, p.cache_seqlens, p.cache_capacity() - p.seqlen_k_new,
                                  p.cache_batch_idx, p.kv_cache_rows, static_cast<int>(blockIdx.z));
  }
  // A row chunk's splits: consecutive blocks (one cluster) with the cluster merge, else
  // strided by the chunk count.
  const int chunk = static_cast<int>(a.cluster ? blockIdx.x / static_cast<unsigned>(a.splits)
                                               : blockIdx.x % static_cast<unsigned>(a.row_chunks));
  const int split = static_cast<int>(a.cluster ? blockIdx.x % static_cast<unsigned>(a.splits)
                                               : blockIdx.x / static_cast<unsigned>(a.row_chunks));
  const int g_kv = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  // This warp's share of a tile: its keys (key_warp) and O's columns from col0 (a column
  // group of the 512 bucket; every column up to 256).
  const int key_warp = Tr::kColGroups == 1 ? warp : warp % Tr::kKeyWarps;
  const int col0 = Tr::kColGroups == 1 ? 0 : warp / Tr::kKeyWarps * kVCols;
  const int h_ratio = p.h_ratio;

  const int s_q = p.seq_len_q(b);
  const int s_k = p.seq_len_k(b);
  const int nrows = s_q * h_ratio;
  const int r0 = chunk * Tr::kRows;
  if (r0 >= nrows) return;
  const int r_last = min(r0 + Tr::kRows, nrows) - 1;
  const int i_lo = r0 / h_ratio, i_hi = r_last / h_ratio;
  const semantics::KeyRange lo = semantics::visible_keys(i_lo, s_q, s_k, p.mask);
  const semantics::KeyRange hi = semantics::visible_keys(i_hi, s_q, s_k, p.mask);
  const std::int64_t kb = lo.begin, ke = hi.end;        // union of the rows' intervals
  const std::int64_t full_lo = hi.begin, full_hi = lo.end;  // their intersection
  const std::int64_t draft0 = p.tree_mask ? std::int64_t(s_k) - s_q : INT64_MAX;

  // Split `split` takes key tiles t_begin, t_begin + t_step, ... < t_end: interleaved
  // (t_step = splits), so the blocks of a sequence stream through one region of the cache
  // together (DRAM locality), or contiguous ranges (t_step = 1).
  std::int64_t t_begin = 0, t_end = 0, t_step = 1;
  if (ke > kb) {
    const std::int64_t t0 = kb / kBlockN, t1 = (ke + kBlockN - 1) / kBlockN;
    const std::int64_t n = t1 - t0;
    if (a.interleave) {
      t_begin = t0 + split;
      t_end = t1;
      t_step = a.splits;
    } else {
      t_begin = t0 + n * split / a.splits;
      t_end = t0 + n * (split + 1) / a.splits;
    }
  }

  // ---- per-row facts for this thread's two packed rows (relative to r0): gq and gq + 8 in
  // the 16-row form (MMA rows), 2 tq and 2 tq + 1 in the transposed one (MMA columns)
  auto my_row = [&](int hf) { return kT8 ? 2 * tq + hf : gq + 8 * hf; };
  int row_i[2], row_jb[2], row_je[2];
  float row_slope[2];
  const std::uint32_t* row_tree[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = r0 + my_row(hf);
    const bool valid = r < nrows;
    const int i = valid ? r / h_ratio : i_lo;
    row_i[hf] = i;
    const semantics::KeyRange kr = semantics::visible_keys(i, s_q, s_k, p.mask);
    row_jb[hf] = valid ? static_cast<int>(kr.begin) : 0;
    row_je[hf] = valid ? static_cast<int>(kr.end) : 0;
    row_slope[hf] = valid ? p.alibi_slope(b, g_kv * h_ratio + r % h_ratio) : 0.0f;
    row_tree[hf] = p.tree_mask ? p.tree_mask + std::int64_t(b) * p.tree_batch_stride +
                                     std::int64_t(i) * p.tree_row_stride
                               : nullptr;
  }

  // ---- K/V tile loader: load_tile(tile, stage, prefetch_next), zero_tail, table_ids, pf_blk
#include "cuda/sm80/decode_kernel_loaders.inc"

  // ---- scores
  const bool plain = p.softcap == 0.0f && p.alibi_slopes == nullptr;
  float k_head_scale = 1.0f, v_head_scale = 1.0f;
  if constexpr (kFp8) {
    if (a.q_fp8) {
      // FlashAttention-3's descales of (sequence b, KV head g_kv), [b, h_k] contiguous,
      // null = 1: q's and k's scale the scores, v's the output.
      const std::int64_t ds = std::int64_t(b) * p.h_k + g_kv;
      if (p.q_descale != nullptr) k_head_scale = p.q_descale[ds];
      if (p.k_scale != nullptr) k_head_scale *= p.k_scale[ds];
      if (p.v_scale != nullptr) v_head_scale = p.v_scale[ds];
    } else if (!per_key_scale) {
      k_head_scale = p.k_scale[g_kv];
      v_head_scale = p.v_scale[g_kv];
    }
  }
  const float scale_log2 = p.scale * k_head_scale * kLog2e;  // plain path
  const float dot_scale = p.scale * k_head_scale;            // softcap / ALiBi path

  // Score x of this thread's packed row hf with key j0 + kl of the tile, in log2 units
  // (softmax scale, per-key fp8 scale, softcap, ALiBi), -inf where masked (skipped for a
  // tile that every row sees whole: full).
  auto score = [&](float x, int kl, int hf, std::int64_t j0, bool full, const float* kss) {
    const std::int64_t j = j0 + kl;
    if constexpr (kFp8) {
      if (per_key_scale) x *= kss[kl];
    }
    if (plain) {
      x *= scale_log2;
    } else {
      x *= dot_scale;
      if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
      if (row_slope[hf] != 0.0f) {
        std::int64_t dist = std::int64_t(row_i[hf]) + s_k - s_q - j;
        if (dist < 0) dist = -dist;
        x -= row_slope[hf] * static_cast<float>(dist);
      }
      x *= kLog2e;
    }
    if (!full) {
      bool vis = j >= row_jb[hf] && j < row_je[hf];
      if (vis && j >= draft0) {
        const std::int64_t t = j - draft0;
        vis = (row_tree[hf][t >> 5] >> (t & 31)) & 1u;
      }
      if (!vis) x = -INFINITY;
    }
    return x;
  };

  // O (16 rows x kVCols: kOTiles 8-dim tiles) or, kT8, O^T (kVCols x 8 rows: 16-dim tiles),
  // the columns col0 .. col0 + kVCols.
  constexpr int kOAcc = kT8 ? kVCols / 16 : kOTiles;
  float o[kOAcc][4];
#pragma unroll
  for (int nt = 0; nt < kOAcc; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  // Prologue (the mbarriers were initialised before the grid wait).
  // A paged cache's block ids of every prologue tile, loaded together (not one tile's
  // load after the other's copies), then those of the first tile of the main loop.
  int pro_blk[Tr::kStages - 1][kBoxesPerWarp];
  if (tma && lane == 0 && btab) {
#pragma unroll
    for (int st = 0; st < Tr::kStages - 1; ++st) table_ids(t_begin + st * t_step, pro_blk[st]);
  }
  __syncthreads();  // barriers initialised
#pragma unroll
  for (int st = 0; st < Tr::kStages - 1; ++st) {
    if (tma && btab) {
#pragma unroll
      for (int q = 0; q < kBoxesPerWarp; ++q) pf_blk[q] = pro_blk[st][q];
    }
    if (t_begin + st * t_step < t_end) load_tile(t_begin + st * t_step, st, st == Tr::kStages - 2);
    cp_async_commit();
  }
  // q: 16 packed rows into shared memory (as the MMA element type), while the first K/V
  // tiles are on their way.
  if (kFp8 && a.q_fp8) {
    // fp8 q: 8 e4m3 bytes a chunk (8-byte aligned: c % 8 == 0 and 16-byte aligned rows),
    // converted to f16 exactly. (A loop of its own: one loop with both loads spilled 8 more
    // bytes in the 16-bit-q fp8 kernel at d = 128.)
    constexpr int kQChunks = Tr::kRows * kHeadDim / 8;
    const auto* qbase = static_cast<const unsigned char*>(p.q) + p.q_offset(b);
    for (int idx = tid; idx < kQChunks; idx += Tr::kThreads) {
      const int rr = idx / (kHeadDim / 8), c = (idx % (kHeadDim / 8)) * 8;
      const int r = r0 + rr;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nrows && c < p.d) {
        const int i = r / h_ratio, h = g_kv * h_ratio + r % h_ratio;
        const uint2 e = *reinterpret_cast<const uint2*>(qbase + std::int64_t(i) * p.q_row_stride +
                                                        std::int64_t(h) * p.q_head_stride + c);
        v = make_uint4(e4m3x2_lo_to_f16x2(e.x), e4m3x2_hi_to_f16x2(e.x), e4m3x2_lo_to_f16x2(e.y),
                       e4m3x2_hi_to_f16x2(e.y));
      }
      *reinterpret_cast<uint4*>(q_smem + rr * Tr::kQRowBytes + c * 2) = v;
    }
  } else {
    constexpr int kQChunks = Tr::kRows * kHeadDim / 8;
    const auto* qbase = static_cast<const std::uint16_t*>(p.q) + p.q_offset(b);
    for (int idx = tid; idx < kQChunks; idx += Tr::kThreads) {
      const int rr = idx / (kHeadDim / 8), c = (idx % (kHeadDim / 8)) * 8;
      const int r = r0 + rr;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nrows && c < p.d) {
        const int i = r / h_ratio, h = g_kv * h_ratio + r % h_ratio;
        v = *reinterpret_cast<const uint4*>(qbase + std::int64_t(i) * p.q_row_stride +
                                            std::int64_t(h) * p.q_head_stride + c);
        if constexpr (kFp8) {
          if (a.q_bf16) {
            std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float x0 = __uint_as_float(w[k] << 16), x1 = __uint_as_float(w[k] & 0xffff0000u);
              w[k] = pack2<__half>(x0, x1);
            }
            v = make_uint4(w[0], w[1], w[2], w[3]);
          }
        }
      }
      *reinterpret_cast<uint4*>(q_smem + rr * Tr::kQRowBytes + c * 2) = v;
    }
  }

  __syncthreads();  // q in shared memory

  std::uint32_t qf[kQInRegs ? kKSteps : 1][4];
  auto q_frag = [&](int s, std::uint32_t (&f)[4]) {
    const unsigned char* q0 = q_smem + gq * Tr::kQRowBytes;
    const unsigned char* q1 = q0 + 8 * Tr::kQRowBytes;
    if constexpr (kFp8) {
      const int c = 16 * s + 4 * tq;
      f[0] = *reinterpret_cast<const std::uint32_t*>(q0 + c * 2);
      f[1] = *reinterpret_cast<const std::uint32_t*>(q1 + c * 2);
      f[2] = *reinterpret_cast<const std::uint32_t*>(q0 + c * 2 + 4);
      f[3] = *reinterpret_cast<const std::uint32_t*>(q1 + c * 2 + 4);
    } else {
      const int c = 16 * s + 2 * tq;
      f[0] = *reinterpret_cast<const std::uint32_t*>(q0 + c * 2);
      f[1] = *reinterpret_cast<const std::uint32_t*>(q1 + c * 2);
      f[2] = *reinterpret_cast<const std::uint32_t*>(q0 + c * 2 + 16);
      f[3] = *reinterpret_cast<const std::uint32_t*>(q1 + c * 2 + 16);
    }
  };
  if constexpr (kQInRegs) {
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) q_frag(s, qf[s]);
  }

  using MmaElement = std::conditional_t<kFp8, __half, Element>;

  int stage = 0;
  std::uint32_t phase = 0;
  for (std::int64_t tile = t_begin; tile < t_end; tile += t_step) {
    const std::int64_t nxt = tile + (Tr::kStages - 1) * t_step;
    int ns = stage + Tr::kStages - 1;
    if (ns >= Tr::kStages) ns -= Tr::kStages;
    cp_async_wait<Tr::kStages - 2>();
    if (tma) {
      mbar_wait(smem_u32(bars + 8 * stage), phase);
      zero_tail(tile, stage);
    }
    // (Filling every stage in the prologue and refilling a stage right after its tile, so
    // that kStages tiles are in flight while a block waits, measured slower on the H200:
    // dense 4k 39.9 -> 40.8 us, fp8 4k 30.8 -> 34.1 us; the first tiles arrived later, not
    // sooner. docs/performance.md, the timeline entry.)
    __syncthreads();  // the tile is in; every warp is done with stage ns (tile - 1)
    if (nxt < t_end) load_tile(nxt, ns, true);
    cp_async_commit();
    const unsigned char* ks = pipe + stage * Tr::kStageBytes;
    const unsigned char* vs = ks + Tr::kTileBytes;
    const float* kss = reinterpret_cast<const float*>(vs + Tr::kTileBytes);
    const float* vss = kss + kBlockN;
    const std::int64_t j0 = tile * kBlockN;
    const bool full = j0 >= full_lo && j0 + kBlockN <= full_hi && j0 + kBlockN <= draft0;

#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      if constexpr (kT8) {
        const int base = (key_warp * kSub + sub) * 16;
        const int m = lane >> 3, lr = lane & 7;
        // S^T for this warp's 16 keys: st[0], st[1] key base + gq, rows 2 tq, 2 tq + 1;
        // st[2], st[3] key base + gq + 8. A = the K fragments of the 16-row form, reordered.
        float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const std::uint32_t kbase = smem_u32(ks);
        if constexpr (kFp8) {
          const LdsmRow krow(lay, base + (m & 1) * 8 + lr, m >> 1);
#pragma unroll
          for (int s2 = 0; s2 < kHeadDim / 32; ++s2) {
            std::uint32_t r[4];
            ldmatrix_x4(kbase + krow.at(s2), r);
            std::uint32_t qa[4], qb[4];
            if constexpr (kQInRegs) {
#pragma unroll
              for (int k = 0; k < 4; ++k) qa[k] = qf[2 * s2][k], qb[k] = qf[2 * s2 + 1][k];
            } else {
              q_frag(2 * s2, qa);
              q_frag(2 * s2 + 1, qb);
            }
            const std::uint32_t k0[4] = {e4m3x2_lo_to_f16x2(r[0]), e4m3x2_lo_to_f16x2(r[1]),
                                         e4m3x2_hi_to_f16x2(r[0]), e4m3x2_hi_to_f16x2(r[1])};
            mma_m16n8k16<__half>(st, k0, qa[0], qa[2]);
            const std::uint32_t k1[4] = {e4m3x2_lo_to_f16x2(r[2]), e4m3x2_lo_to_f16x2(r[3]),
                                         e4m3x2_hi_to_f16x2(r[2]), e4m3x2_hi_to_f16x2(r[3])};
            mma_m16n8k16<__half>(st, k1, qb[0], qb[2]);
          }
        } else {
          const LdsmRow krow(lay, base + (m >> 1) * 8 + lr, m & 1);
#pragma unroll
          for (int s = 0; s < kKSteps; ++s) {
            std::uint32_t r[4];
            ldmatrix_x4(kbase + krow.at(s), r);
            std::uint32_t qa[4];
            if constexpr (kQInRegs) {
#pragma unroll
              for (int k = 0; k < 4; ++k) qa[k] = qf[s][k];
            } else {
              q_frag(s, qa);
            }
            const std::uint32_t kf[4] = {r[0], r[2], r[1], r[3]};
            mma_m16n8k16<MmaElement>(st, kf, qa[0], qa[2]);
          }
        }
        // Scores in log2 units, masked (element e: key base + gq + 8 (e / 2), row e % 2).
#pragma unroll
        for (int e = 0; e < 4; ++e) st[e] = score(st[e], base + gq + 8 * (e >> 1), e & 1, j0, full, kss);
        // Online softmax per row (a row's 16 keys lie in the 8 lanes of one tq).
        float pr[4], alpha[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float mx = fmaxf(st[hf], st[2 + hf]);
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float m_new = fmaxf(row_max[hf], mx);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          alpha[hf] = fast_exp2(row_max[hf] - m_use);
          row_max[hf] = m_new;
          pr[hf] = fast_exp2(st[hf] - m_use);
          pr[2 + hf] = fast_exp2(st[2 + hf] - m_use);
          row_sum[hf] = row_sum[hf] * alpha[hf] + pr[hf] + pr[2 + hf];
        }
        if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
          for (int t = 0; t < kOAcc; ++t) {
            o[t][0] *= alpha[0];
            o[t][1] *= alpha[1];
            o[t][2] *= alpha[0];
            o[t][3] *= alpha[1];
          }
        }
        if constexpr (kFp8) {
          if (per_key_scale) {
#pragma unroll
            for (int e = 0; e < 4; ++e) pr[e] *= vss[base + gq + 8 * (e >> 1)];
          }
        }
        // P^T as the B operand: each 8 x 8 half (keys x rows) transposed across the warp.
        const std::uint32_t pb0 = movmatrix_trans(pack2<MmaElement>(pr[0], pr[1]));
        const std::uint32_t pb1 = movmatrix_trans(pack2<MmaElement>(pr[2], pr[3]));
        // O^T += V^T P^T: A = the V fragments of the 16-row form, reordered (fp8: one
        // permute per pair of halves; tile t's rows gq / gq + 8 are dims 16 t + 2 gq and
        // 16 t + 2 gq + 1, undone at the store).
        const std::uint32_t vbase = smem_u32(vs);
        const LdsmRow vr(lay, base + (m & 1) * 8 + lr, m >> 1);
        if constexpr (kFp8) {
#pragma unroll
          for (int cc = 0; cc < kVCols / 32; ++cc) {
            std::uint32_t r[4];
            ldmatrix_x4_trans(vbase + vr.at(col0 / 32 + cc), r);
#pragma unroll
            for (int hv = 0; hv < 2; ++hv) {
              const std::uint32_t w0 = __byte_perm(r[2 * hv], r[2 * hv + 1], 0x6420);
              const std::uint32_t w1 = __byte_perm(r[2 * hv], r[2 * hv + 1], 0x7531);
              const std::uint32_t vf[4] = {e4m3x2_lo_to_f16x2(w0), e4m3x2_lo_to_f16x2(w1), e4m3x2_hi_to_f16x2(w0),
                                           e4m3x2_hi_to_f16x2(w1)};
              mma_m16n8k16<__half>(o[2 * cc + hv], vf, pb0, pb1);
            }
          }
        } else {
#pragma unroll
          for (int c = 0; c < kVCols / 16; ++c) {
            std::uint32_t r[4];
            ldmatrix_x4_trans(vbase + vr.at(col0 / 16 + c), r);
            const std::uint32_t vf[4] = {r[0], r[2], r[1], r[3]};
            mma_m16n8k16<MmaElement>(o[c], vf, pb0, pb1);
          }
        }
      } else {
        const int base = (key_warp * kSub + sub) * 16;
        // (S in two pairs of accumulators, even and odd 16-dim steps, to halve the MMA
        // dependency chain measured no faster on the H200: fp8 32k 191.4 against 186.2 us,
        // bf16 256.2 against 255.8.)
        float sacc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.0f;
        const int m = lane >> 3, lr = lane & 7;
        if constexpr (kFp8) {
          const std::uint32_t kbase = smem_u32(ks);
          const LdsmRow krow(lay, base + (m & 1) * 8 + lr, m >> 1);
#pragma unroll
          for (int s2 = 0; s2 < kHeadDim / 32; ++s2) {
            std::uint32_t r[4];
            ldmatrix_x4(kbase + krow.at(s2), r);
            std::uint32_t qa[4], qb[4];
            if constexpr (kQInRegs) {
#pragma unroll
              for (int k = 0; k < 4; ++k) qa[k] = qf[2 * s2][k], qb[k] = qf[2 * s2 + 1][k];
            } else {
              q_frag(2 * s2, qa);
              q_frag(2 * s2 + 1, qb);
            }
            mma_m16n8k16<__half>(sacc[0], qa, e4m3x2_lo_to_f16x2(r[0]), e4m3x2_hi_to_f16x2(r[0]));
            mma_m16n8k16<__half>(sacc[1], qa, e4m3x2_lo_to_f16x2(r[1]), e4m3x2_hi_to_f16x2(r[1]));
            mma_m16n8k16<__half>(sacc[0], qb, e4m3x2_lo_to_f16x2(r[2]), e4m3x2_hi_to_f16x2(r[2]));
            mma_m16n8k16<__half>(sacc[1], qb, e4m3x2_lo_to_f16x2(r[3]), e4m3x2_hi_to_f16x2(r[3]));
          }
        } else {
          const std::uint32_t kbase = smem_u32(ks);
          const LdsmRow krow(lay, base + (m >> 1) * 8 + lr, m & 1);
#pragma unroll
          for (int s = 0; s < kKSteps; ++s) {
            std::uint32_t r[4];
            ldmatrix_x4(kbase + krow.at(s), r);
            std::uint32_t qa[4];
            if constexpr (kQInRegs) {
#pragma unroll
              for (int k = 0; k < 4; ++k) qa[k] = qf[s][k];
            } else {
              q_frag(s, qa);
            }
            mma_m16n8k16<MmaElement>(sacc[0], qa, r[0], r[1]);
            mma_m16n8k16<MmaElement>(sacc[1], qa, r[2], r[3]);
          }
        }

        // Scores in log2 units, masked.
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sacc[nt][e] = score(sacc[nt][e], base + nt * 8 + 2 * tq + (e & 1), e >> 1, j0, full, kss);
          }
        }
        // Online softmax (this warp's keys only).
        float pr[2][4], alpha[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float mx = fmaxf(fmaxf(sacc[0][2 * hf], sacc[0][2 * hf + 1]), fmaxf(sacc[1][2 * hf], sacc[1][2 * hf + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(row_max[hf], mx);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          alpha[hf] = fast_exp2(row_max[hf] - m_use);
          row_max[hf] = m_new;
          float sum = row_sum[hf] * alpha[hf];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = fast_exp2(sacc[nt][2 * hf + e] - m_use);
              sum += pv;
              pr[nt][2 * hf + e] = pv;
            }
          }
          row_sum[hf] = sum;
        }
        // O rescale, skipped when no row of the warp saw a new maximum (alpha == 1 exactly):
        // after the first tiles of a long context, nearly always.
        if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
          for (int nt = 0; nt < kOTiles; ++nt) {
            o[nt][0] *= alpha[0];
            o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1];
            o[nt][3] *= alpha[1];
          }
        }
        if constexpr (kFp8) {
          if (per_key_scale) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) pr[nt][e] *= vss[base + nt * 8 + 2 * tq + (e & 1)];
            }
          }
        }
        std::uint32_t pa[4];
        pa[0] = pack2<MmaElement>(pr[0][0], pr[0][1]);
        pa[1] = pack2<MmaElement>(pr[0][2], pr[0][3]);
        pa[2] = pack2<MmaElement>(pr[1][0], pr[1][1]);
        pa[3] = pack2<MmaElement>(pr[1][2], pr[1][3]);

        // O += P V.
        const std::uint32_t vbase = smem_u32(vs);
        const LdsmRow vr(lay, base + (m & 1) * 8 + lr, m >> 1);
        if constexpr (kFp8) {
#pragma unroll
          for (int cc = 0; cc < kVCols / 32; ++cc) {
            std::uint32_t r[4];
            ldmatrix_x4_trans(vbase + vr.at(col0 / 32 + cc), r);
#pragma unroll
            for (int hv = 0; hv < 2; ++hv) {
              // Even bytes of x0 and x1 (w0), odd bytes (w1): one permute per pair of B halves.
              const std::uint32_t w0 = __byte_perm(r[2 * hv], r[2 * hv + 1], 0x6420);
              const std::uint32_t w1 = __byte_perm(r[2 * hv], r[2 * hv + 1], 0x7531);
              mma_m16n8k16<__half>(o[4 * cc + 2 * hv], pa, e4m3x2_lo_to_f16x2(w0), e4m3x2_hi_to_f16x2(w0));
              mma_m16n8k16<__half>(o[4 * cc + 2 * hv + 1], pa, e4m3x2_lo_to_f16x2(w1), e4m3x2_hi_to_f16x2(w1));
            }
          }
        } else {
#pragma unroll
          for (int c = 0; c < kVCols / 16; ++c) {
            std::uint32_t r[4];
            ldmatrix_x4_trans(vbase + vr.at(col0 / 16 + c), r);
            mma_m16n8k16<MmaElement>(o[2 * c], pa, r[0], r[1]);
            mma_m16n8k16<MmaElement>(o[2 * c + 1], pa, r[2], r[3]);
          }
        }
      }
    }
    if (++stage == Tr::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory is reused below

  // ---- merge the warps' (max, sum, O), then store out / lse or the split's partials
#include "cuda/sm80/decode_kernel_epilogue.inc"

  // ---- splits: through the cluster's shared memory (sm90), or the last of this row
  // chunk's splits to arrive merges them, a warp per row
  if constexpr (kHasClusters) {
    if (a.cluster) {
      merge_cluster_rows<Tr::kRows, kHeadDim, Tr::kThreads, kMaxClusterSplits>(
          p, part_o, a.splits, split, out_bf16, p.d, b, g_kv, h_ratio, r0, r_last - r0 + 1, tid);
      return;
    }
  }
  if (a.splits > 1) {
    __shared__ int merges;
    __syncthreads();  // the block's partials are stored
    if (tid == 0) {
      merges = arrive_split(a.ws_count + (std::int64_t(b) * p.h_k + g_kv) * a.row_chunks + chunk, a.splits);
    }
    __syncthreads();
    if (!merges) return;
    for (int r = r0 + warp; r <= r_last; r += Tr::kWarps) {
      const int i = r / h_ratio, h = g_kv * h_ratio + r % h_ratio;
      merge_split_row(p, a, b, h, i, lane, p.d);
    }
  }
}


}  // namespace flashattn::detail::cuda::sm80
