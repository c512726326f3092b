// The sm90a fused attention forward: warp-specialized, TMA-fed, wgmma-computed.
//
// A persistent kernel: one thread block per SM walks units of work u = blockIdx.x,
// + gridDim.x, ..., each one or two work tiles (query tile, query head, sequence; see
// work_tile); kConsumers + 1 warpgroups:
//   warpgroup 0, the producer: one thread of its first warp issues the TMA copies of each
//     work tile's Q tile and of its K and V tiles into a kStages-deep ring (the warp zeroes
//     V rows past the keys' end where the tensor goes on), each slot guarded by a
//     "full" mbarrier (transaction bytes) and an "empty" one (the consumers' release);
//     the ring runs on across work tiles, so the next tile's loads overlap this one's
//     last GEMMs and epilogue. Its registers go to the consumers (setmaxnreg).
//   warpgroups 1..kConsumers, the consumers: 64 query rows each.
//     S = Q K^T by wgmma with both operands in shared memory; scores, mask and online
//     softmax in registers on the accumulator layout; P repacked in registers as the A
//     operand of O += P V (wgmma, V in shared memory read MN-major).
//     Within a warpgroup the softmax of tile j runs while the tensor cores compute
//     S_{j+1} and P_{j-1} V_{j-1} (issued together, waited for separately); across
//     warpgroups, named barriers take turns at issuing the GEMMs (ping-pong), so one
//     warpgroup's softmax overlaps the other's GEMMs.
//   Epilogue: O / l, lse once per row. Where the out tile fits in shared memory beside the
//   ring (kTmaStore), each consumer stages its 64 rows there (stmatrix) and one thread
//   stores them by TMA, so the warps start the next tile while the copy drains; else (and
//   for a slab with rows past the sequence) from the accumulators (column pairs). Q's
//   buffer is released after the tile's last S GEMM, so the next Q is in flight by then.
//
// fp8 (e4m3) q, k, v (FwdConfig's kElemBytes 1): the same program on 8-bit wgmma; V is read
// from its transposed copy (fp8_vt.cu), P is rounded to e4m3 in registers (at most 2^8 by
// the lazy rescale, within e4m3's range), out is 16-bit.
//
// Key tiles are visited from the last visible one down, so the tiles that cross the end
// of the keys or the causal diagonal come first; a tile needs element masking only when
// TileMask::tile_needs_mask says so (a warp-uniform branch).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/arch/pack.cuh"
#include "cuda/arch/sm90_tma.cuh"
#include "cuda/arch/sm90_wgmma.cuh"
#include "cuda/collective/mask.cuh"
#include "cuda/sm90/fwd.hpp"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda::sm90 {

// The compile-time shape of one forward kernel. kElemBytes 2: fp16 / bf16 q, k, v; 1: e4m3,
// whose V tiles are the transposed copy [head dim][keys] (fp8_vt.cu: 8-bit wgmma reads B
// K-major only), in blocks of 64 keys (64-byte rows, the 64-byte swizzle).
template <int kHeadDim_, int kBlockN_, int kConsumers_, int kStages_, int kElemBytes_ = 2>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;  // bucket: 64, 128 or 256
  static constexpr int kBlockN = kBlockN_;    // keys per tile (multiple of 16; fp8: of 64)
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kStages = kStages_;
  static constexpr int kElemBytes = kElemBytes_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // Q and K in shared memory: rows of 128 bytes (the 128-byte swizzle), or of 64 (the 64-byte
  // swizzle) where a row of the head dim is 64 bytes (fp8 at hdim 64).
  static constexpr int kRowBytes = kHeadDim * kElemBytes >= 128 ? 128 : 64;
  static constexpr int kColElems = kRowBytes / kElemBytes;              // elements per swizzle row
  static constexpr int kColBlocks = kHeadDim * kElemBytes / kRowBytes;  // column blocks of Q, K
  static constexpr int kKStep = 32 / kElemBytes;                  // the k of one wgmma (32 bytes)
  static constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;
  static constexpr int kKVBytes = kBlockN * kHeadDim * kElemBytes;  // one K (or V) tile
  static constexpr int kBarriers = 3 + 4 * kStages;
  // The 16-bit out tile staged for the TMA store (one 64-row slab per consumer, boxes of 64
  // columns), where it fits beside the ring; else the epilogue stores from the registers.
  static constexpr int kOBytes = kBlockM * kHeadDim * 2;
  static constexpr int kRingBytes = 1024 + kQBytes + 2 * kStages * kKVBytes + 8 * kBarriers;
  // (Not at hdim 256: the fp8 kernel, the one whose ring leaves room, spilled 48 bytes with it.)
  static constexpr bool kTmaStore = kHeadDim <= 128 && kRingBytes + kOBytes <= 227 * 1024;
  // Dynamic shared memory: 1024 bytes of alignment slack, the tiles, [the out tile,] the barriers.
  static constexpr int kSmemBytes = kRingBytes + (kTmaStore ? kOBytes : 0);
  // Registers per thread after setmaxnreg. The block's pool is what it was launched with
  // (__launch_bounds__(kThreads, 1): 65536 / kThreads rounded down to a multiple of 8 per
  // thread); a setmaxnreg.inc the pool cannot serve waits forever, so the split must fit it
  // (2 consumers: 168 x 384 = 64512 = 24 x 128 + 240 x 256).
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockN <= 256);
  static_assert(kElemBytes == 2 || (kElemBytes == 1 && (kHeadDim == 64 || kHeadDim % 128 == 0) && kBlockN % 64 == 0),
                "fp8 tiles: whole 64- or 128-byte rows of Q / K (head dim), 64-byte rows of V^T (keys)");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
                "setmaxnreg: the warpgroups' registers exceed the block's launch allocation");
  static_assert(kSmemBytes <= 227 * 1024);
};

