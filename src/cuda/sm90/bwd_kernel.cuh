// The sm90a backward main kernel: warp-specialized, TMA-fed, wgmma-computed.
//
// One thread block per (key tile n, KV head g, sequence b): K_n and V_n stay in shared
// memory while the block walks every (query head of g's group, query tile m) pair that
// can see the key tile, so dK_n and dV_n are summed over the GQA group in registers and
// written once. kConsumers + 1 warpgroups:
//   warpgroup 0, the producer: one warp copies K_n and V_n once, then Q_m and dO_m of each
//     pair by TMA into a kStages-deep ring, with lse_m and D_m (rowsum(dO * O), from the
//     preprocess) written by its lanes; each slot guarded by a "full" mbarrier (the TMA
//     bytes and the lanes' arrival) and an "empty" one (the consumers' release).
//   warpgroups 1..kConsumers, the consumers: warpgroup w owns keys 64 w .. 64 w + 63 of the
//     tile and computes, transposed so that every product's A operand is its own:
//       S^T  = K_w Q^T,  dP^T = V_w dO^T                 (wgmma, both operands in smem)
//       P^T  = exp2(S^T * scale * log2 e - lse * log2 e) (lse per column, from smem)
//       dV_w += P^T dO                                   (A = P^T from registers)
//       dS^T = P^T * (dP^T - D)                          (D per column)
//       dK_w += dS^T Q                                   (A = dS^T from registers)
//     dS^T also goes to shared memory (16-bit, the 128-byte swizzle, double-buffered);
//     after a named barrier of the consumers, warpgroup w computes one 64 x 64 block of
//       dQ_m = dS K_n                                    (A = dS read MN-major from smem)
//     and writes it to shared memory in the order of the fp32 workspace
//     (collective/bwd_workspace.hpp: the accumulator fragment order, so a block is one
//     contiguous 16 KB run there), while its dK product runs.
//   The producer's second warp, the dQ writer, adds each block to the workspace with one
//   bulk reduction (cp.reduce.async.bulk .add.f32), so the consumers never wait on global
//   reductions. Named barriers pair each consumer with it: kDqFull + w (block written),
//   kDqEmpty + w (buffer read, may be overwritten). Head dims above 128 (kSplitHd) have
//   no dQ buffers and no writer: their consumers add the dQ block from its accumulators
//   (red.global.add.v4.f32, unordered, so deterministic calls run the sm80 kernel there),
//   and the 64 KB the buffers took hold a second Q / dO stage.
// The epilogue: once both consumers are done with the ring, each stages its 64 rows of dK
// (times the softmax scale) and dV in it (consumer 0 in the Q slots, 1 in the dO slots) and
// one thread stores them by TMA, so the block leaves as soon as the copies have read them;
// slabs with rows past the sequence store from the registers. The softmax scale is applied
// to dK here and to dQ by the postprocess.
// Two fragments of the kernel's text are included in place (not functions: the code they
// compile to must stay that of the inline text): bwd_kernel_producer.inc (the TMA warp and
// the dQ writer) and bwd_kernel_split_hd.inc (the consumers for head dims above 128).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/params.hpp"
#include "cuda/arch/pack.cuh"
#include "cuda/arch/sm90_tma.cuh"
#include "cuda/arch/sm90_wgmma.cuh"
#include "cuda/collective/bwd_workspace.hpp"
#include "cuda/collective/mask.cuh"

