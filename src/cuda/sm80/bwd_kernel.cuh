// The sm80 FlashAttention-2 backward main kernel.
//
// One thread block per (key tile n, KV head g, sequence b). It loads K_n and V_n once and
// walks every (query head of g's GQA group, query tile m) pair that can see the key tile,
// so dK_n and dV_n are summed over the group in registers (fp32) and written once: no
// per-query-head dK/dV workspace and no reduction pass. Per pair:
//   S  = Q_m K_n^T,  dP = dO_m V_n^T                      (warps 2 x 4 over [BM x BN])
//   P  = exp2(S * scale * log2e - lse * log2e)           (scores recomputed from lse)
//   dS = P * (dP * keep / (1 - p) - D) * softcap'        (D = rowsum(dO * O), preprocess)
//   P * keep / (1 - p) and dS go to shared memory as 16-bit tiles, then
//   dV += P_dropped^T dO_m,  dK += dS^T Q_m              (4 warps each, kSplitDkDv; else
//                                                         every warp both, 4 x 2 or 2 x 4)
//   dQ_m += dS K_n                                        (warps 4 x 2 or 2 x 4 over [BM x d])
// with dQ added to the fp32 workspace by red.global.add (or, deterministic, in key-tile
// order behind a per-query-tile counter). All products run on mma.sync m16n8k16 fed by
// ldmatrix(.trans) from swizzled tiles; the element mask runs only on boundary tiles.
// Between the P / dS stores and the products that read them, warps sync in small groups
// (named barriers) where the bucket allows, else all together.
// The 512 bucket (BwdTileConfig::kWide, d or d_v in 264 .. 512) runs the same kernel on
// 32-key tiles: S and dP split over the head dim between warps w and w + 4 (partials
// summed through shared memory, P / dS computed by the lower warp), dQ in column passes,
// and within sm80's shared memory 32-row query tiles (half a dq_accum tile each).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#include "cuda/arch/sm80.cuh"
#include "cuda/collective/smem_layout.cuh"
#include "cuda/collective/tile_copy.cuh"
#include "cuda/collective/warp_gemm.cuh"
#include "core/params.hpp"
#include "flashattn/semantics.hpp"
#include "cuda/sm80/bwd_config.cuh"
#include "cuda/sm80/bwd_launch.hpp"