// Kernel arguments: the problem and the three tensor maps (box 64 columns x rows).
struct FwdArgs {
  CUtensorMap tmap_q;  // {d, rows, h_q, batch}, box rows kBlockM
  CUtensorMap tmap_k;  // {d, rows, h_k, batch}, box rows kBlockN (paged: {d, block_size, h_k,
                       // blocks}, box rows page_rows)
  CUtensorMap tmap_v;  // fp8: V^T in the workspace, {keys, d_v, h_k, batch}, box kHeadDim rows
  CUtensorMap tmap_o;  // {d_v, rows, h_q, batch} like q's, box rows 64 (when o_tma)
  FwdParams p;
  float to_log2;    // exp2 factor of the softmax: scale * log2(e) on raw scores, else log2(e)
  bool raw_scores;  // no softcap, no ALiBi, scale > 0: the kRaw kernel, scale folded into exp2
  bool v_tail_zero; // every sequence's keys end where the V tensor map does (TMA zero-fills)
  bool o_tma;       // out's layout takes TMA stores (16-byte aligned base and strides): tmap_o is set
  int page_rows;    // paged KV cache: rows per K / V copy (divides kBlockN and the block size); else 0
  int m_blocks;     // query tiles per (sequence, head)
  int n_units;      // units of work (work_tile): one or two query tiles each
};

// The lazy softmax's threshold (log2 units): see the consumers' softmax.
inline constexpr float kRescaleLog2 = 8.0f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The persistent loop's work: unit u = blockIdx.x, + gridDim.x, ... of args.n_units, each
// one or two work tiles (sequence, head, query tile) and their key tiles. A head's query
// tiles are innermost, so the blocks in flight share the head's K and V in L2. With a
// causal (or right-window) mask the work of a query tile grows with its rows, so a unit
// pairs the heaviest remaining tile of a head with the lightest (k and m_blocks - 1 - k):
// every unit is about the same work, and the blocks stay in step (a static assignment of
// single tiles let the blocks with light tiles run ahead to other heads, and K / V fell
// out of L2: hdim 128 causal 16k 693 -> 447 TFLOP/s on the H200).
struct WorkTile {
  int b, h, m0, s_q, s_k, n_last, n_tiles;
  bool valid;
};

__device__ __forceinline__ int unit_parts(const FwdParams& p) { return p.mask.right >= 0 ? 2 : 1; }

