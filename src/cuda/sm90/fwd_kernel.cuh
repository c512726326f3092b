// The sm90a fused attention forward: warp-specialized, TMA-fed, wgmma-computed.
//
// One thread block per (query tile, query head, sequence), kConsumers + 1 warpgroups:
//   warpgroup 0, the producer: one thread issues the TMA copies of the Q tile (once) and
//     of the K and V tiles into a kStages-deep ring, each slot guarded by a "full"
//     mbarrier (transaction bytes) and an "empty" one (the consumers' release); its
//     registers go to the consumers (setmaxnreg).
//   warpgroups 1..kConsumers, the consumers: 64 query rows each.
//     S = Q K^T by wgmma with both operands in shared memory; scores, mask and online
//     softmax in registers on the accumulator layout; P repacked in registers as the A
//     operand of O += P V (wgmma, V in shared memory read MN-major).
//     Within a warpgroup the softmax of tile j runs while the tensor cores compute
//     S_{j+1} and P_{j-1} V_{j-1} (issued together, waited for separately); across
//     warpgroups, named barriers take turns at issuing the GEMMs (ping-pong), so one
//     warpgroup's softmax overlaps the other's GEMMs.
//   Epilogue: O / l staged through the warpgroup's (now unused) Q rows of shared
//   memory, then 16-byte stores of the rows and columns that exist; lse once per row.
//
// Key tiles are visited from the last visible one down, so the tiles that cross the end
// of the keys or the causal diagonal come first; a tile needs element masking only when
// TileMask::tile_needs_mask says so (a warp-uniform branch).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/arch/sm90_tma.cuh"
#include "cuda/arch/sm90_wgmma.cuh"
#include "cuda/common/mask.cuh"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda::sm90 {

// The compile-time shape of one forward kernel.
template <int kHeadDim_, int kBlockN_, int kConsumers_, int kStages_>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;  // bucket: 64, 128 or 256
  static constexpr int kBlockN = kBlockN_;    // keys per tile (multiple of 16)
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kStages = kStages_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kColBlocks = kHeadDim / 64;  // 64-column (128-byte) swizzle blocks
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one K (or V) tile
  static constexpr int kBarriers = 2 + 4 * kStages;
  // Dynamic shared memory: 1024 bytes of alignment slack, the tiles, the barriers.
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kKVBytes + 8 * kBarriers;
  // Registers per thread after setmaxnreg: 65536 per SM, one block.
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockN <= 256);
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536);
  static_assert(kSmemBytes <= 227 * 1024);
};

// Kernel arguments: the problem and the three tensor maps (box 64 columns x rows).
struct FwdArgs {
  CUtensorMap tmap_q;  // {d, rows, h_q, batch}, box rows kBlockM
  CUtensorMap tmap_k;  // {d, rows, h_k, batch}, box rows kBlockN
  CUtensorMap tmap_v;
  FwdParams p;
  float to_log2;    // exp2 factor of the softmax: scale * log2(e) on raw scores, else log2(e)
  bool raw_scores;  // no softcap, no ALiBi, scale > 0: the scale folds into exp2
  bool v_tail_zero; // every sequence's keys end where the V tensor map does (TMA zero-fills)
};