namespace flashattn::detail::cuda::sm80 {

// 4-byte cp.async (lse and D rows have no 16-byte alignment); zero-fills when !valid.
__device__ __forceinline__ void cp_async_4(std::uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}

#if __CUDA_ARCH__ >= 900
// Four 8 x 8 16-bit matrices to shared memory; register k holds matrix k in the mma
// fragment layout (lane l: row l / 4, columns 2 (l % 4), +1), lane l addresses row l % 8 of
// matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t addr, std::uint32_t r0, std::uint32_t r1,
                                            std::uint32_t r2, std::uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
#endif

// dst[0..3] += v[0..3] in global memory, no result (sm90: one vector reduction).
__device__ __forceinline__ void red_add_f32x4(float* dst, const float (&v)[4]) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v[0]), "f"(v[1]),
               "f"(v[2]), "f"(v[3])
               : "memory");
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) atomicAdd(dst + e, v[e]);
#endif
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// kSparse: the instantiation for block-sparse masks (p.block_kinds), apart so that the
// others keep their registers (with the sparse code in every kernel ptxas spilled 92 / 108 B
// at d = 64 against 4 / 4, sm_90). The key tile lies in one column of mask blocks and each
// query tile in one row (the blocks hold whole tiles, checked at launch); the (query head,
// query tile) pairs of unlisted blocks are skipped (their Q, dO, lse and D never loaded),
// and a key tile that no pair lists loads nothing (dK = dV = 0).
template <typename Element, int kHeadDim, int kSmemLimit, bool kSparse = false>
__device__ __forceinline__ void bwd_main_block(const BwdParams& p, const BwdWorkspace& ws) {
  using Cfg = BwdTileConfig<kHeadDim, kSmemLimit>;
  using TileQ = typename Cfg::TileQ;
  using TileK = typename Cfg::TileK;
  using TileP = typename Cfg::TileP;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kNThreads = Cfg::kNThreads;
  constexpr int kMTs = Cfg::kWarpMsdp / 16, kNTs = Cfg::kWarpNsdp / 8;      // S / dP tiles
  constexpr int kMTkv = Cfg::kWarpNdkv / 16, kNTkv = Cfg::kWarpDdkv / 8;  // dK / dV tiles
  constexpr int kMTdq = Cfg::kWarpMdq / 16, kNTdq = Cfg::kWarpDdq / 8;    // dQ tiles
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(1024) unsigned char smem[];
  const int n_block = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int s_q = p.seq_len_q(b);
  const int s_k = p.seq_len_k(b);
  // Rows of dk / dv this sequence owns; keys in [s_k, len_k) (seqused_k) get zeros.
  const int len_k = p.stored_len_k(b);
  const int n0 = n_block * kBlockN;
  if (n0 >= len_k) return;
  const int diag_off = s_k - s_q;  // query i's diagonal key is i + diag_off

  // Query tiles [m_begin, m_end) holding a row that sees a key of this tile (block-sparse:
  // every query tile, the listed ones taken below; a full block ignores the window).
  int m_begin = 0, m_end = 0;
  if (kSparse) {
    if (n0 < s_k && s_q > 0) m_end = (s_q + kBlockM - 1) / kBlockM;
  } else if (n0 < s_k && s_q > 0) {
    const int n1 = min(n0 + kBlockN, s_k);
    int row_lo = p.mask.right >= 0 ? n0 - p.mask.right - diag_off : 0;
    int row_hi = p.mask.left >= 0 ? n1 + p.mask.left - diag_off : s_q;
    row_lo = max(row_lo, 0);
    row_hi = min(row_hi, s_q);
    if (row_lo < row_hi) {
      m_begin = row_lo / kBlockM;
      m_end = (row_hi + kBlockM - 1) / kBlockM;
    }
  }
  const int num_m = m_end - m_begin;
  int n_iter = num_m * p.h_ratio;
  const int h_begin = kv_head * p.h_ratio;
  // Block-sparse: the kinds of this key tile's column of blocks, one byte per (query head,
  // query block); a query tile's block is tile / q_tiles_per_block.
  const std::uint8_t* const bs_col =
      kSparse ? p.block_kinds + std::int64_t(b) * p.bs_batch_stride + n0 / p.bs_block_k : nullptr;
  const int q_tiles_per_block = kSparse ? p.bs_block_q / kBlockM : 1;
  auto pair_kind = [&](int head, int tile) {
    return static_cast<int>(
        bs_col[std::int64_t(head) * p.bs_head_stride + std::int64_t(tile / q_tiles_per_block) * p.bs_blocks_k]);
  };
  // The pair after (hh, mm), tile-major per head, past the unlisted ones (block-sparse).
  auto advance = [&](int& hh, int& mm) {
    do {
      if (++mm >= m_end) {
        mm = m_begin;
        ++hh;
      }
    } while (kSparse && hh < h_begin + p.h_ratio && pair_kind(hh, mm) == semantics::kBlockSkip);
  };
  int h_first = h_begin, m_first = m_begin;
  if (kSparse && num_m > 0) {
    n_iter = 0;
    for (int hh = h_begin; hh < h_begin + p.h_ratio; ++hh)
      for (int mm = m_begin; mm < m_end; ++mm) n_iter += pair_kind(hh, mm) != semantics::kBlockSkip;
    if (pair_kind(h_first, m_first) == semantics::kBlockSkip) advance(h_first, m_first);
  }
  // Block-sparse element rule of partial blocks: prefix keys (negative read as 0) and the
  // document ids' bases of this sequence.
  int prefix = 0;
  std::int64_t doc_q0 = 0, doc_k0 = 0;
  const bool docs = kSparse && p.doc_ids_q != nullptr;
  if constexpr (kSparse) {
    if (p.prefix_keys != nullptr) prefix = max(0, p.prefix_keys[std::int64_t(b) * p.prefix_batch_stride]);
    if (docs) {
      doc_q0 = p.cu_seqlens_q ? p.q_start(b) : std::int64_t(b) * p.doc_q_batch_stride;
      doc_k0 = p.cu_seqlens_k ? p.k_start(b) : std::int64_t(b) * p.doc_k_batch_stride;
    }
  }
  // Partial blocks take the plain rule (no per-element extras) without prefix and doc ids.
  const bool plain_partial = prefix == 0 && !docs;

  const std::uint32_t s_k_tile = smem_u32(smem);
  const std::uint32_t s_v_tile = s_k_tile + TileK::kBytes;
  const std::uint32_t s_p_tile = s_v_tile + TileK::kBytes;
  const std::uint32_t s_ds_tile = s_p_tile + TileP::kBytes;
  const std::uint32_t s_q_tile0 = s_ds_tile + TileP::kBytes;
  // kSdpSplitK > 1: the S / dP partials of the upper head-dim part, after the stages.
  float* const sdp_partials =
      reinterpret_cast<float*>(smem + 2 * TileK::kBytes + 2 * TileP::kBytes + Cfg::kStages * Cfg::kSmemQdOStage);
  unsigned char* const smem_p = smem + 2 * TileK::kBytes;
  unsigned char* const smem_ds = smem_p + TileP::kBytes;

  const Element* const q_ptr = static_cast<const Element*>(p.q);
  const Element* const do_ptr = static_cast<const Element*>(p.dout);
  const std::int64_t row0_ws = p.cu_seqlens_q ? p.q_start(b) : std::int64_t(b) * p.seqlen_q;

  // Per-sequence bases, read once (varlen offsets come from global memory).
  const Element* const q_seq = q_ptr + p.q_offset(b);
  const Element* const do_seq = do_ptr + p.do_offset(b);
  const float* const lse_seq = p.lse + p.lse_offset(b, 0);
  const float* const dsum_seq = ws.dpsum + row0_ws;
  // Q, dO, lse and D of (query head, query tile) into a stage.
  auto load_q_do = [&](int head, int tile, int stage) {
    const int m0 = tile * kBlockM;
    const std::uint32_t s_dst = s_q_tile0 + stage * Cfg::kSmemQdOStage;
    const int rows = s_q - m0;
    load_tile_async<TileQ, kNThreads>(s_dst, q_seq + head * p.q_head_stride + m0 * p.q_row_stride,
                                      p.q_row_stride, rows, p.d, tid);
    load_tile_async<TileQ, kNThreads>(s_dst + TileQ::kBytes,
                                      do_seq + head * p.do_head_stride + m0 * p.do_row_stride,
                                      p.do_row_stride, rows, p.d_v, tid);
    if (tid < 2 * kBlockM) {
      const int r = tid % kBlockM;
      const float* src = tid < kBlockM ? lse_seq + head * p.lse_head_stride + m0
                                       : dsum_seq + head * ws.rows_total + m0;
      const bool valid = r < rows;
      cp_async_4(s_dst + 2 * TileQ::kBytes + 4 * tid, valid ? src + r : src, valid);
    }
  };

  // dV and dK of the warp's part; split (Cfg::kSplitDkDv): acc_dv is the one product this
  // warp computes (dV for the first half of the warps, dK for the others), acc_dk unused.
  constexpr int kMTdk = Cfg::kSplitDkDv ? 1 : kMTkv, kNTdk = Cfg::kSplitDkDv ? 1 : kNTkv;
  float acc_dk[kMTdk][kNTdk][4];
  float acc_dv[kMTkv][kNTkv][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);

  if (n_iter > 0) {
    const int rows_k = s_k - n0;
    load_tile_async<TileK, kNThreads>(
        s_k_tile, static_cast<const Element*>(p.k) + p.k_offset(b, n0, kv_head), p.k_row_stride,
        rows_k, p.d, tid);
    load_tile_async<TileK, kNThreads>(
        s_v_tile, static_cast<const Element*>(p.v) + p.v_offset(b, n0, kv_head), p.v_row_stride,
        rows_k, p.d_v, tid);
    load_q_do(h_first, m_first, 0);
  }
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  const bool has_softcap = p.softcap > 0.0f;
  const float inv_softcap = has_softcap ? 1.0f / p.softcap : 0.0f;
  const bool has_dropout = p.rng.threshold != 0u;
  const int left = p.mask.left, right = p.mask.right;

  // Warp coordinates in the three products.
  // Split S / dP (kSdpSplitK > 1): warp w computes head-dim part w / kSdpWarps of the warp
  // tile of w % kSdpWarps.
  // (Without a split, the other buckets' code as it was: their registers are tuned to it.)
  int wm_s, wn_s, sdp_part = 0;
  unsigned sdp_warp = 0;
  if constexpr (Cfg::kSdpSplitK > 1) {
    sdp_warp = unsigned(warp) % Cfg::kSdpWarps;
    sdp_part = warp / Cfg::kSdpWarps;
    wm_s = sdp_warp / Cfg::kWarpsNsdp;
    wn_s = sdp_warp % Cfg::kWarpsNsdp;
  } else {
    wm_s = warp / Cfg::kWarpsNsdp;
    wn_s = warp % Cfg::kWarpsNsdp;
  }
  // dK / dV: with named barriers, warp w takes the key slice of its own S / dP keys.
  constexpr bool kNamedBarriers = bwd_named_barriers<Cfg>();
  const unsigned uwarp = warp;  // unsigned: the divisions below are shifts
  const unsigned kv_warp = uwarp % Cfg::kKvWarps;  // the warp's index in its product
  const bool dv_warp = uwarp < Cfg::kKvWarps;      // split: this warp computes dV (else dK)
  int wn_kv = kv_warp / Cfg::kWarpsDdkv, wd_kv = kv_warp % Cfg::kWarpsDdkv;
  if constexpr (kNamedBarriers) {
    wn_kv = bwd_key_group<Cfg>(uwarp);
    wd_kv = bwd_key_group_part<Cfg>(uwarp);
  }
  const int wm_dq = uwarp / Cfg::kWarpsDdq, wd_dq = uwarp % Cfg::kWarpsDdq;
  const int g8 = lane >> 2, t4 = lane & 3;

  // (query head, query tile) of this pair and of the next, walked tile-major per head.
  int h = h_first, m_block = m_first;
  for (int it = 0; it < n_iter; ++it) {
    const int stage = Cfg::kStages == 2 ? (it & 1) : 0;
    int h_next, m_block_next;
    if constexpr (kSparse) {
      h_next = h;
      m_block_next = m_block;
      advance(h_next, m_block_next);
    } else {
      const bool next_tile_same_head = m_block + 1 < m_end;
      h_next = next_tile_same_head ? h : h + 1;
      m_block_next = next_tile_same_head ? m_block + 1 : m_begin;
    }
    const int m0 = m_block * kBlockM;
    const std::uint32_t s_q_cur = s_q_tile0 + stage * Cfg::kSmemQdOStage;
    const std::uint32_t s_do_cur = s_q_cur + TileQ::kBytes;

    // This pair's Q / dO (the only group in flight) lands; after the barrier every warp
    // is done with the previous pair, so with two stages its buffer takes the next pair,
    // and P / dS may be overwritten.
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (Cfg::kStages == 2) {
      if (it + 1 < n_iter) load_q_do(h_next, m_block_next, stage ^ 1);
      cp_async_commit();
    }
    const float* const s_lse = reinterpret_cast<const float*>(
        smem + (s_q_cur - s_k_tile) + 2 * TileQ::kBytes);
    const float* const s_dsum = s_lse + kBlockM;

    // Block-sparse: the pair's block is full (no rule but the ends of the sequence: window
    // off, `windowed` false) or partial (the call's rule, prefix keys, doc ids). Doc ids
    // are tested once per pair here, one bit per element of the warp's S / dP fragments
    // (bit (mt * kNTs + nt) * 4 + e), before the accumulators are live: read in the
    // element loop they spilled ~100 B more (ptxas sm_90, d = 64).
    bool windowed = true;
    std::uint64_t doc_bits = ~std::uint64_t(0);
    if constexpr (kSparse) {
      static_assert(kMTs * kNTs * 4 <= 64, "one bit per fragment element");
      windowed = pair_kind(h, m_block) != semantics::kBlockFull;
      if (windowed && docs) {
        int doc_row[kMTs][2];
#pragma unroll
        for (int mt = 0; mt < kMTs; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + wm_s * Cfg::kWarpMsdp + mt * 16 + g8 + hf * 8;
            doc_row[mt][hf] = i < s_q ? p.doc_ids_q[doc_q0 + i] : 0;  // rows past s_q: masked
          }
        doc_bits = 0;
#pragma unroll
        for (int nt = 0; nt < kNTs; ++nt)
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1) {
            const int j = n0 + wn_s * Cfg::kWarpNsdp + nt * 8 + 2 * t4 + e1;
            if (j >= s_k) continue;  // keys past s_k: masked
            const int doc_key = p.doc_ids_k[doc_k0 + j];
#pragma unroll
            for (int mt = 0; mt < kMTs; ++mt)
#pragma unroll
              for (int hf = 0; hf < 2; ++hf) {
                doc_bits |= std::uint64_t(doc_row[mt][hf] == doc_key) << ((mt * kNTs + nt) * 4 + hf * 2 + e1);
              }
          }
      }
    }

    float acc_s[kMTs][kNTs][4];
    float acc_dp[kMTs][kNTs][4];
    zero_acc(acc_s);
    zero_acc(acc_dp);
    if constexpr (Cfg::kSdpSplitK == 1) {
      warp_gemm<Element, Cfg::kWarpMsdp, Cfg::kWarpNsdp, kHeadDim, false, false, TileQ, TileK, Cfg::kPrefetch>(
          acc_s, s_q_cur, wm_s * Cfg::kWarpMsdp, s_k_tile, wn_s * Cfg::kWarpNsdp, lane);
      warp_gemm<Element, Cfg::kWarpMsdp, Cfg::kWarpNsdp, kHeadDim, false, false, TileQ, TileK, Cfg::kPrefetch>(
          acc_dp, s_do_cur, wm_s * Cfg::kWarpMsdp, s_v_tile, wn_s * Cfg::kWarpNsdp, lane);
    } else {
      // This warp's head-dim part [sdp_part * kSdpK, + kSdpK): whole column blocks of the
      // swizzled tiles, so a base offset (the swizzle of every row is unchanged). A part at
      // or past d (S) or d_v (dP) holds the zero fill only: skipped (warp-uniform).
      const int k0 = sdp_part * Cfg::kSdpK;
      if (k0 < p.d) {
        warp_gemm<Element, Cfg::kWarpMsdp, Cfg::kWarpNsdp, Cfg::kSdpK, false, false, TileQ, TileK, Cfg::kPrefetch>(
            acc_s, s_q_cur + 2u * TileQ::offset(0, k0), wm_s * Cfg::kWarpMsdp, s_k_tile + 2u * TileK::offset(0, k0),
            wn_s * Cfg::kWarpNsdp, lane);
      }
      if (k0 < p.d_v) {
        warp_gemm<Element, Cfg::kWarpMsdp, Cfg::kWarpNsdp, Cfg::kSdpK, false, false, TileQ, TileK, Cfg::kPrefetch>(
            acc_dp, s_do_cur + 2u * TileQ::offset(0, k0), wm_s * Cfg::kWarpMsdp, s_v_tile + 2u * TileK::offset(0, k0),
            wn_s * Cfg::kWarpNsdp, lane);
      }
      // The upper parts hand their partials to the lower warp of the same warp tile (lane-
      // major: conflict-free), which adds them in part order (the same sum on every run).
      static_assert(Cfg::kSdpSplitK == 2, "one upper part per warp tile");
      constexpr int kFrag = kMTs * kNTs * 4;
      float* const mine = sdp_partials + sdp_warp * (2 * kFrag * 32) + lane;
      if (sdp_part == 1) {
#pragma unroll
        for (int mt = 0; mt < kMTs; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTs; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int x = (mt * kNTs + nt) * 4 + e;
              mine[x * 32] = acc_s[mt][nt][e];
              mine[(kFrag + x) * 32] = acc_dp[mt][nt][e];
            }
      }
      named_barrier_sync_group<1, 64>(sdp_warp, std::make_integer_sequence<int, Cfg::kSdpWarps>{});
      if (sdp_part == 0) {
#pragma unroll
        for (int mt = 0; mt < kMTs; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTs; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int x = (mt * kNTs + nt) * 4 + e;
              acc_s[mt][nt][e] += mine[x * 32];
              acc_dp[mt][nt][e] += mine[(kFrag + x) * 32];
            }
      }
    }

    // Element mask only when some (i, j) of the tile is invisible (block-sparse: a partial
    // block with prefix keys or doc ids always).
    bool full = m0 + kBlockM <= s_q && n0 + kBlockN <= s_k;
    if (windowed) {
      if (right >= 0) full = full && n0 + kBlockN - 1 <= m0 + diag_off + right;
      if (left >= 0) full = full && n0 >= m0 + kBlockM - 1 + diag_off - left;
      if (kSparse && !plain_partial) full = false;
    }
    const float slope = p.alibi_slope(b, h);
    const bool plain = !has_softcap && slope == 0.0f;
    const std::uint32_t bh = p.dropout_bh(b, h);
    // lse as log2, +inf for rows that see nothing or lie past s_q (so that P = 0), and D.
    float lse2[kMTs][2], dsum[kMTs][2];
#pragma unroll
    for (int mt = 0; mt < kMTs; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = wm_s * Cfg::kWarpMsdp + mt * 16 + g8 + hf * 8;
        const float l = s_lse[r];
        lse2[mt][hf] = (m0 + r >= s_q || l == -INFINITY) ? INFINITY : l * kLog2e;
        dsum[mt][hf] = s_dsum[r];
      }

    // P, dS from S, dP. kGeneral: softcap, ALiBi or dropout; kMasked: a boundary tile.
    // The common cases (plain scores, interior or boundary tile) get their own unrolled
    // copies without per-element branches.
    auto scores_to_p_ds = [&](auto general_tag, auto masked_tag) {
      constexpr bool kGeneral = decltype(general_tag)::value;
      constexpr bool kMasked = decltype(masked_tag)::value;
#pragma unroll
      for (int mt = 0; mt < kMTs; ++mt) {
        // Boundary tiles: the visible keys of rows i0 and i0 + 8 as one interval
        // [vis_lo, vis_hi] (empty past s_q), so an element costs two compares and a
        // select instead of the branchy window test (the masked copy was twice the
        // interior one's instructions, sm_90 SASS).
        int vis_lo[2] = {0, 0}, vis_hi[2] = {0, 0};
        // Block-sparse partial blocks: the prefix keys [0, pre_hi].
        [[maybe_unused]] int pre_hi[2] = {-1, -1};
        if (kMasked) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + wm_s * Cfg::kWarpMsdp + mt * 16 + g8 + hf * 8;
            if constexpr (kSparse) {
              vis_lo[hf] = windowed && left >= 0 ? i + diag_off - left : 0;
              vis_hi[hf] = i >= s_q ? -1 : (windowed && right >= 0 ? min(s_k - 1, i + diag_off + right) : s_k - 1);
              if (windowed) pre_hi[hf] = i >= s_q ? -1 : min(prefix, s_k) - 1;
            } else {
              vis_lo[hf] = left >= 0 ? i + diag_off - left : 0;
              vis_hi[hf] = i >= s_q ? -1 : (right >= 0 ? min(s_k - 1, i + diag_off + right) : s_k - 1);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < kNTs; ++nt) {
          const int i0 = m0 + wm_s * Cfg::kWarpMsdp + mt * 16 + g8;      // i0 & 8 == 0
          const int j0 = n0 + wn_s * Cfg::kWarpNsdp + nt * 8 + 2 * t4;  // even
          semantics::Philox4 rnd{{0u, 0u, 0u, 0u}};
          if (kGeneral && has_dropout) rnd = p.rng.block(bh, i0, j0);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hf = e >> 1;
            const int i = i0 + hf * 8, j = j0 + (e & 1);
            float prob;
            float cap_grad = 1.0f;
            if (!kGeneral) {
              prob = fast_exp2(acc_s[mt][nt][e] * scale_log2 - lse2[mt][hf]);
            } else {
              float x = acc_s[mt][nt][e] * p.scale;
              if (has_softcap) {
                const float capped = p.softcap * tanhf(x * inv_softcap);
                cap_grad = semantics::softcap_grad(capped, p.softcap);
                x = capped;
              }
              if (slope != 0.0f) x += semantics::alibi_bias(slope, i, j, s_q, s_k);
              prob = fast_exp2(x * kLog2e - lse2[mt][hf]);
            }
            float dp = acc_dp[mt][nt][e];
            float row_d = dsum[mt][hf];
            if (kMasked) {
              // semantics::key_visible for a row i < s_q, else nothing. A masked element
              // gets P = 0 and dS = 0 * (0 - 0) by selects, not 0 * (dP - D): a NaN dO row
              // (dP, D) or a NaN value row (dP) must not reach dQ / dK across the mask, nor
              // the keys past s_k (docs/semantics.md, non-finite values).
              bool visible = (j >= vis_lo[hf]) & (j <= vis_hi[hf]);
              if constexpr (kSparse) {
                // Partial blocks: prefix keys, equal doc ids (full blocks: pre_hi -1, all bits).
                visible = (visible | (j <= pre_hi[hf])) & (((doc_bits >> ((mt * kNTs + nt) * 4 + e)) & 1u) != 0);
              }
              prob = visible ? prob : 0.0f;
              dp = visible ? dp : 0.0f;
              row_d = visible ? row_d : 0.0f;
              if (kGeneral) cap_grad = visible ? cap_grad : 1.0f;  // a NaN score's tanh'
            }
            float prob_dropped = prob;
            if (kGeneral && has_dropout) {
              const bool keep = rnd.x[e] >= p.rng.threshold;
              dp = keep ? dp * p.rp_dropout : 0.0f;
              prob_dropped = keep ? prob * p.rp_dropout : 0.0f;
            }
            if (kGeneral) {
              acc_dp[mt][nt][e] = prob * (dp - row_d) * cap_grad;  // dS
            } else {
              acc_dp[mt][nt][e] = prob * (dp - row_d);
            }
            acc_s[mt][nt][e] = prob_dropped;
          }
#if __CUDA_ARCH__ >= 900
          // sm90: one stmatrix.x4 per (m16 x n16) of P and of dS once both n8 tiles are
          // done. Matrix q of the four: rows + 8 * (q & 1), columns + 8 * (q >> 1), i.e.
          // the registers (nt-1: c0c1, c2c3; nt: c0c1, c2c3) of the mma C layout; lane l
          // gives the address of row l % 8 of matrix l / 8 (a whole 16-byte chunk, which
          // the swizzle keeps together).
          if (nt % 2 == 1) {
            const int q = lane >> 3;
            const int r = wm_s * Cfg::kWarpMsdp + mt * 16 + (q & 1) * 8 + (lane & 7);
            const int c = wn_s * Cfg::kWarpNsdp + (nt - 1) * 8 + (q >> 1) * 8;
            const std::uint32_t off = 2u * TileP::offset(r, c);
            stmatrix_x4(s_p_tile + off, pack2<Element>(acc_s[mt][nt - 1][0], acc_s[mt][nt - 1][1]),
                        pack2<Element>(acc_s[mt][nt - 1][2], acc_s[mt][nt - 1][3]),
                        pack2<Element>(acc_s[mt][nt][0], acc_s[mt][nt][1]),
                        pack2<Element>(acc_s[mt][nt][2], acc_s[mt][nt][3]));
            stmatrix_x4(s_ds_tile + off,
                        pack2<Element>(acc_dp[mt][nt - 1][0], acc_dp[mt][nt - 1][1]),
                        pack2<Element>(acc_dp[mt][nt - 1][2], acc_dp[mt][nt - 1][3]),
                        pack2<Element>(acc_dp[mt][nt][0], acc_dp[mt][nt][1]),
                        pack2<Element>(acc_dp[mt][nt][2], acc_dp[mt][nt][3]));
          }
#else
          const int r = wm_s * Cfg::kWarpMsdp + mt * 16 + g8;
          const int c = wn_s * Cfg::kWarpNsdp + nt * 8 + 2 * t4;
          *reinterpret_cast<std::uint32_t*>(smem_p + 2 * TileP::offset(r, c)) =
              pack2<Element>(acc_s[mt][nt][0], acc_s[mt][nt][1]);
          *reinterpret_cast<std::uint32_t*>(smem_p + 2 * TileP::offset(r + 8, c)) =
              pack2<Element>(acc_s[mt][nt][2], acc_s[mt][nt][3]);
          *reinterpret_cast<std::uint32_t*>(smem_ds + 2 * TileP::offset(r, c)) =
              pack2<Element>(acc_dp[mt][nt][0], acc_dp[mt][nt][1]);
          *reinterpret_cast<std::uint32_t*>(smem_ds + 2 * TileP::offset(r + 8, c)) =
              pack2<Element>(acc_dp[mt][nt][2], acc_dp[mt][nt][3]);
#endif
        }
      }
    };
    if (Cfg::kSdpSplitK > 1 && sdp_part != 0) {
      // The upper head-dim parts' S / dP are in their lower warps' sums: nothing to store.
    } else if (plain && !has_dropout) {
      if (full) {
        scores_to_p_ds(std::false_type{}, std::false_type{});
      } else {
        scores_to_p_ds(std::false_type{}, std::true_type{});
      }
    } else {
      scores_to_p_ds(std::true_type{}, std::true_type{});
    }
    if constexpr (kNamedBarriers) {
      named_barrier_sync_group<1, 32 * Cfg::kWarpsDdkv>(  // this warp's key group
          wn_kv, std::make_integer_sequence<int, Cfg::kNWarps / Cfg::kWarpsDdkv>{});
    } else {
      __syncthreads();
    }

    // dV += P_dropped^T dO, dK += dS^T Q: A operands are the transposed [BM, BN] tiles.
    if constexpr (Cfg::kWide) {
      // As below; a warp whose columns lie at or past d (dK) or d_v (dV) has nothing to add.
      if (wd_kv * Cfg::kWarpDdkv < (dv_warp ? p.d_v : p.d)) {
        warp_gemm<Element, Cfg::kWarpNdkv, Cfg::kWarpDdkv, kBlockM, true, true, TileP, TileQ, Cfg::kPrefetch>(
            acc_dv, dv_warp ? s_p_tile : s_ds_tile, wn_kv * Cfg::kWarpNdkv, dv_warp ? s_do_cur : s_q_cur,
            wd_kv * Cfg::kWarpDdkv, lane);
      }
    } else if constexpr (Cfg::kSplitDkDv) {  // one product per warp: operands by the warp's role
      warp_gemm<Element, Cfg::kWarpNdkv, Cfg::kWarpDdkv, kBlockM, true, true, TileP, TileQ, Cfg::kPrefetch>(
          acc_dv, dv_warp ? s_p_tile : s_ds_tile, wn_kv * Cfg::kWarpNdkv, dv_warp ? s_do_cur : s_q_cur,
          wd_kv * Cfg::kWarpDdkv, lane);
    } else {
      warp_gemm<Element, Cfg::kWarpNdkv, Cfg::kWarpDdkv, kBlockM, true, true, TileP, TileQ, Cfg::kPrefetch>(
          acc_dv, s_p_tile, wn_kv * Cfg::kWarpNdkv, s_do_cur, wd_kv * Cfg::kWarpDdkv, lane);
      warp_gemm<Element, Cfg::kWarpNdkv, Cfg::kWarpDdkv, kBlockM, true, true, TileP, TileQ, Cfg::kPrefetch>(
          acc_dk, s_ds_tile, wn_kv * Cfg::kWarpNdkv, s_q_cur, wd_kv * Cfg::kWarpDdkv, lane);
    }

    if constexpr (Cfg::kStages == 1) {
      __syncthreads();  // Q and dO consumed: refill them while dQ is computed
      if (it + 1 < n_iter) load_q_do(h_next, m_block_next, 0);
      cp_async_commit();
    }

    // dQ_m += dS K_n. (With one stage the barrier above already ordered every warp.)
    if constexpr (kNamedBarriers && Cfg::kStages == 2) {
      constexpr int kKeyGroups = Cfg::kNWarps / Cfg::kWarpsDdkv;
      named_barrier_sync_group<1 + kKeyGroups, 32 * Cfg::kWarpsNsdp>(  // its row group
          wm_s, std::make_integer_sequence<int, Cfg::kNWarps / Cfg::kWarpsNsdp>{});
    }
    unsigned* sem = nullptr;
    if constexpr (Cfg::kWide) {
      // Column passes of kDqCols over one row pass. Deterministic mode: as below, with the
      // counter of the 64-row workspace tile holding m0; a 32-row query tile (kHalfTiles) is
      // half of one, and a key tile visits the halves of one workspace tile in consecutive
      // pairs (per head, tile by tile), so it waits at its first visit of the workspace tile
      // and counts itself at its last: its contributions to both halves stay in order.
      bool ws_first = true, ws_last = true;
      if constexpr (Cfg::kHalfTiles) {
        ws_first = m_block == m_begin || m0 % kBwdBlockM == 0;
        ws_last = m_block + 1 == m_end || (m0 + kBlockM) % kBwdBlockM == 0;
      }
      const int dq_row0 = m0 + wm_dq * Cfg::kWarpMdq;  // the warp's 32 rows, in one workspace tile
      float* const dq_warp = ws.dq_accum + dq_accum_tile(ws, b, dq_row0 / kBwdBlockM, h, p.h_q, p.d) +
                             dq_accum_index(dq_row0 % kBwdBlockM, wd_dq * Cfg::kWarpDdq) + lane * 4;
      constexpr int kFragmentsPerSlab = kBwdBlockM / 16;
#pragma unroll
      for (int cpass = 0; cpass < Cfg::kDqColPasses; ++cpass) {
        const int c0 = cpass * Cfg::kDqCols;
        if (c0 >= p.d) break;  // the bucket's columns past d (block-uniform)
        float acc_dq[kMTdq][kNTdq][4];
        zero_acc(acc_dq);
        warp_gemm<Element, Cfg::kWarpMdq, Cfg::kWarpDdq, kBlockN, false, true, TileP, TileK, Cfg::kPrefetch>(
            acc_dq, s_ds_tile, wm_dq * Cfg::kWarpMdq, s_k_tile, c0 + wd_dq * Cfg::kWarpDdq, lane);
        if (cpass == 0 && p.deterministic) {
          sem = ws.dq_sem + (std::int64_t(b) * p.h_q + h) * ws.m_blocks + m0 / kBwdBlockM;
          if (ws_first) {
            if (tid == 0) {
              const int m0_ws = m0 - m0 % kBwdBlockM;
              const int first_key = left >= 0 ? max(0, m0_ws + diag_off - left) : 0;
              const unsigned target = static_cast<unsigned>(n_block - first_key / kBlockN);
              while (ld_acquire_gpu(sem) != target) __nanosleep(32);
            }
            __syncthreads();
          }
        }
        if (dq_row0 < s_q) {
#pragma unroll
          for (int nt = 0; nt < kNTdq; ++nt) {
            if (c0 + wd_dq * Cfg::kWarpDdq + nt * 8 >= p.d) continue;  // head-dim padding of the bucket
#pragma unroll
            for (int mt = 0; mt < kMTdq; ++mt) {
              red_add_f32x4(dq_warp + ((c0 / 8 + nt) * kFragmentsPerSlab + mt) * 128, acc_dq[mt][nt]);
            }
          }
        }
      }
      if (p.deterministic && ws_last) {
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(sem, 1u);
      }
    } else {
#pragma unroll
      for (int pass = 0; pass < Cfg::kDqPasses; ++pass) {
        const int r0 = pass * Cfg::kDqRows;  // the pass's first row in the tile
        if (Cfg::kDqPasses > 1 && m0 + r0 >= s_q) break;  // no rows left (block-uniform)
        float acc_dq[kMTdq][kNTdq][4];
        zero_acc(acc_dq);
        warp_gemm<Element, Cfg::kWarpMdq, Cfg::kWarpDdq, kBlockN, false, true, TileP, TileK, Cfg::kPrefetch>(
            acc_dq, s_ds_tile, r0 + wm_dq * Cfg::kWarpMdq, s_k_tile, wd_dq * Cfg::kWarpDdq, lane);

        if (pass == 0 && p.deterministic) {
          // Key tiles add to a query tile in ascending order: this one is the
          // (n_block - first)-th of the contiguous run of tiles that see query tile m. Every
          // key tile that visits a query tile adds to all of its workspace tiles, so the
          // counter of the first one orders them all.
          sem = ws.dq_sem + (std::int64_t(b) * p.h_q + h) * ws.m_blocks +
                m_block * Cfg::kWorkspaceTilesPerM;
          if (tid == 0) {
            unsigned target;
            if constexpr (kSparse) {
              // Block-sparse: the key tiles that visit (h, m) are those of its listed blocks
              // (all below s_k ahead of this one), so this one is preceded by the tiles of
              // the listed blocks left of its block and those of its block left of it.
              const std::uint8_t* const row = bs_col - n0 / p.bs_block_k +
                                              std::int64_t(h) * p.bs_head_stride +
                                              std::int64_t(m_block / q_tiles_per_block) * p.bs_blocks_k;
              const int tiles_per_block = p.bs_block_k / kBlockN;
              const int nb = n0 / p.bs_block_k;
              int listed = 0;
              for (int x = 0; x < nb; ++x) listed += row[x] != semantics::kBlockSkip;
              target = static_cast<unsigned>(listed * tiles_per_block + n_block % tiles_per_block);
            } else {
              const int first_key = left >= 0 ? max(0, m0 + diag_off - left) : 0;
              target = static_cast<unsigned>(n_block - first_key / kBlockN);
            }
            while (ld_acquire_gpu(sem) != target) __nanosleep(32);
          }
          __syncthreads();
        }
        // The warp's rows [m0 + r0 + wm_dq * kWarpMdq, + kWarpMdq) lie in one 64-row
        // workspace tile; a warp whose rows all lie past s_q skips (that tile may not exist
        // when the last 128-row query tile has fewer than 65 rows).
        const int dq_row0 = m0 + r0 + wm_dq * Cfg::kWarpMdq;
        if (dq_row0 < s_q) {
          // Fragment (row slab, column slab) of the tile: 128 floats, this lane's four at
          // lane * 4. Rows past s_q add the zeros their dS rows hold; slabs past d do not
          // exist. Fragment (r / 16, c / 8) starts at dq_accum_index(r, c) = 128 * fragment
          // for r % 16 == 0, c % 8 == 0, linear in both steps: one base pointer per warp and
          // compile-time offsets (immediates of the red instruction).
          constexpr int kFragmentsPerSlab = kBwdBlockM / 16;  // fragments of one 8-column slab
          float* const dq_warp =
              ws.dq_accum + dq_accum_tile(ws, b, dq_row0 / kBwdBlockM, h, p.h_q, p.d) +
              dq_accum_index(dq_row0 % kBwdBlockM, wd_dq * Cfg::kWarpDdq) + lane * 4;
#pragma unroll
          for (int nt = 0; nt < kNTdq; ++nt) {
            if (wd_dq * Cfg::kWarpDdq + nt * 8 >= p.d) continue;  // head-dim padding of the bucket
#pragma unroll
            for (int mt = 0; mt < kMTdq; ++mt) {
              red_add_f32x4(dq_warp + (nt * kFragmentsPerSlab + mt) * 128, acc_dq[mt][nt]);
            }
          }
        }
      }
      if (p.deterministic) {
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(sem, 1u);
      }
    }
    h = h_next;
    m_block = m_block_next;
  }
  cp_async_wait<0>();

  // Epilogue: dK (times scale) and dV in the output type; rows past s_k (seqused_k) are
  // zero, not their accumulators: a NaN q / dO row times the keys' masked dS = 0 / P = 0 is
  // NaN there.
  Element* const dk_ptr = static_cast<Element*>(p.dk);
  Element* const dv_ptr = static_cast<Element*>(p.dv);