namespace flashattn::detail::cuda::sm90 {

// The compile-time shape of one backward kernel: kBlockM query rows per pair, 64 keys per
// consumer warpgroup; each consumer computes one 64 x 64 block of the pair's dQ. Head dims
// above 128 (kSplitHd) split the head dim instead: 64 keys per block, both warpgroups over
// all of them, warpgroup w computing S / dP for keys 32 w .. and dK, dV, dQ for head-dim
// columns 128 w .. (the dK and dV of 64 keys x 256 columns would not fit one warpgroup's
// registers), P and dS going through shared memory.
template <int kHeadDim_, int kBlockM_, int kStages_>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kConsumers = 2;
  static constexpr bool kSplitHd = kHeadDim > 128;
  static constexpr int kBlockN = kSplitHd ? 64 : 64 * kConsumers;
  static constexpr int kDqCols = kSplitHd ? 128 : 64;  // head-dim columns of one consumer's dQ block
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kColBlocks = kHeadDim / 64;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one Q (or dO) tile
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K (or V)
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;   // one dS^T buffer (split: P, then dS)
  static constexpr int kDqFloats = 64 * kDqCols;           // one consumer's fp32 dQ block
  static constexpr int kDqBytes = kDqFloats * 4;
  // dQ staged in shared memory for the writer warp's bulk reductions; the split-hd
  // consumers add theirs from registers instead.
  static constexpr bool kDqStaged = !kSplitHd;
  static constexpr int kBarriers = 2 + 2 * kStages;
  static constexpr int kSmemBytes = 1024 + 2 * kKVBytes + 2 * kStages * kQBytes + 2 * kDsBytes +
                                    (kDqStaged ? kConsumers * kDqBytes : 0) + 2 * kStages * kBlockM * 4 +
                                    8 * kBarriers;
  // FA3's order: dV's product issued after dS^T's shared-memory store, before the dS
  // barrier, so that it runs across the barrier and dQ's issue. On unmasked tiles the
  // exponentials, dS^T, both packs and the store are one basic block (the masked pass is a
  // second copy of it), so ptxas interleaves the 32 MUFU.EX2 (8 cycles apart) with dS^T's
  // arithmetic; with dV issued between them (the order before b6ca380) the exponentials
  // issued back to back with nothing to hide them (docs/notes/bwd_fa3_sass.md). Only where
  // the registers live across dV's issue (S^T, dP^T, dK, dV, P^T's fragments) leave room:
  // ptxas serialised every wgmma of the 128 x 128 hdim-64 tile with dV issued early (224 of
  // 240 live), not hdim 128's 64-row; elsewhere dV is issued after dQ.
  static constexpr bool kDvAtDsStore = kBlockM + kHeadDim + kBlockM / 4 <= 208;
  // dK and dV leave through shared memory and TMA stores (the epilogue): each consumer's
  // 64 key rows of both, 16-bit, staged in the Q / dO ring once every product is done.
  static constexpr bool kTmaStoreDkv = !kSplitHd;
  static constexpr int kDkvSlabBytes = 64 * kHeadDim * 2;  // one consumer's dK (or dV) rows
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0);
  static_assert(kSplitHd ? kBlockM == 64 && kHeadDim == kDqCols * kConsumers
                         : (kBlockM / 64) * (kHeadDim / 64) == kConsumers,
                "one dQ block per consumer");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
                "setmaxnreg: the warpgroups' registers exceed the block's launch allocation");
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(!kTmaStoreDkv || (kConsumers == 2 && 2 * kDkvSlabBytes <= kStages * kQBytes),
                "the epilogue stages consumer 0's dK / dV in the Q ring and consumer 1's in the dO ring");
};