template <typename Element>
__device__ __forceinline__ std::uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class Cfg, typename Element>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fwd_kernel(const __grid_constant__ FwdArgs args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages, kConsumers = Cfg::kConsumers;
  constexpr int kSN = kBlockN / 2;    // S accumulator floats per thread
  constexpr int kON = kHeadDim / 2;   // O accumulator floats per thread
  constexpr int kPK = kBlockN / 16;   // k-steps of P V
  const FwdParams& p = args.p;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + Cfg::kQBytes;
  unsigned char* sV = sK + kStages * Cfg::kKVBytes;
  auto* bars = reinterpret_cast<std::uint64_t*>(sV + kStages * Cfg::kKVBytes);
  std::uint64_t* bar_q = bars;
  std::uint64_t* full_k = bars + 1;
  std::uint64_t* full_v = full_k + kStages;
  std::uint64_t* empty_k = full_v + kStages;
  std::uint64_t* empty_v = empty_k + kStages;
  std::uint64_t* bar_tail = empty_v + kStages;  // the zero-filled last V tile's copy

  const int b = blockIdx.z, h = blockIdx.y;
  const int s_q = p.seq_len_q(b);
  // Heaviest query tiles first when masks make the work uneven (causal: the last rows).
  const int m_block = p.mask.right >= 0 ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int m0 = m_block * kBlockM;
  if (m0 >= s_q) return;
  const int s_k = p.seq_len_k(b);
  const semantics::KeyRange keys =
      semantics::visible_keys_of_rows(m0, min(m0 + kBlockM, s_q), s_q, s_k, p.mask);
  const int n_first = keys.empty() ? 0 : int(keys.begin) / kBlockN;
  const int n_last = keys.empty() ? -1 : int(keys.end - 1) / kBlockN;
  const int n_tiles = n_last - n_first + 1;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, wg = warp / 4;
  if (tid == 0) {
    mbar_init(bar_q, 1);
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
      const int g = h / p.h_ratio;
      const int q_row = p.is_varlen() ? p.cu_seqlens_q[b] + m0 : m0;
      const int q_b = p.is_varlen() ? 0 : b;
      const int k_row0 = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b] : 0;
      const int k_b = p.cu_seqlens_k != nullptr ? 0 : p.cache_row(b);
      if (leader) {
        mbar_arrive_expect_tx(bar_q, Cfg::kQBytes);
#pragma unroll
        for (int c = 0; c < Cfg::kColBlocks; ++c) {
          tma_load_4d(sQ + c * kBlockM * 128, &args.tmap_q, c * 64, q_row, h, q_b, bar_q);
        }
      }
      for (int it = 0; it < n_tiles; ++it) {
        const int stage = it % kStages;
        const std::uint32_t phase = (it / kStages) & 1;
        const int n = n_last - it;
        const int row = k_row0 + n * kBlockN;
        unsigned char* k_dst = sK + stage * Cfg::kKVBytes;
        unsigned char* v_dst = sV + stage * Cfg::kKVBytes;
        mbar_wait(&empty_k[stage], phase ^ 1);
        if (leader) {
          mbar_arrive_expect_tx(&full_k[stage], Cfg::kKVBytes);
#pragma unroll
          for (int c = 0; c < Cfg::kColBlocks; ++c) {
            tma_load_4d(k_dst + c * kBlockN * 128, &args.tmap_k, c * 64, row, g, k_b, &full_k[stage]);
          }
        }
        mbar_wait(&empty_v[stage], phase ^ 1);
        // The V rows past the keys' end are read from the tensor (the next sequence, unused
        // cache slots) unless the tensor ends there: 0 * NaN would poison O, so the warp
        // zeroes them before the consumers see the tile.
        const int valid = s_k - n * kBlockN;
        if (valid < kBlockN && !args.v_tail_zero) {
          if (leader) {
            mbar_arrive_expect_tx(bar_tail, Cfg::kKVBytes);
#pragma unroll
            for (int c = 0; c < Cfg::kColBlocks; ++c) {
              tma_load_4d(v_dst + c * kBlockN * 128, &args.tmap_v, c * 64, row, g, k_b, bar_tail);
            }
          }
          mbar_wait(bar_tail, 0);
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
          mbar_arrive_expect_tx(&full_v[stage], Cfg::kKVBytes);
#pragma unroll
          for (int c = 0; c < Cfg::kColBlocks; ++c) {
            tma_load_4d(v_dst + c * kBlockN * 128, &args.tmap_v, c * 64, row, g, k_b, &full_v[stage]);
          }
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cw = wg - 1;                 // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int wtid = tid - 128 * wg;       // thread within the warpgroup
  const int warp_in = wtid / 32;
  const int row_lo = m0 + 64 * cw + 16 * warp_in + lane / 4;  // sequence row of half 0
  const TileMask mask(s_q, s_k, p.mask);
  const bool raw = args.raw_scores;
  const float to_log2 = args.to_log2;
  const float slope = p.alibi_slope(b, h);
  const int shift = s_k - s_q;

  float o[kON];
#pragma unroll
  for (int i = 0; i < kON; ++i) o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  float s[kSN];
  std::uint32_t pa[kPK][4];

  const std::uint32_t q_addr = smem_addr(sQ) + cw * 64 * 128;
  const std::uint32_t k_addr = smem_addr(sK);
  const std::uint32_t v_addr = smem_addr(sV);
  // Ping-pong: consumer cw issues its GEMMs after barrier 1 + cw, then hands the turn on.
  auto turn_wait = [&] {
    if constexpr (kConsumers > 1) named_barrier_sync(1 + cw, 256);
  };
  auto turn_pass = [&] {
    if constexpr (kConsumers > 1) named_barrier_arrive(1 + (cw + 1) % kConsumers, 256);
  };
  auto release = [&](std::uint64_t* bar, int it) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&bar[it % kStages]);
  };
  auto wait_full = [&](std::uint64_t* bar, int it) {
    mbar_wait(&bar[it % kStages], (it / kStages) & 1);
  };
  auto issue_qk = [&](int it) {
    const std::uint32_t kb = k_addr + (it % kStages) * Cfg::kKVBytes;
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const std::uint32_t off = (ks % 4) * 32;  // 16 columns within the 128-byte row
      const std::uint64_t da = smem_desc_sw128(q_addr + (ks / 4) * kBlockM * 128 + off, 0);
      const std::uint64_t db = smem_desc_sw128(kb + (ks / 4) * kBlockN * 128 + off, 0);
      Wgmma<kBlockN>::template ss<Element, 0>(s, da, db, ks > 0 ? 1 : 0);
    }
  };
  auto issue_pv = [&](int it) {
    const std::uint32_t vb = v_addr + (it % kStages) * Cfg::kKVBytes;
#pragma unroll
    for (int kk = 0; kk < kPK; ++kk) {
      const std::uint64_t db = smem_desc_sw128(vb + kk * 16 * 128, kBlockN * 128);
      Wgmma<kHeadDim>::template rs<Element, 1>(o, pa[kk], db, 1);
    }
  };
  // Scores of tile it in s: modifiers, mask, then the online softmax; leaves the
  // unnormalised probabilities in s and the factor the O rows must be rescaled by.
  auto softmax = [&](int it, float (&corr)[2]) {
    const int n0 = (n_last - it) * kBlockN;
    const int col0 = n0 + 2 * (lane % 4);
    if (!raw) {
#pragma unroll
      for (int i = 0; i < kSN; ++i) {
        float x = s[i] * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
        if (slope != 0.0f) {
          const int r = row_lo + 8 * ((i % 4) / 2);
          const int j = col0 + 8 * (i / 4) + (i % 2);
          x -= slope * static_cast<float>(abs(r + shift - j));
        }
        s[i] = x;
      }
    }
    if (mask.tile_needs_mask(m0, kBlockM, n0, kBlockN)) {
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
      const float base = m == -INFINITY ? 0.0f : m * to_log2;
      corr[half] = fast_exp2(row_max[half] * to_log2 - base);
      row_max[half] = m;
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
  auto to_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kPK; ++kk) {
      pa[kk][0] = pack2<Element>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack2<Element>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<Element>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<Element>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < kON; ++i) o[i] *= corr[(i % 4) / 2];
  };

  // Consumer 0 takes the first turn: the last consumer passes it on before any GEMM.
  if constexpr (kConsumers > 1) {
    if (cw == kConsumers - 1) named_barrier_arrive(1, 256);
  }
  mbar_wait(bar_q, 0);
  if (n_tiles > 0) {
    float corr[2];
    wait_full(full_k, 0);
    turn_wait();
    wgmma_fence();
    issue_qk(0);
    wgmma_commit();
    turn_pass();
    wgmma_wait<0>();
    release(empty_k, 0);
    softmax(0, corr);
    to_p();
    for (int it = 1; it < n_tiles; ++it) {
      wait_full(full_k, it);
      turn_wait();
      wgmma_fence();
      issue_qk(it);
      wgmma_commit();
      wait_full(full_v, it - 1);
      issue_pv(it - 1);
      wgmma_commit();
      turn_pass();
      wgmma_wait<1>();
      release(empty_k, it);
      softmax(it, corr);
      wgmma_wait<0>();
      release(empty_v, it - 1);
      rescale_o(corr);
      to_p();
    }
    wait_full(full_v, n_tiles - 1);
    turn_wait();
    wgmma_fence();
    issue_pv(n_tiles - 1);
    wgmma_commit();
    turn_pass();
    wgmma_wait<0>();
    release(empty_v, n_tiles - 1);
  }
  // The first consumer takes one more turn: it consumes the last consumer's final pass,
  // so no named barrier is left with pending arrivals.
  if constexpr (kConsumers > 1) {
    if (cw == 0) named_barrier_sync(1, 256);
  }

  // ---- epilogue
  float inv[2], lse[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const bool empty = sum == 0.0f || row_max[half] == -INFINITY;
    inv[half] = empty ? 0.0f : 1.0f / sum;
    lse[half] = empty ? -INFINITY : (row_max[half] * to_log2 + log2f(sum)) * 0.6931471805599453f;
  }
  // Stage O / l in this warpgroup's Q rows (128-byte swizzle: conflict-free pairs).
  unsigned char* sO = sQ;
  auto o_offset = [](int row, int col) {  // bytes; col in elements
    return (col / 64) * kBlockM * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
  };
  const int r_local = 64 * cw + 16 * warp_in + lane / 4;