#pragma unroll
  for (int mt = 0; mt < kMTkv; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTkv; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int j = n0 + wn_kv * Cfg::kWarpNdkv + mt * 16 + g8 + hf * 8;
        const int c = wd_kv * Cfg::kWarpDdkv + nt * 8 + 2 * t4;
        // Columns of the bucket past d (dK) or d_v (dV) are not stored.
        if (j < len_k) {
          const bool key = j < s_k;
          auto out2 = [&](float x0, float x1, float sc) {
            return pack2<Element>(key ? x0 * sc : 0.0f, key ? x1 * sc : 0.0f);
          };
          if constexpr (Cfg::kSplitDkDv) {
            const float sc = dv_warp ? 1.0f : p.scale;
            Element* const dst = dv_warp ? dv_ptr + p.dv_offset(b, j, kv_head) : dk_ptr + p.dk_offset(b, j, kv_head);
            if (c < (dv_warp ? p.d_v : p.d)) {
              *reinterpret_cast<std::uint32_t*>(dst + c) = out2(acc_dv[mt][nt][2 * hf], acc_dv[mt][nt][2 * hf + 1], sc);
            }
          } else {
            if (c < p.d) {
              *reinterpret_cast<std::uint32_t*>(dk_ptr + p.dk_offset(b, j, kv_head) + c) =
                  out2(acc_dk[mt][nt][2 * hf], acc_dk[mt][nt][2 * hf + 1], p.scale);
            }
            if (c < p.d_v) {
              *reinterpret_cast<std::uint32_t*>(dv_ptr + p.dv_offset(b, j, kv_head) + c) =
                  out2(acc_dv[mt][nt][2 * hf], acc_dv[mt][nt][2 * hf + 1], 1.0f);
            }
          }
        }
      }
}

}  // namespace flashattn::detail::cuda::sm80