template <int kBlockM, int kBlockN>
__device__ __forceinline__ WorkTile work_tile(const FwdParams& p, int u, int part, int m_blocks) {
  WorkTile w;
  int bh, m_block;
  if (p.mask.right >= 0) {
    const int per_head = (m_blocks + 1) / 2;
    const int k = u % per_head;
    bh = u / per_head;
    m_block = part == 0 ? m_blocks - 1 - k : k;
    w.valid = part == 0 || k != m_blocks - 1 - k;
  } else {
    m_block = u % m_blocks;
    bh = u / m_blocks;
    w.valid = true;
  }
  w.h = bh % p.h_q;
  w.b = bh / p.h_q;
  w.m0 = m_block * kBlockM;
  w.s_q = p.seq_len_q(w.b);
  w.valid = w.valid && w.m0 < w.s_q;
  w.s_k = p.seq_len_k(w.b);
  const semantics::KeyRange keys =
      semantics::visible_keys_of_rows(w.m0, min(w.m0 + kBlockM, w.s_q), w.s_q, w.s_k, p.mask);
  w.n_last = keys.empty() ? -1 : int(keys.end - 1) / kBlockN;
  w.n_tiles = keys.empty() ? 0 : w.n_last - int(keys.begin) / kBlockN + 1;
  return w;
}

// One register of the 8-bit A operand (m64nNk32): four e4m3 values, the first in the low byte.
__device__ __forceinline__ std::uint32_t pack4_e4m3(float a, float b, float c, float d) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return std::uint32_t(lo) | (std::uint32_t(hi) << 16);
}