struct BwdArgs {
  CUtensorMap tmap_q;   // {d, rows, h_q, batch}, box rows kBlockM
  CUtensorMap tmap_do;  // like q
  CUtensorMap tmap_k;   // {d, rows, h_k, batch}, box rows kBlockN
  CUtensorMap tmap_v;
  CUtensorMap tmap_dk;  // {d, rows, h_k, batch} like k's, box rows 64 (when dkv_tma)
  CUtensorMap tmap_dv;
  BwdParams p;
  BwdWorkspace ws;
  float scale_log2;  // scale * log2(e)
  bool raw_scores;   // no softcap, no ALiBi: the kRaw kernel
  bool dkv_tma;      // dk and dv take TMA stores (16-byte aligned bases and strides): tmap_dk / tmap_dv are set
};

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ float bwd_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// kRaw: scores are raw dot products (no softcap, no ALiBi); the other instantiation applies
// the score modifiers of semantics::score and the softcap's derivative.
template <class Cfg, typename Element, bool kRaw>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_kernel(const __grid_constant__ BwdArgs args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages;
  constexpr int kSN = kBlockM / 2;   // S^T (and dP^T) accumulator floats per thread
  constexpr int kKN = kHeadDim / 2;  // dK (and dV) accumulator floats per thread
  constexpr int kMK = kBlockM / 16;  // k-steps of the products over the query rows
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kDvAtDsStore = Cfg::kDvAtDsStore && kRaw;
  // Consumer w's dQ block: rows 64 (w / this), columns kDqCols (w % this).
  constexpr int kDqColBlocks = kHeadDim / Cfg::kDqCols;
  constexpr int kDsReady = 1, kDqFull = 2, kDqEmpty = 2 + Cfg::kConsumers;  // named barrier ids
  constexpr int kPdsFree = 2 + 2 * Cfg::kConsumers;  // split: both consumers done with P / dS
  constexpr int kDkvStaged = 3 + 2 * Cfg::kConsumers;  // + w: consumer w's dK / dV rows staged
  const BwdParams& p = args.p;
  const BwdWorkspace& ws = args.ws;

  // Deterministic with a right mask edge: key tiles in reverse launch order, so that the
  // order in which they reach a query tile (last visiting one first, see the dQ writer)
  // is also the order they start in.
  const int n_block = ws.dq_sem != nullptr && p.mask.right >= 0 ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
  const int g = blockIdx.y, b = blockIdx.z;
  const int s_q = p.seq_len_q(b), s_k = p.seq_len_k(b);
  // Rows of dk / dv this sequence owns; keys in [s_k, len_k) (seqused_k) get zeros.
  const int len_k = p.stored_len_k(b);
  const int n0 = n_block * kBlockN;
  if (n0 >= len_k) return;
  const int shift = s_k - s_q;  // query i's diagonal key is i + shift
  // Query tiles [m_begin, m_end) holding a row that sees a key of this tile.
  int m_begin = 0, m_end = 0;
  if (n0 < s_k && s_q > 0) {
    const int n1 = min(n0 + kBlockN, s_k);
    const int row_lo = max(p.mask.right >= 0 ? n0 - p.mask.right - shift : 0, 0);
    const int row_hi = min(p.mask.left >= 0 ? n1 + p.mask.left - shift : s_q, s_q);
    if (row_lo < row_hi) {
      m_begin = row_lo / kBlockM;
      m_end = (row_hi + kBlockM - 1) / kBlockM;
    }
  }
  const int num_m = m_end - m_begin;
  const int n_iter = num_m * p.h_ratio;

  // 1024-aligned for the 128-byte swizzle; offset from the __shared__ array itself (not
  // through an integer) so that the compiler knows every pointer below is shared memory
  // (a generic pointer made the lse / D loads and the dS / dQ stores generic LD / ST: ncu
  // showed them and the proxy fence waiting on them, ~10% of the stall samples).
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sK = smem;
  unsigned char* sV = sK + Cfg::kKVBytes;
  unsigned char* sQ = sV + Cfg::kKVBytes;
  unsigned char* sdO = sQ + kStages * Cfg::kQBytes;
  unsigned char* sdS = sdO + kStages * Cfg::kQBytes;
  float* sdQ = reinterpret_cast<float*>(sdS + 2 * Cfg::kDsBytes);    // [kConsumers][kDqFloats], kDqStaged
  float* sLse = sdQ + (Cfg::kDqStaged ? Cfg::kConsumers * Cfg::kDqFloats : 0);  // [kStages][kBlockM], log2 units
  float* sDsum = sLse + kStages * kBlockM;                           // [kStages][kBlockM]
  auto* bars = reinterpret_cast<std::uint64_t*>(sDsum + kStages * kBlockM);
  std::uint64_t* full_kv = bars;
  std::uint64_t* full = bars + 1;
  std::uint64_t* empty = full + kStages;
  std::uint64_t* tail = empty + kStages;  // the copies of a tile whose tail rows get zeroed

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, wg = warp / 4;
  if (tid == 0) {
    mbar_init(full_kv, 32);
    mbar_init(tail, 1);
    for (int s = 0; s < kStages; ++s) {
      // The TMA bytes' arrival, then each producer lane's after its lse / D stores; each
      // consumer thread's release after its last read of the slot (lse / D included).
      mbar_init(&full[s], 1 + 32);
      mbar_init(&empty[s], 128 * Cfg::kConsumers);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Cfg::kProducerRegs>();
    // The TMA warp and the dQ writer warp (bwd_kernel_producer.inc).
#include "cuda/sm90/bwd_kernel_producer.inc"
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  if constexpr (Cfg::kSplitHd) {
    // Head dims above 128 (bwd_kernel_split_hd.inc).
#include "cuda/sm90/bwd_kernel_split_hd.inc"
  } else {
    const int cw = warp_uniform(wg - 1);  // keys 64 cw .. 64 cw + 63 of the tile
    const int warp_in = warp % 4;
    const int key_in_tile = 64 * cw + 16 * warp_in + lane / 4;  // tile row of half 0
    // The dQ block of this warpgroup: query rows 64 mb.., columns 64 cb..
    const int mb = cw / kDqColBlocks, cb = cw % kDqColBlocks;

    // The queries that see key j, as [lo, hi] (empty past s_k): the mask's column view.
    int vis_lo[2], vis_hi[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = n0 + key_in_tile + 8 * half;
      vis_lo[half] = p.mask.right >= 0 ? j - shift - p.mask.right : 0;
      vis_hi[half] = j >= s_k ? -1 : p.mask.left >= 0 ? min(s_q - 1, j - shift + p.mask.left) : s_q - 1;
    }
    const TileMask tile_mask(s_q, s_k, p.mask);

    float dk[kKN], dv[kKN];
#pragma unroll
    for (int i = 0; i < kKN; ++i) dk[i] = dv[i] = 0.0f;

    if (n_iter > 0) {
      float s[kSN], dp[kSN], dq[32];
      std::uint32_t pa[kMK][4], da[kMK][4];
      const std::uint32_t k_addr = smem_addr(sK), v_addr = smem_addr(sV);
      // Descriptor low words (smem_desc_lo): uniform, one add per k-step.
      const std::uint32_t kw_lo0 = smem_desc_lo(k_addr + cw * 64 * 128, 0);
      const std::uint32_t vw_lo0 = smem_desc_lo(v_addr + cw * 64 * 128, 0);
      const std::uint32_t kq_lo0 = smem_desc_lo(k_addr + cb * kBlockN * 128, kBlockN * 128);
      const float scale_log2 = args.scale_log2;
      mbar_wait(full_kv, 0);
      int h = g * p.h_ratio, m_block = m_begin;
      for (int it = 0; it < n_iter; ++it) {
        const int stage = it % kStages;
        const std::uint32_t phase = (it / kStages) & 1;
        const int m0 = m_block * kBlockM;
        const std::uint32_t q_addr = smem_addr(sQ) + stage * Cfg::kQBytes;
        const std::uint32_t do_addr = smem_addr(sdO) + stage * Cfg::kQBytes;
        unsigned char* const ds_buf = sdS + (it & 1) * Cfg::kDsBytes;
        mbar_wait(&full[stage], phase);
        // The warpgroup's K and V descriptors, opaque to the compiler: hoisted out of the
        // loop, the descriptors of every k-step were kept in registers and spilled.
        std::uint32_t kw_lo = kw_lo0, vw_lo = vw_lo0, kq_lo = kq_lo0;
        asm volatile("" : "+r"(kw_lo), "+r"(vw_lo), "+r"(kq_lo));
        const std::uint32_t q_lo = smem_desc_lo(q_addr, 0), do_lo = smem_desc_lo(do_addr, 0);
        const std::uint32_t qt_lo = smem_desc_lo(q_addr, kBlockM * 128), dot_lo = smem_desc_lo(do_addr, kBlockM * 128);

        // S^T = K_w Q^T and dP^T = V_w dO^T: both operands K-major, 16 columns per k-step.
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
          const std::uint32_t off = ((ks / 4) * kBlockN * 128 + (ks % 4) * 32) >> 4;
          const std::uint32_t offq = ((ks / 4) * kBlockM * 128 + (ks % 4) * 32) >> 4;
          Wgmma<kBlockM>::template ss<Element, 0>(s, smem_desc_from_lo(kw_lo + off), smem_desc_from_lo(q_lo + offq),
                                                  ks > 0 ? 1 : 0);
        }
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
          const std::uint32_t off = ((ks / 4) * kBlockN * 128 + (ks % 4) * 32) >> 4;
          const std::uint32_t offq = ((ks / 4) * kBlockM * 128 + (ks % 4) * 32) >> 4;
          Wgmma<kBlockM>::template ss<Element, 0>(dp, smem_desc_from_lo(vw_lo + off), smem_desc_from_lo(do_lo + offq),
                                                  ks > 0 ? 1 : 0);
        }
        wgmma_commit();

        // Element (key row 16 warp_in + lane / 4 + 8 half, query column 8 c + 2 (lane % 4) + e)
        // of the warpgroup's 64 x kBlockM tile is register 4 c + 2 half + e.
        const bool masked = m0 + kBlockM > s_q || tile_mask.tile_needs_mask(m0, kBlockM, n0, kBlockN);
        const float* const lse_s = sLse + stage * kBlockM + 2 * (lane % 4);
        const float* const dsum_s = sDsum + stage * kBlockM + 2 * (lane % 4);
        // Masked tiles: elements whose query does not see the key become 0 by a select.
        auto zero_invisible = [&](float (&x)[kSN]) {
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int i = m0 + 8 * c + 2 * (lane % 4) + e;
                const bool visible = i >= vis_lo[half] && i <= vis_hi[half];
                x[4 * c + 2 * half + e] = visible ? x[4 * c + 2 * half + e] : 0.0f;
              }
        };
        auto pack_p = [&] {
          pack_a_frags<Element>(s, pa);
        };
        // dV_w += P^T dO (dO read MN-major: 16 query rows per k-step).
        auto issue_dv = [&] {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kMK; ++kk) {
            Wgmma<kHeadDim>::template rs<Element, 1>(dv, pa[kk], smem_desc_from_lo(dot_lo + kk * 16 * 128 / 16), 1);
          }
          wgmma_commit();
        };
        // dS^T packed (da) and stored to shared memory: 64-query column blocks of [kBlockN keys x
        // 128 bytes], the TMA's 128-byte swizzle (16-byte chunk index ^ row % 8). da[kk] holds
        // the four 8 x 8 matrices of the warp's 16 key rows x queries 16 kk .. 16 kk + 15 in
        // stmatrix order (rows +0 / +8, columns +0 / +8): lane l gives the row l % 8 (+ 8 for odd
        // l / 8) of matrix l / 8, whose 8 columns are chunk 2 (kk % 4) + l / 16 of its row,
        // swizzled: (2 (kk % 4) + h) ^ r = 2 (kk % 4) ^ (h ^ r) with h = l / 16, r = l % 8.
        // (The lane's term is made opaque: hoisted out of the loop, the store addresses were
        // kept per k-step and spilled.)
        auto store_ds = [&] {
          pack_a_frags<Element>(dp, da);
          std::uint32_t ds_lane = smem_addr(sdS) + (64 * cw + 16 * warp_in + 8 * ((lane / 8) % 2) + lane % 8) * 128;
          std::uint32_t ds_t = 16u * ((lane / 16) ^ (lane % 8));
          asm volatile("" : "+r"(ds_lane), "+r"(ds_t));
          ds_lane += (it & 1) * Cfg::kDsBytes;
#pragma unroll
          for (int kk = 0; kk < kMK; ++kk) {
            stmatrix_x4(ds_lane + (kk / 4) * kBlockN * 128 + ((32u * (kk % 4)) ^ ds_t), da[kk][0], da[kk][1], da[kk][2],
                        da[kk][3]);
          }
        };
        // kRaw: P^T = exp2(S^T * scale log2 e - lse log2 e), lse per query column from
        // registers; dS^T = P^T (dP^T - D) in place of dP^T.
        auto exp_p = [&](const float2 (&lse_r)[kBlockM / 8]) {
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) {
            const float2 l = lse_r[c];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              s[4 * c + 2 * half] = bwd_exp2(s[4 * c + 2 * half] * scale_log2 - l.x);
              s[4 * c + 2 * half + 1] = bwd_exp2(s[4 * c + 2 * half + 1] * scale_log2 - l.y);
            }
          }
        };
        auto ds_of = [&](const float2 (&dd_r)[kBlockM / 8]) {
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) {
            const float2 dd = dd_r[c];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int r = 4 * c + 2 * half;
              dp[r] = s[r] * (dp[r] - dd.x);
              dp[r + 1] = s[r + 1] * (dp[r + 1] - dd.y);
            }
          }
        };
        if constexpr (kDvAtDsStore) {
          // FA3's order (Cfg::kDvAtDsStore): P^T, dS^T, their packs and dS^T's store in one
          // pass per tile kind, the masked one a copy with the selects, so that the unmasked
          // pass is one basic block from the S^T wait to the store (ptxas hoists the dP^T wait
          // into the exponentials and fills the MUFU.EX2 gaps with dS^T's arithmetic); dV's
          // product is issued after it, below. lse and D are read into registers before the
          // waits (see the other branch).
          float2 lse_r[kBlockM / 8], dd_r[kBlockM / 8];
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) lse_r[c] = *reinterpret_cast<const float2*>(lse_s + 8 * c);
          wgmma_wait<1>();
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) dd_r[c] = *reinterpret_cast<const float2*>(dsum_s + 8 * c);
          auto pass = [&](auto masked_c) {
            if constexpr (decltype(masked_c)::value) {
              // Opaque inputs (no instruction): the compiler hoisted the exponentials both
              // copies share above the branch, back to back again.
#pragma unroll
              for (int i = 0; i < kSN; ++i) asm volatile("" : "+f"(s[i]));
            }
            exp_p(lse_r);
            if constexpr (decltype(masked_c)::value) zero_invisible(s);
            wgmma_wait<0>();  // dP^T
            // dS^T = P^T (dP^T - D); masked elements are 0 by a select whatever dP and D
            // hold (docs/semantics.md rule 5).
            ds_of(dd_r);
            if constexpr (decltype(masked_c)::value) zero_invisible(dp);
            pack_p();
            store_ds();
            // (and an opaque end, so that the shared tail is not sunk below the branch)
            if constexpr (decltype(masked_c)::value) asm volatile("" ::: "memory");
          };
          if (masked) {
            pass(std::true_type{});
          } else {
            pass(std::false_type{});
          }
        } else if constexpr (kRaw) {
          // P^T = exp2(S^T * scale log2 e - lse log2 e) while dP^T is computed. lse (and D
          // below) are read into registers before the waits, so that their shared loads'
          // latency hides behind the products (ncu, H100: the FFMAs waiting on them held
          // ~10% of the consumers' stall samples).
          float2 lse_r[kBlockM / 8];
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) lse_r[c] = *reinterpret_cast<const float2*>(lse_s + 8 * c);
          wgmma_wait<1>();
          exp_p(lse_r);
          if (masked) zero_invisible(s);
          float2 dd_r[kBlockM / 8];
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) dd_r[c] = *reinterpret_cast<const float2*>(dsum_s + 8 * c);
          pack_p();
          wgmma_wait<0>();  // dP^T
          // dS^T = P^T (dP^T - D); masked elements are 0 by a select whatever dP and D hold
          // (a visible probability that underflowed to 0 still carries a NaN dO row's NaN,
          // docs/semantics.md rule 5).
          ds_of(dd_r);
          // One branch around the whole masked pass (inside the loop above, ptxas branched
          // around each column group: 8 branches per pair on unmasked tiles).
          if (masked) zero_invisible(dp);
        } else {
          // Softcap / ALiBi (semantics::score): P^T and dS^T in one pass once both products
          // are done, so the softcap's derivative needs no registers of its own.
          wgmma_wait<0>();
          const float slope = p.alibi_slope(b, h);
          const float inv_softcap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
#pragma unroll
          for (int c = 0; c < kBlockM / 8; ++c) {
            const float2 l = *reinterpret_cast<const float2*>(lse_s + 8 * c);
            const float2 dd = *reinterpret_cast<const float2*>(dsum_s + 8 * c);
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int r = 4 * c + 2 * half + e;
                const int i = m0 + 8 * c + 2 * (lane % 4) + e;
                const int j = n0 + key_in_tile + 8 * half;
                float x = s[r] * p.scale;
                float cap_grad = 1.0f;
                if (p.softcap > 0.0f) {
                  x = p.softcap * tanhf(x * inv_softcap);
                  cap_grad = semantics::softcap_grad(x, p.softcap);
                }
                if (slope != 0.0f) x += semantics::alibi_bias(slope, i, j, s_q, s_k);
                float prob = bwd_exp2(x * kLog2e - (e == 0 ? l.x : l.y));
                float ds = prob * (dp[r] - (e == 0 ? dd.x : dd.y)) * cap_grad;
                if (masked) {
                  const bool visible = i >= vis_lo[half] && i <= vis_hi[half];
                  prob = visible ? prob : 0.0f;
                  ds = visible ? ds : 0.0f;
                }
                s[r] = prob;
                dp[r] = ds;
              }
          }
          pack_p();
        }
        if constexpr (kDvAtDsStore) {
          issue_dv();  // runs across the barrier and dQ's issue
        } else {
          store_ds();
        }
        fence_proxy_async_smem();
        // Both halves of dS^T are in shared memory.
        named_barrier_sync(kDsReady, 128 * Cfg::kConsumers);
        // dQ block (mb, cb) = dS[64 mb.., :] K[:, 64 cb..]: A = dS^T's column block mb read
        // MN-major, B = K's column block cb read MN-major; 16 keys per k-step. Issued before
        // dK, so its reductions below overlap dK's product.
        const std::uint32_t ds_lo = smem_desc_lo(smem_addr(ds_buf) + mb * kBlockN * 128, 0);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
          Wgmma<64>::template ss<Element, 1, 1>(dq, smem_desc_from_lo(ds_lo + ks * 16 * 128 / 16),
                                                smem_desc_from_lo(kq_lo + ks * 16 * 128 / 16), ks > 0 ? 1 : 0);
        }
        wgmma_commit();
        if constexpr (!kDvAtDsStore) issue_dv();
        // dK_w += dS^T Q.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kMK; ++kk) {
          Wgmma<kHeadDim>::template rs<Element, 1>(dk, da[kk], smem_desc_from_lo(qt_lo + kk * 16 * 128 / 16), 1);
        }
        wgmma_commit();
        // Pending: [dV,] dQ[, dV], dK.
        if constexpr (kDvAtDsStore) {
          wgmma_wait<1>();
        } else {
          wgmma_wait<2>();
        }

        // dQ to this warpgroup's buffer once the writer has read the previous block: lane's
        // four floats of 8-column slab c at (4 c + warp_in) * 128 + 4 lane, the workspace order.
        if (m0 + 64 * mb < s_q) {
          named_barrier_sync(kDqEmpty + cw, 128 + 32);
          const std::uint32_t dst = smem_addr(sdQ + cw * Cfg::kDqFloats + warp_in * 128 + lane * 4);
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            st_shared_v4(dst + c * 4 * 128 * 4, dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
          }
          fence_proxy_async_smem();
          named_barrier_arrive(kDqFull + cw, 128 + 32);
        }
        wgmma_wait<0>();  // dV, dK: Q and dO are free
        mbar_arrive(&empty[stage]);
        if (++m_block == m_end) {
          m_block = m_begin;
          ++h;
        }
      }
    }

    // The writer's last arrival on this consumer's empty barrier (one more than the blocks).
    if (n_iter > 0) named_barrier_sync(kDqEmpty + cw, 128 + 32);

    // Epilogue: dK (times scale) and dV in the output type; rows past s_k (seqused_k) are
    // zero by a select: their accumulators hold 0 * x sums, NaN where a query row of the
    // pair held one (docs/semantics.md rule 5).
    bool used[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) used[half] = n0 + key_in_tile + 8 * half < s_k;
    // A consumer whose 64 key rows are all this sequence's (a tensor row past them may be
    // another sequence's) stages them in shared memory (stmatrix, the boxes' 128-byte
    // swizzle) and one thread stores them by TMA: consumer 0 in the Q ring, consumer 1 in
    // the dO ring, once both have finished their products (the ring's last reads). Other
    // slabs store from the registers.
    bool staged = false;
    if constexpr (Cfg::kTmaStoreDkv) {
      if (args.dkv_tma) {
        named_barrier_sync(kDsReady, 128 * Cfg::kConsumers);
        staged = n0 + 64 * cw + 64 <= len_k;
        if (staged) {
          unsigned char* const slab = cw == 0 ? sQ : sdO;  // dK's kColBlocks boxes, then dV's
          // stmatrix x4: matrices (rows 0-7 | 8-15 of the warp's 16) x (8-column chunks c,
          // c + 1); lane l addresses row l % 8 of matrix l / 8.
          const int mat = lane / 8;
          const int r = 16 * warp_in + 8 * (mat % 2) + lane % 8;
          const std::uint32_t row_addr = smem_addr(slab) + r * 128;
          const float k_scale = p.scale;
          auto frag = [&](const float (&acc)[kKN], int c, int half, float mul) {
            return pack2<Element>(used[half] ? acc[4 * c + 2 * half] * mul : 0.0f,
                                  used[half] ? acc[4 * c + 2 * half + 1] * mul : 0.0f);
          };
#pragma unroll
          for (int c = 0; c < kHeadDim / 8; c += 2) {
            const int chunk = c + mat / 2;
            const std::uint32_t addr = row_addr + (chunk / 8) * 64 * 128 + ((chunk % 8) ^ (r % 8)) * 16;
            stmatrix_x4(addr, frag(dk, c, 0, k_scale), frag(dk, c, 1, k_scale), frag(dk, c + 1, 0, k_scale),
                        frag(dk, c + 1, 1, k_scale));
            stmatrix_x4(addr + Cfg::kDkvSlabBytes, frag(dv, c, 0, 1.0f), frag(dv, c, 1, 1.0f), frag(dv, c + 1, 0, 1.0f),
                        frag(dv, c + 1, 1, 1.0f));
          }
          fence_proxy_async_smem();
          named_barrier_sync(kDkvStaged + cw, 128);
          if (threadIdx.x % 128 == 0) {
            const int k_row = (p.cu_seqlens_k ? p.k_start(b) : 0) + n0 + 64 * cw;
            const int k_b = p.cu_seqlens_k ? 0 : b;
#pragma unroll
            for (int box = 0; box < Cfg::kColBlocks; ++box) {
              if (box * 64 < p.d) {  // (a box wholly past d would write nothing)
                tma_store_4d(&args.tmap_dk, slab + box * 64 * 128, box * 64, k_row, g, k_b);
                tma_store_4d(&args.tmap_dv, slab + Cfg::kDkvSlabBytes + box * 64 * 128, box * 64, k_row, g, k_b);
              }
            }
            bulk_commit();
            bulk_wait_read<0>();  // before the block's shared memory goes
          }
        }
      }
    }
    if (!staged) {
      Element* const dk_ptr = static_cast<Element*>(p.dk);
      Element* const dv_ptr = static_cast<Element*>(p.dv);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = n0 + key_in_tile + 8 * half;
        if (j < len_k) {
          Element* const dk_row = dk_ptr + p.dk_offset(b, j, g) + 2 * (lane % 4);
          Element* const dv_row = dv_ptr + p.dv_offset(b, j, g) + 2 * (lane % 4);
#pragma unroll
          for (int c = 0; c < kHeadDim / 8; ++c) {
            if (8 * c + 2 * (lane % 4) < p.d) {
              const float k0 = used[half] ? dk[4 * c + 2 * half] * p.scale : 0.0f;
              const float k1 = used[half] ? dk[4 * c + 2 * half + 1] * p.scale : 0.0f;
              *reinterpret_cast<std::uint32_t*>(dk_row + 8 * c) = pack2<Element>(k0, k1);
              *reinterpret_cast<std::uint32_t*>(dv_row + 8 * c) = pack2<Element>(
                  used[half] ? dv[4 * c + 2 * half] : 0.0f, used[half] ? dv[4 * c + 2 * half + 1] : 0.0f);
            }
          }
        }
      }
    }
  }
#endif
}

}  // namespace flashattn::detail::cuda::sm90