#pragma unroll
  for (int i = 0; i < kON; i += 2) {
    const int half = (i % 4) / 2;
    const int row = r_local + 8 * half;
    const int col = 8 * (i / 4) + 2 * (lane % 4);
    *reinterpret_cast<std::uint32_t*>(sO + o_offset(row, col)) =
        pack2<Element>(o[i] * inv[half], o[i + 1] * inv[half]);
  }
  named_barrier_sync(1 + kConsumers + cw, 128);
  Element* const o_base = static_cast<Element*>(p.out) + p.o_offset(b) + std::int64_t(h) * p.o_head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
  for (int idx = wtid; idx < 64 * kChunksPerRow; idx += 128) {
    const int row = 64 * cw + idx / kChunksPerRow;
    const int col = (idx % kChunksPerRow) * 8;
    const int i = m0 + row;
    if (i < s_q && col < p.d) {
      *reinterpret_cast<uint4*>(o_base + std::int64_t(i) * p.o_row_stride + col) =
          *reinterpret_cast<const uint4*>(sO + o_offset(row, col));
    }
  }
  if (p.lse != nullptr && lane % 4 == 0) {
    float* const lse_row = p.lse + p.lse_offset(b, h);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row_lo + 8 * half;
      if (i < s_q) lse_row[i] = lse[half];
    }
  }
#endif
}

}  // namespace flashattn::detail::cuda::sm90