// kRaw: scores are raw dot products (no softcap, no ALiBi, scale > 0), the scale folded
// into exp2; the other instantiation applies the score modifiers of semantics::score.
// Element: of q, k, v; Out: of out (fp8 inputs: bf16 or fp16, FlashAttention-3's descales
// per (sequence, KV head) folded into the softmax scale and the output factor).
template <class Cfg, typename Element, bool kRaw, typename Out = Element>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fwd_kernel(const __grid_constant__ FwdArgs args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages, kConsumers = Cfg::kConsumers;
  constexpr bool kFp8 = Cfg::kElemBytes == 1;
  constexpr int kSN = kBlockN / 2;           // S accumulator floats per thread
  constexpr int kON = kHeadDim / 2;          // O accumulator floats per thread
  constexpr int kPK = kBlockN / Cfg::kKStep;  // k-steps of P V
  const FwdParams& p = args.p;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + Cfg::kQBytes;
  unsigned char* sV = sK + kStages * Cfg::kKVBytes;
  unsigned char* sO = sV + kStages * Cfg::kKVBytes;  // Cfg::kTmaStore: the out tile
  auto* bars = reinterpret_cast<std::uint64_t*>(sO + (Cfg::kTmaStore ? Cfg::kOBytes : 0));
  std::uint64_t* full_q = bars;
  std::uint64_t* empty_q = bars + 1;
  std::uint64_t* bar_tail = bars + 2;  // the copy of a V tile whose tail rows get zeroed
  std::uint64_t* full_k = bars + 3;
  std::uint64_t* full_v = full_k + kStages;
  std::uint64_t* empty_k = full_v + kStages;
  std::uint64_t* empty_v = empty_k + kStages;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, wg = warp / 4;
  if (tid == 0) {
    mbar_init(full_q, 1);
    mbar_init(empty_q, 4 * kConsumers);
    mbar_init(bar_tail, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], 4 * kConsumers);
      mbar_init(&empty_v[s], 4 * kConsumers);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0) {
      const bool leader = lane == 0;
      if (leader) {
        prefetch_tensor_map(&args.tmap_q);
        prefetch_tensor_map(&args.tmap_k);
        prefetch_tensor_map(&args.tmap_v);
      }
      int kv_it = 0, q_it = 0, tail_it = 0;
      for (int u = blockIdx.x; u < args.n_units; u += gridDim.x)
      for (int part = 0; part < unit_parts(p); ++part) {
        const WorkTile w = work_tile<kBlockM, kBlockN>(p, u, part, args.m_blocks);
        if (!w.valid) continue;
        const int g = w.h / p.h_ratio;
        const int q_row = int(p.q_row0(w.b)) + w.m0;
        const int q_b = p.is_varlen() ? 0 : w.b;
        const int k_row0 = p.cu_seqlens_k != nullptr ? p.k_start(w.b) : 0;
        const int k_b = p.cu_seqlens_k != nullptr || p.is_paged() ? 0 : p.cache_row(w.b);
        // The consumers free Q once their last S = Q K^T of the previous tile is done.
        mbar_wait(empty_q, (q_it & 1) ^ 1);
        ++q_it;
        if (leader) {
          mbar_arrive_expect_tx(full_q, Cfg::kQBytes);
#pragma unroll
          for (int c = 0; c < Cfg::kColBlocks; ++c) {
            tma_load_4d(sQ + c * kBlockM * Cfg::kRowBytes, &args.tmap_q, c * Cfg::kColElems, q_row, w.h, q_b, full_q);
          }
        }
        // One K or V tile's copies, announced on `bar`: one box per 64 columns, or with a
        // paged cache one per page_rows rows through the block table (chunks past the
        // keys' end are not copied: their rows are masked, V's zeroed below).
        auto issue_tile = [&](const CUtensorMap* map, unsigned char* dst, int n, std::uint64_t* bar) {
          if (args.page_rows == 0) {
            mbar_arrive_expect_tx(bar, Cfg::kKVBytes);
#pragma unroll
            for (int c = 0; c < Cfg::kColBlocks; ++c) {
              tma_load_4d(dst + c * kBlockN * Cfg::kRowBytes, map, c * Cfg::kColElems, k_row0 + n * kBlockN, g, k_b,
                          bar);
            }
            return;
          }
          const int rows = args.page_rows, j0 = n * kBlockN;
          const int chunks = min(kBlockN / rows, (w.s_k - j0 + rows - 1) / rows);
          mbar_arrive_expect_tx(bar, chunks * rows * kHeadDim * Cfg::kElemBytes);
          const int* table = p.block_table + std::int64_t(w.b) * p.block_table_batch_stride;
          for (int ch = 0; ch < chunks; ++ch) {
            const int j = j0 + ch * rows;
            // block_id's clamp (params.hpp), on the hoisted row of the table
            const int page = FwdParams::clamp_index(table[j / p.block_size], 0, p.kv_cache_rows - 1);
#pragma unroll
            for (int c = 0; c < Cfg::kColBlocks; ++c) {
              tma_load_4d(dst + c * kBlockN * Cfg::kRowBytes + ch * rows * Cfg::kRowBytes, map, c * Cfg::kColElems,
                          j % p.block_size, g, page, bar);
            }
          }
        };
        for (int it = 0; it < w.n_tiles; ++it, ++kv_it) {
          const int stage = kv_it % kStages;
          const std::uint32_t phase = (kv_it / kStages) & 1;
          const int n = w.n_last - it;
          unsigned char* k_dst = sK + stage * Cfg::kKVBytes;
          unsigned char* v_dst = sV + stage * Cfg::kKVBytes;
          mbar_wait(&empty_k[stage], phase ^ 1);
          if (leader) issue_tile(&args.tmap_k, k_dst, n, &full_k[stage]);
          mbar_wait(&empty_v[stage], phase ^ 1);
          if constexpr (kFp8) {
            // V^T's tile: kHeadDim rows of 64 keys per block; keys past a sequence's end are
            // zero there (fwd.hpp, fp8_vt.cu).
            if (leader) {
              mbar_arrive_expect_tx(&full_v[stage], Cfg::kKVBytes);
              const int vt_row = int(fp8_vt_row0(p, w.b)) + n * kBlockN;
#pragma unroll
              for (int c = 0; c < kBlockN / 64; ++c) {
                tma_load_4d(v_dst + c * kHeadDim * 64, &args.tmap_v, vt_row + c * 64, 0, g, 0, &full_v[stage]);
              }
            }
            continue;
          }
          // The V rows past the keys' end are read from the tensor (the next sequence, unused
          // cache slots) unless the tensor ends there: 0 * NaN would poison O, so the warp
          // zeroes them before the consumers see the tile.
          const int valid = w.s_k - n * kBlockN;
          if (valid < kBlockN && !args.v_tail_zero) {
            if (leader) issue_tile(&args.tmap_v, v_dst, n, bar_tail);
            mbar_wait(bar_tail, tail_it & 1);
            ++tail_it;
            for (int idx = valid * 8 + lane; idx < kBlockN * 8; idx += 32) {
#pragma unroll
              for (int c = 0; c < Cfg::kColBlocks; ++c) {
                *reinterpret_cast<uint4*>(v_dst + c * kBlockN * 128 + idx * 16) = make_uint4(0, 0, 0, 0);
              }
            }
            fence_proxy_async_smem();
            __syncwarp();
            if (leader) mbar_arrive(&full_v[stage]);
          } else if (leader) {
            issue_tile(&args.tmap_v, v_dst, n, &full_v[stage]);
          }
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cw = warp_uniform(wg - 1);  // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int warp_in = (tid - 128 * wg) / 32;
  const int row_in_tile = 64 * cw + 16 * warp_in + lane / 4;  // tile row of half 0

  float o[kON];
  float row_max[2], row_sum[2];
  float s[kSN];
  std::uint32_t pa[kPK][4];

  // Descriptor low words (smem_desc_lo), uniform: one add per k-step (the backward's ncu:
  // built per thread, each wgmma paid ~10 instructions of address arithmetic and moves).
  const std::uint32_t q_lo0 = smem_desc_lo(smem_addr(sQ) + cw * 64 * Cfg::kRowBytes, 0);
  const std::uint32_t k_addr = smem_addr(sK);
  const std::uint32_t v_addr = smem_addr(sV);
  // Ping-pong: consumer cw issues its GEMMs after barrier 1 + cw, then hands the turn on.
  // (The barrier ids come from threadIdx.x at each use: a register holding them across
  // the loop was spilled at hdim 256.)
  auto turn_wait = [&] {
    if constexpr (kConsumers > 1) named_barrier_sync(int(threadIdx.x) / 128, 128 * 2);  // 1 + cw
  };
  auto turn_pass = [&] {
    if constexpr (kConsumers > 1) named_barrier_arrive(int(threadIdx.x) / 128 % kConsumers + 1, 128 * 2);
  };
  auto release = [&](std::uint64_t* bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  auto issue_qk = [&](int stage) {
    // Q's descriptor opaque here: hoisted out of the tile loop, every k-step's would stay live.
    std::uint32_t q_lo = q_lo0;
    asm volatile("" : "+r"(q_lo));
    const std::uint32_t kb_lo = smem_desc_lo(k_addr + stage * Cfg::kKVBytes, 0);
    constexpr int kRowSteps = Cfg::kRowBytes / 32;  // k-steps per swizzle row
    auto desc = [](std::uint32_t lo) {
      return Cfg::kRowBytes == 128 ? smem_desc_from_lo(lo) : smem_desc_sw64_from_lo(lo);
    };
#pragma unroll
    for (int ks = 0; ks < kHeadDim / Cfg::kKStep; ++ks) {
      const std::uint32_t off = (ks % kRowSteps) * 32;  // one k-step's 32 bytes within the row
      const std::uint64_t da = desc(q_lo + ((ks / kRowSteps) * kBlockM * Cfg::kRowBytes + off) / 16);
      const std::uint64_t db = desc(kb_lo + ((ks / kRowSteps) * kBlockN * Cfg::kRowBytes + off) / 16);
      Wgmma<kBlockN>::template ss<Element, 0>(s, da, db, ks > 0 ? 1 : 0);
    }
  };
  auto issue_pv = [&](int stage) {
    if constexpr (kFp8) {  // V^T K-major: 32 keys (bytes) per k-step, 64 per block
      const std::uint32_t vb_lo = smem_desc_lo(v_addr + stage * Cfg::kKVBytes, 0);
#pragma unroll
      for (int kk = 0; kk < kPK; ++kk) {
        const std::uint64_t db = smem_desc_sw64_from_lo(vb_lo + ((kk / 2) * kHeadDim * 64 + (kk % 2) * 32) / 16);
        Wgmma<kHeadDim>::template rs<Element, 0>(o, pa[kk], db, 1);
      }
    } else {
      const std::uint32_t vb_lo = smem_desc_lo(v_addr + stage * Cfg::kKVBytes, kBlockN * 128);
#pragma unroll
      for (int kk = 0; kk < kPK; ++kk) {
        const std::uint64_t db = smem_desc_from_lo(vb_lo + kk * 16 * 128 / 16);
        Wgmma<kHeadDim>::template rs<Element, 1>(o, pa[kk], db, 1);
      }
    }
  };
  auto to_p = [&] {
    if constexpr (kFp8) {
      // The 8-bit A fragment holds columns 4 (l % 4) .. + 3 (registers 0, 1: rows l / 4,
      // + 8) and those + 16 (registers 2, 3) of each 32-key step; the accumulator holds
      // keys 2 (l % 4), + 1 and those + 8, + 16, + 24. Each register takes the thread's own
      // four values of a row, so A's column 4 t + i of the step is key 2 t + (i & 1) +
      // 8 (i >> 1) (+ 16 in registers 2, 3): fp8_vt.cu writes V^T's keys in that order.
#pragma unroll
      for (int kk = 0; kk < kPK; ++kk) {
        const float* x = s + 16 * kk;
        pa[kk][0] = pack4_e4m3(x[0], x[1], x[4], x[5]);
        pa[kk][1] = pack4_e4m3(x[2], x[3], x[6], x[7]);
        pa[kk][2] = pack4_e4m3(x[8], x[9], x[12], x[13]);
        pa[kk][3] = pack4_e4m3(x[10], x[11], x[14], x[15]);
      }
    } else {
      pack_a_frags<Element>(s, pa);
    }
  };
  // Warp-uniform: skipped unless some row of the warp moved its reference max.
  auto rescale_o = [&](const float (&corr)[2]) {
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < kON; ++i) o[i] *= corr[(i % 4) / 2];
    }
  };

  // Consumer 0 takes the first turn: the last consumer passes it on before any GEMM.
  if constexpr (kConsumers > 1) {
    if (cw == kConsumers - 1) named_barrier_arrive(1, 128 * 2);
  }
  // The work tiles in the producer's order: next_tile() gives the next valid one (valid
  // false past the end). It runs a tile ahead, under the last P V GEMM of the tile before,
  // with the normalisers and lse: that GEMM's wait, not the scalar epilogue, then leads
  // into the out stores and the next tile's first S GEMM.
  int next_u = blockIdx.x, next_part = 0;
  auto next_tile = [&] {
    WorkTile t;
    t.valid = false;
    while (!t.valid && next_u < args.n_units) {
      t = work_tile<kBlockM, kBlockN>(p, next_u, next_part, args.m_blocks);
      if (++next_part == unit_parts(p)) {
        next_part = 0;
        next_u += gridDim.x;
      }
    }
    return t;
  };
  int kv_it = 0, q_it = 0;
  for (WorkTile w = next_tile(); w.valid;) {
    const TileMask mask(w.s_q, w.s_k, p.mask);
    const int row_lo = w.m0 + row_in_tile;  // sequence row of half 0
    const float slope = p.alibi_slope(w.b, w.h);
    const int shift = w.s_k - w.s_q;
    // fp8: the descales of the tile's (sequence, KV head) scale the scores (q, k) and out
    // (v); a missing descale is 1.
    float qk_descale = 1.0f, v_descale = 1.0f;
    if constexpr (kFp8) {
      const std::int64_t ds = std::int64_t(w.b) * p.scale_block_stride + w.h / p.h_ratio;
      if (p.q_descale != nullptr) qk_descale = p.q_descale[ds];
      if (p.k_scale != nullptr) qk_descale *= p.k_scale[ds];
      if (p.v_scale != nullptr) v_descale = p.v_scale[ds];
    }
    const float to_log2 = kRaw ? args.to_log2 * qk_descale : args.to_log2;
    const float score_scale = p.scale * qk_descale;
#pragma unroll
    for (int i = 0; i < kON; ++i) o[i] = 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;

    // Scores of key tile `it`: modifiers, mask, then the online softmax; leaves the
    // unnormalised probabilities in s and the factor the O rows must be rescaled by.
    auto softmax = [&](int it, float (&corr)[2]) {
      const int n0 = (w.n_last - it) * kBlockN;
      const int col0 = n0 + 2 * (lane % 4);
      if constexpr (!kRaw) {
        const float inv_softcap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
#pragma unroll
        for (int i = 0; i < kSN; ++i) {
          float x = s[i] * score_scale;
          if (p.softcap > 0.0f) x = p.softcap * tanhf(x * inv_softcap);
          if (slope != 0.0f) {
            const int r = row_lo + 8 * ((i % 4) / 2);
            const int j = col0 + 8 * (i / 4) + (i % 2);
            x -= slope * static_cast<float>(abs(r + shift - j));
          }
          s[i] = x;
        }
      }
      if (mask.tile_needs_mask(w.m0, kBlockM, n0, kBlockN)) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          int lo, hi;
          mask.row_range(row_lo + 8 * half, lo, hi);
          lo -= col0;
          hi -= col0;
#pragma unroll
          for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = 8 * c + e;
              if (j < lo || j >= hi) s[4 * c + 2 * half + e] = -INFINITY;
            }
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float m = row_max[half];
#pragma unroll
        for (int c = 0; c < kBlockN / 8; ++c) m = fmaxf(m, fmaxf(s[4 * c + 2 * half], s[4 * c + 2 * half + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // The reference max moves only when the row's max passes it by more than
        // kRescaleLog2 (probabilities stay <= 2^8, the sum and lse use the same
        // reference: the same softmax), so most tiles leave O as it is. A row with no
        // visible key yet keeps -inf (-inf - -inf is NaN and compares false).
        const bool move = (m - row_max[half]) * to_log2 > kRescaleLog2;
        const float old_base = row_max[half] * to_log2;
        if (move) row_max[half] = m;
        const float base = row_max[half] == -INFINITY ? 0.0f : row_max[half] * to_log2;
        corr[half] = move ? fast_exp2(old_base - base) : 1.0f;
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < kBlockN / 8; ++c)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = fast_exp2(s[4 * c + 2 * half + e] * to_log2 - base);
            s[4 * c + 2 * half + e] = pe;
            sum += pe;
          }
        row_sum[half] = row_sum[half] * corr[half] + sum;
      }
    };

    mbar_wait(full_q, q_it & 1);
    ++q_it;
    const int n_tiles = w.n_tiles;
    if (n_tiles == 0) {
      release(empty_q);
    } else {
      auto stage_of = [&](int it) { return (kv_it + it) % kStages; };
      auto phase_of = [&](int it) { return std::uint32_t(((kv_it + it) / kStages) & 1); };
      float corr[2];
      mbar_wait(&full_k[stage_of(0)], phase_of(0));
      turn_wait();
      wgmma_fence();
      issue_qk(stage_of(0));
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      release(&empty_k[stage_of(0)]);
      if (n_tiles == 1) release(empty_q);
      softmax(0, corr);
      to_p();
      for (int it = 1; it < n_tiles; ++it) {
        mbar_wait(&full_k[stage_of(it)], phase_of(it));
        turn_wait();
        wgmma_fence();
        issue_qk(stage_of(it));
        wgmma_commit();
        mbar_wait(&full_v[stage_of(it - 1)], phase_of(it - 1));
        issue_pv(stage_of(it - 1));
        wgmma_commit();
        turn_pass();
        wgmma_wait<1>();
        release(&empty_k[stage_of(it)]);
        if (it == n_tiles - 1) release(empty_q);
        softmax(it, corr);
        wgmma_wait<0>();
        release(&empty_v[stage_of(it - 1)]);
        rescale_o(corr);
        to_p();
      }
      mbar_wait(&full_v[stage_of(n_tiles - 1)], phase_of(n_tiles - 1));
      turn_wait();
      wgmma_fence();
      issue_pv(stage_of(n_tiles - 1));
      wgmma_commit();
      turn_pass();
    }

    // ---- under the last P V GEMM (the row statistics are final): the normalisers, lse per
    // row, the next work tile. A learnable sink joins each row's max and sum here (log2
    // units), outside the key loop.
    float inv[2], lse[2];
    const float sink_log2 = p.sink != nullptr ? p.sink[w.h] * 1.4426950408889634f : -INFINITY;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // sum 0 only: an all-NaN row keeps max -inf but has a NaN sum, hence NaN out and lse
      // (online_softmax.cuh, docs/semantics.md).
      const bool empty = sum == 0.0f;
      if (sink_log2 != -INFINITY) {
        // The base moves to max(row max, sink): neither term overflows; a row that saw no
        // key gets factor 0 and lse = the sink; a NaN sum stays NaN.
        const float base = empty ? -INFINITY : row_max[half] * to_log2;
        const float top = fmaxf(base, sink_log2);
        const float keys = empty ? 0.0f : sum * fast_exp2(base - top);
        const float total = keys + fast_exp2(sink_log2 - top);
        inv[half] = empty ? 0.0f : v_descale * fast_exp2(base - top) / total;
        lse[half] = (top + log2f(total)) * 0.6931471805599453f;
      } else {
        inv[half] = empty ? 0.0f : v_descale / sum;
        lse[half] = empty ? -INFINITY : (row_max[half] * to_log2 + log2f(sum)) * 0.6931471805599453f;
      }
    }
    if (p.lse != nullptr && lane % 4 == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = row_lo + 8 * half;
        if (i < w.s_q) p.lse[p.lse_offset(w.b, w.h) + i] = lse[half];
      }
    }
    const WorkTile next = next_tile();
    wgmma_wait<0>();  // the last P V (unconditional: ptxas tracks no condition across the branches)
    if (n_tiles > 0) {
      release(&empty_v[(kv_it + n_tiles - 1) % kStages]);
      kv_it += n_tiles;
    }

    // ---- epilogue: O / l from the accumulators.
    // A consumer whose 64 rows are all real stages them in shared memory (stmatrix, the
    // 128-byte swizzle of the boxes) and one thread stores them by TMA, so the warps go on
    // to the next tile while the copy drains; a slab with rows past the sequence (whose
    // rows in the tensor may be another sequence's) stores from the registers.
    bool staged = false;
    if constexpr (Cfg::kTmaStore) {
      staged = args.o_tma && w.m0 + 64 * cw + 64 <= w.s_q;
      if (staged) {
        const int bar_id = kConsumers + int(threadIdx.x) / 128;  // 1 + kConsumers + cw (named barriers)
        unsigned char* const slab = sO + cw * 64 * kHeadDim * 2;
        // The slab's previous store (a tile ago) has read it.
        if (threadIdx.x % 128 == 0) bulk_wait_read<0>();
        named_barrier_sync(bar_id, 128);
        // stmatrix x4: matrices (rows 0-7 | 8-15 of the warp's 16) x (8-column chunks c, c + 1);
        // lane l addresses row l % 8 of matrix l / 8.
        const int mat = lane / 8;
        const int r = 16 * warp_in + 8 * (mat % 2) + lane % 8;
        const std::uint32_t row_addr = smem_addr(slab) + r * 128;
#pragma unroll
        for (int c = 0; c < kHeadDim / 8; c += 2) {
          const int chunk = c + mat / 2;
          const std::uint32_t addr = row_addr + (chunk / 8) * 64 * 128 + ((chunk % 8) ^ (r % 8)) * 16;
          stmatrix_x4(addr, pack2<Out>(o[4 * c + 0] * inv[0], o[4 * c + 1] * inv[0]),
                      pack2<Out>(o[4 * c + 2] * inv[1], o[4 * c + 3] * inv[1]),
                      pack2<Out>(o[4 * c + 4] * inv[0], o[4 * c + 5] * inv[0]),
                      pack2<Out>(o[4 * c + 6] * inv[1], o[4 * c + 7] * inv[1]));
        }
        fence_proxy_async_smem();
        named_barrier_sync(bar_id, 128);
        if (threadIdx.x % 128 == 0) {
          const int q_row = int(p.q_row0(w.b)) + w.m0 + 64 * cw;
#pragma unroll
          for (int box = 0; box < kHeadDim / 64; ++box) {
            if (box * 64 < p.d_v)  // (a box wholly past d_v would write nothing)
              tma_store_4d(&args.tmap_o, slab + box * 64 * 128, box * 64, q_row, w.h, p.is_varlen() ? 0 : w.b);
          }
          bulk_commit();
        }
      }
    }
    if (!staged) {
      Out* const o_base =
          static_cast<Out*>(p.out) + p.o_offset(w.b) + std::int64_t(w.h) * p.o_head_stride;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = row_lo + 8 * half;
        if (i < w.s_q) {
          Out* const o_row = o_base + std::int64_t(i) * p.o_row_stride + 2 * (lane % 4);
#pragma unroll
          for (int c = 0; c < kHeadDim / 8; ++c) {
            if (8 * c + 2 * (lane % 4) < p.d_v) {
              *reinterpret_cast<std::uint32_t*>(o_row + 8 * c) =
                  pack2<Out>(o[4 * c + 2 * half] * inv[half], o[4 * c + 2 * half + 1] * inv[half]);
            }
          }
        }
      }
    }
    w = next;
  }
  // The TMA stores have read the out slabs before the block's shared memory goes.
  if constexpr (Cfg::kTmaStore) {
    if (threadIdx.x % 128 == 0) bulk_wait_read<0>();
  }
  // The first consumer takes one more turn: it consumes the last consumer's final pass,
  // so no named barrier is left with pending arrivals.
  if constexpr (kConsumers > 1) {
    if (cw == 0) named_barrier_sync(1, 128 * 2);
  }
#endif
}

}  // namespace flashattn::detail::cuda::sm90
