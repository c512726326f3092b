// Multi-head latent attention (MLA, FlashAttention-3's qv) on Hopper (sm_90a): the sm80 MLA
// kernel's problem (sm80/mla_kernel.cuh: score(i, j) = scale * (q_i . k_j + qv_i . v_j),
// out_i = sum_j P_ij v_j, the rope part d <= 64, the latent d_v <= 512, GQA-packed rows
// r = i * h_ratio + hh of one KV head) on wgmma, fed by TMA.
//
// One block per (64-row chunk, split) x KV head x sequence, as the sm80 kernel's grid and
// split plan (sm80::plan_mla: splits, row chunks, workspace), 3 warpgroups:
//   warpgroup 0, the producer: one thread of its first warp issues the TMA copies of each
//     64-key tile k' = [k | v] (9 column blocks of 64 dims, 128-byte swizzle: block 0 the
//     rope keys, blocks 1..8 the latent) into a 2-stage ring, each stage guarded by three
//     "full" mbarriers (transaction bytes; column blocks 0-2, 3-5, 6-8) and an "empty" one
//     (both consumers' release);
//     with a paged cache a tile is copied in boxes of gcd(block_size, 64) rows through the
//     block table (its first entry read before the wait for the stage). Where the tensor
//     goes on past a sequence's keys (cache slots, the next sequence) the warp zeroes the
//     latent rows past the end before the consumers see the tile: their P is exactly 0,
//     but 0 * NaN would poison O. Its registers go to the consumers (setmaxnreg).
//   warpgroups 1 and 2, the consumers: q' = [q | qv] (64 rows x 576 dims, zero past d and
//     d_v) is copied once into shared memory (cp.async, swizzled as TMA would). They take
//     the tiles in turn: consumer c alone computes S = q' k'^T of the tiles 2 i + c (64 x
//     64, 36 k-steps of m64n64k16, both operands in shared memory; with 2 stages these are
//     the stage-c tiles) and their online softmax, then hands P (16-bit, swizzled as an A
//     operand, stored by stmatrix into the tile's own rope block, which only S reads), the
//     rows' reference max and rescale factor over to the other (an mbarrier per owner,
//     p_ready); both add P V to their half of O: consumer c holds O's columns 256 c ..
//     256 c + 255 (128 fp32 registers), the tile's owner with P from registers (m64n256k16
//     rs), the other with P from shared memory (ss), V read MN-major from the tile's latent
//     blocks 1 + 4 c .. 4 + 4 c. The reference max thus runs through the tiles in order,
//     the same in both; each keeps its share of the row sums (its tiles' P, rescaled with
//     every tile's factor as its O is), added up in the epilogue. S of a tile, the larger
//     half of the work (576 of the 1088 MACs per key and row), is computed once, not by
//     both consumers. Alternate tiles rather than each S split by keys (32 / 32 with
//     m64n32): that would read q' (the A operand) from shared memory twice per tile and
//     exchange the row max within every tile; whole tiles read each of q' and k' once per
//     S, and the one exchange per tile carries P and the max together. P needs no buffer
//     of its own (216 KiB of q' and the 2-stage ring, 227 KiB in all: no third stage).
//
// The schedule, a timeline model (bench/mla_schedule_model.py). Unit U = one m64n64k16
// bf16 wgmma at the full rate: 131072 FLOP = 32 cycles of an SM (4096 dense FLOP per
// cycle). A tile (64 rows x 64 keys) is S 36 U + P V 32 U (2 halves of 4 m64n256k16) = 68 U
// of tensor work; its shared-memory traffic ~72 U at 128 bytes per cycle. X = the owner's
// softmax and hand-over (~20 U: 32 FFMA + 32 EX2 + 16 packs + 4 stmatrix per thread), L =
// a tile's load (72 KB) from the release of its stage to its last column block landed.
// A round of consumer A (own tile t + 1, the other's tile t, owned by B):
//   poll{first group of t + 1 landed, P(t)}:
//   S first: S(t+1) (3 commit groups, each issued once its column blocks landed) | take
//     over P(t) | P(t) V (queued behind S) | wait<1>: S done | softmax(t+1) X || tensor:
//     P(t) V, B's P V | hand P(t+1) over | wait<0>, release t | P(t+1) V from registers,
//     wait<0>, release t + 1.
//   P first (t + 1 still loading): take over P(t) | P(t) V, wait<0>, release t | S(t+1) in
//     its groups | wait<0> | softmax(t+1) ... as above.
// c0e7acf (one full barrier per stage; in the P-first order t was released after the wait
// for t + 1's stage, so the load of t + 2 never started before t + 1 had landed: one load
// in flight per SM) measured on the H100 (1980 MHz; batch 64, 128 rows per latent head, 2
// row chunks x 64 sequences = 128 blocks on 132 SMs, no splits): 4k 163 us (64 tiles per
// block), 32k 1124 us (512): 2.145 us per tile and a fixed ~26 us. That is 133 U at 1.98
// GHz (99 U at the dense GEMM ceiling measured on this card, 797 TFLOP/s = 21.7 ns per U);
// the model with L = 25-45 U gives 68-82 U, so loads bind: the model's c0e7acf order runs
// at T = L + 0.5 U once L >= ~100 U, i.e. L ~ 2.1 us for one 72 KB copy per SM (~4.4 TB/s
// L2 -> SM over 128 SMs, 2.2 TB/s of HBM with the row chunks' second read from L2).
// This kernel: the P-first order releases t before waiting for t + 1's stage (two loads in
// flight), and S(t+1) starts on its first column blocks (0-2: rope + latent 0-1) while the
// rest land. Modelled, X = 20 U (c0e7acf -> this): L = 80: 90.1 -> 81.2 U; 100: 100.5 ->
// 90.1; 120: 120.5 -> 100.1; 140: 140.4 -> 109.6. Either change alone: within +-3 % at L =
// 100 (release alone 103.2, groups alone 100.5): the release opens the second load, the
// groups cut the stage's use (S mostly inside the transfer), each bounding the other.
// Between S's groups each waits on an mbarrier (a loop); a wgmma.fence after each wait
// keeps ptxas from inserting its own warpgroup arrive there (C7520, wgmma serialized).
//   Not done: FlashMLA's (deepseek-ai/FlashMLA, csrc/sm90/decode/dense) separate P buffer
// and split release by V halves (here both halves are freed at about the same time, after
// the P V pair); a third stage (q' 72 KB + 3 x 72 KB > 227 KB); 32-key tiles for more
// stages (m64n32 S reads q' twice as often: shared-memory-bound).
// Epilogue as the sm80 kernel's: each consumer writes its columns of out (or with splits
// its fp32 partials; the last split of a row chunk merges them,
// collective/split_kv_merge.cuh), consumer 0 the lse; masks, softcap, ALiBi and the
// learnable sink per row (semantics::visible_keys).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/arch/pack.cuh"
#include "cuda/arch/sm80.cuh"
#include "cuda/arch/sm90_tma.cuh"
#include "cuda/arch/sm90_wgmma.cuh"
#include "cuda/collective/convert.cuh"
#include "cuda/collective/split_kv_merge.cuh"
#include "cuda/sm80/mla_launch.hpp"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda::sm90 {

struct MlaConfig {
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kRows = 64;    // packed query rows per block (sm80::MlaTraits::kRows: the plan's)
  static constexpr int kBlockN = 64;  // keys per tile
  static constexpr int kDimK = 64;    // rope dims, one 128-byte column block
  static constexpr int kDimV = 512;   // latent dims, 8 column blocks
  static constexpr int kSegs = 1 + kDimV / 64;       // column blocks of q' and k'
  static constexpr int kSegBytes = 64 * 128;         // one column block of 64 rows (q') or keys (k')
  static constexpr int kQBytes = kSegs * kSegBytes;  // 73728
  static constexpr int kTileBytes = kSegs * kSegBytes;
  static constexpr int kStages = 2;
  // A stage's column blocks land in kGroups groups of kGroupSegs blocks, each with its own
  // full barrier: S(t) issues the k-steps of a group as soon as it has landed.
  static constexpr int kGroups = 3;
  static constexpr int kGroupSegs = kSegs / kGroups;
  // full per stage and group, empty per stage; the tail copy; per consumer "P of my tile is
  // in shared memory".
  static constexpr int kBarriers = kStages * kGroups + kStages + 1 + kConsumers;
  // Per row the owner's reference max and rescale factor of its last tile (a pair per
  // consumer), the row sums' exchange of the epilogue (a share per consumer).
  static constexpr int kRowBytes = 4 * kRows * (2 * kConsumers + kConsumers);
  // Each consumer's order decision per round (two slots, alternating rounds).
  static constexpr int kOrderBytes = 4 * 2 * kConsumers;
  // Dynamic shared memory: 1024 bytes of alignment slack, q', the ring, the row arrays, the
  // order slots, the barriers, the split merge's flag (no static shared memory). P of a
  // tile has no buffer of its own: it goes to its stage's rope block (block 0), which only
  // S reads. A third stage would not fit.
  static constexpr int kSmemBytes =
      1024 + kQBytes + kStages * kTileBytes + kRowBytes + kOrderBytes + 8 * kBarriers + 8;
  // Named barriers (0 is __syncthreads): both consumers; each consumer's own warpgroup
  // (its order decision).
  static constexpr int kBarConsumers = 1;
  static constexpr int kBarOrder = 2;  // + the consumer's index
  // setmaxnreg: the block's pool is its launch allocation (__launch_bounds__(384, 1): 168
  // per thread); a setmaxnreg.inc the pool cannot serve waits forever.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kRows == sm80::MlaTraits::kRows, "the sm80 plan's row chunks");
  static_assert(kDimK == sm80::MlaTraits::kDimK && kDimV == sm80::MlaTraits::kDimV, "the sm80 plan's head dims");
  static_assert(kRows == kBlockN, "q' and k' share the column-block layout (64 rows of 128 bytes)");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
                "setmaxnreg: the warpgroups' registers exceed the block's launch allocation");
  static_assert(kSmemBytes <= 227 * 1024);
  static_assert(kGroups * kGroupSegs == kSegs, "whole column blocks per group");
};

// Kernel arguments besides FwdParams: the K and V tensor maps (box 64 columns x box rows,
// 128-byte swizzle; columns past d / d_v read as zero) and the split plan.
struct MlaArgs {
  CUtensorMap tmap_k;  // {d, rows, h_k, batches}
  CUtensorMap tmap_v;  // {d_v, rows, h_k, batches}
  sm80::MlaArgs split;  // splits, row chunks, workspace (sm80::plan_mla)
  int page_rows;     // paged: rows per copy (gcd(block_size, 64)); dense: 0 (a whole tile)
  int v_segs;        // latent column blocks copied: ceil(d_v / 64); the rest stay zero
  bool v_tail_zero;  // every sequence's keys end where the tensor maps do (TMA zero-fills)
};

// Scores in log2 units; the reference max of a row moves only when a tile's max passes it
// by more than this (the sm90 forward's lazy rescale: P <= 2^8, exact in 16 bits).
inline constexpr float kMlaRescaleLog2 = 8.0f;

template <typename Element>
__global__ void __launch_bounds__(MlaConfig::kThreads, 1)
    mla_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ MlaArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = MlaConfig;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kBlockN = Cfg::kBlockN, kSegBytes = Cfg::kSegBytes;
  extern __shared__ unsigned char smem_raw[];
  // Aligned by pointer arithmetic on the shared array itself (not through an integer), so
  // that every access derived from it stays a shared-memory one (LDS / STS, not generic).
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sQ = smem;
  unsigned char* sKV = sQ + Cfg::kQBytes;
  auto* sMax = reinterpret_cast<float*>(sKV + Cfg::kStages * Cfg::kTileBytes);  // [owner][row]
  float* sCorr = sMax + Cfg::kConsumers * Cfg::kRows;                             // [owner][row]
  float* sL = sCorr + Cfg::kConsumers * Cfg::kRows;                               // [consumer][row]
  int* s_order = reinterpret_cast<int*>(sL + Cfg::kConsumers * Cfg::kRows);      // [consumer][round % 2]
  auto* bars = reinterpret_cast<std::uint64_t*>(s_order + 2 * Cfg::kConsumers);
  std::uint64_t* full = bars;  // [stage][group]
  std::uint64_t* empty = bars + Cfg::kStages * Cfg::kGroups;
  std::uint64_t* bar_tail = empty + Cfg::kStages;
  std::uint64_t* p_ready = bar_tail + 1;  // [owner]
  int* merge_flag = reinterpret_cast<int*>(bars + Cfg::kBarriers);

  const int splits = a.split.splits, row_chunks = a.split.row_chunks;
  const int chunk = static_cast<int>(blockIdx.x % static_cast<unsigned>(row_chunks));
  const int split = static_cast<int>(blockIdx.x / static_cast<unsigned>(row_chunks));
  const int g_kv = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  const int h_ratio = p.h_ratio;

  const int s_q = p.seq_len_q(b);
  const int s_k = p.seq_len_k(b);
  const int nrows = s_q * h_ratio;
  const int r0 = chunk * Cfg::kRows;
  if (r0 >= nrows) return;  // the whole block: before any barrier
  const int r_last = min(r0 + Cfg::kRows, nrows) - 1;
  const int i_lo = r0 / h_ratio, i_hi = r_last / h_ratio;
  const semantics::KeyRange lo = semantics::visible_keys(i_lo, s_q, s_k, p.mask);
  const semantics::KeyRange hi = semantics::visible_keys(i_hi, s_q, s_k, p.mask);
  const std::int64_t kb = lo.begin, ke = hi.end;            // union of the rows' intervals
  const std::int64_t full_lo = hi.begin, full_hi = lo.end;  // their intersection
  // Split `split` takes key tiles t_begin, t_begin + splits, ... < t_end (interleaved, as
  // the sm80 kernel; its tiles are 64 keys here, the plan's split count the same).
  std::int64_t t_begin = 0, t_end = 0;
  if (ke > kb) {
    t_begin = kb / kBlockN + split;
    t_end = (ke + kBlockN - 1) / kBlockN;
  }

  if (tid == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      for (int g = 0; g < Cfg::kGroups; ++g) mbar_init(&full[s * Cfg::kGroups + g], 1);
      mbar_init(&empty[s], 4 * Cfg::kConsumers);
    }
    mbar_init(bar_tail, 1);
    for (int c = 0; c < Cfg::kConsumers; ++c) mbar_init(&p_ready[c], 128);  // every thread of the owner
    mbar_init_fence();
  }
  // Latent column blocks past d_v are never copied: zero in both stages, once.
  for (int idx = tid; idx < (8 - a.v_segs) * 64 * 8; idx += Cfg::kThreads) {
    const int seg = 1 + a.v_segs + idx / (64 * 8);
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      *reinterpret_cast<uint4*>(sKV + s * Cfg::kTileBytes + seg * kSegBytes + (idx % (64 * 8)) * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
  fence_proxy_async_smem();
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0) {
      const bool leader = lane == 0;
      if (leader) {
        prefetch_tensor_map(&a.tmap_k);
        prefetch_tensor_map(&a.tmap_v);
      }
      const int k_row0 = p.cu_seqlens_k != nullptr ? p.k_start(b) : 0;
      const int k_b = p.cu_seqlens_k != nullptr || p.is_paged() ? 0 : p.cache_row(b);
      // Column blocks copied per group (block 0 the rope keys, 1 + c the latent block c < v_segs).
      auto group_segs = [&](int g) {
        return max(0, min(Cfg::kGroupSegs, 1 + a.v_segs - g * Cfg::kGroupSegs));
      };
      int it = 0, tail_it = 0;
      for (std::int64_t tile = t_begin; tile < t_end; tile += splits, ++it) {
        const int stage = it % Cfg::kStages;
        const std::uint32_t phase = (it / Cfg::kStages) & 1;
        unsigned char* dst = sKV + stage * Cfg::kTileBytes;
        const int j0 = static_cast<int>(tile) * kBlockN;
        const int valid = s_k - j0;  // >= 1: tile < t_end
        const bool tail = valid < kBlockN && !a.v_tail_zero;
        std::uint64_t* full_g = &full[stage * Cfg::kGroups];
        // The barrier of column block seg: its group's, or with a tail the tail barrier.
        auto bar = [&](int seg) { return tail ? bar_tail : &full_g[seg / Cfg::kGroupSegs]; };
        // The tile's first block-table entry read before the wait for its stage, so that
        // the load's latency is not added to the copy's (blocks of 64: the only one).
        const int* table = p.block_table + std::int64_t(b) * p.block_table_batch_stride;
        int page0 = 0;
        if (leader && a.page_rows != 0) page0 = table[j0 / p.block_size];
        mbar_wait(&empty[stage], phase ^ 1);
        if (leader) {
          // The expected bytes of each barrier: rows copied x 128 bytes per column block.
          const int copy_rows = a.page_rows == 0 ? kBlockN
                                                 : min(kBlockN / a.page_rows, (valid + a.page_rows - 1) / a.page_rows) *
                                                       a.page_rows;
          if (tail) {
            mbar_arrive_expect_tx(bar_tail, copy_rows * 128u * (1 + a.v_segs));
          } else {
            for (int g = 0; g < Cfg::kGroups; ++g) mbar_arrive_expect_tx(&full_g[g], copy_rows * 128u * group_segs(g));
          }
          if (a.page_rows == 0) {
            tma_load_4d(dst, &a.tmap_k, 0, k_row0 + j0, g_kv, k_b, bar(0));
            for (int c = 0; c < a.v_segs; ++c) {
              tma_load_4d(dst + (1 + c) * kSegBytes, &a.tmap_v, 64 * c, k_row0 + j0, g_kv, k_b, bar(1 + c));
            }
          } else {
            // Boxes of page_rows rows, none crossing a block; those wholly past the keys'
            // end are not copied (their rows are masked, their latent zeroed below).
            const int rows = a.page_rows;
            const int chunks = copy_rows / rows;
            for (int ch = 0; ch < chunks; ++ch) {
              const int j = j0 + ch * rows;
              // block_id's clamp (params.hpp), on the hoisted row of the table
              const int entry = ch == 0 ? page0 : table[j / p.block_size];
              const int page = FwdParams::clamp_index(entry, 0, p.kv_cache_rows - 1);
              const int jr = j % p.block_size;
              tma_load_4d(dst + ch * rows * 128, &a.tmap_k, 0, jr, g_kv, page, bar(0));
              for (int c = 0; c < a.v_segs; ++c) {
                tma_load_4d(dst + (1 + c) * kSegBytes + ch * rows * 128, &a.tmap_v, 64 * c, jr, g_kv, page, bar(1 + c));
              }
            }
          }
        }
        if (tail) {
          // The latent rows past the keys' end (whatever the tensor holds there, or a
          // previous tile's rows where no box was copied) to zero, then the tile is full.
          mbar_wait(bar_tail, tail_it & 1);
          ++tail_it;
          for (int idx = valid * 8 + lane; idx < kBlockN * 8; idx += 32) {
#pragma unroll
            for (int c = 1; c < Cfg::kSegs; ++c) {
              *reinterpret_cast<uint4*>(dst + c * kSegBytes + idx * 16) = make_uint4(0, 0, 0, 0);
            }
          }
          fence_proxy_async_smem();
          __syncwarp();
          if (leader) {
            for (int g = 0; g < Cfg::kGroups; ++g) mbar_arrive(&full_g[g]);
          }
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cw = warp_uniform(wg - 1);  // O's columns 256 cw .. 256 cw + 255
  const int ctid = tid - 128;           // 0 .. 255 over both consumers
  const int warp_in = warp % 4;

  // ---- q' = [q | qv]: 64 rows x 72 chunks of 16 bytes, chunk c of row rr into column
  // block c / 8 at the 128-byte swizzle's position ((c % 8) ^ (rr % 8)); zero past d, d_v
  // and past the chunk's rows.
  {
    const auto* qg = static_cast<const unsigned char*>(p.q);
    const auto* qvg = static_cast<const unsigned char*>(p.qv);
    for (int idx = ctid; idx < Cfg::kRows * Cfg::kSegs * 8; idx += 128 * Cfg::kConsumers) {
      const int rr = idx / (Cfg::kSegs * 8), c = idx % (Cfg::kSegs * 8);
      const int r = r0 + rr;
      const bool row_ok = r < nrows;
      const int i = row_ok ? r / h_ratio : 0, h = g_kv * h_ratio + (row_ok ? r % h_ratio : 0);
      const void* src;
      bool ok;
      if (c < 8) {
        ok = row_ok && c * 8 < p.d;
        src = qg + (p.q_offset(b) + std::int64_t(i) * p.q_row_stride + std::int64_t(h) * p.q_head_stride + c * 8) * 2;
      } else {
        ok = row_ok && (c - 8) * 8 < p.d_v;
        src = qvg +
              (p.qv_offset(b) + std::int64_t(i) * p.qv_row_stride + std::int64_t(h) * p.qv_head_stride + (c - 8) * 8) * 2;
      }
      const std::uint32_t dst = smem_addr(sQ + (c / 8) * kSegBytes + rr * 128 + (((c % 8) ^ (rr % 8)) * 16));
      sm80::cp_async_16(dst, ok ? src : p.q, ok);
    }
    sm80::cp_async_commit();
    sm80::cp_async_wait<0>();
    fence_proxy_async_smem();  // q' written by the generic proxy, read by wgmma
    named_barrier_sync(Cfg::kBarConsumers, 128 * Cfg::kConsumers);
  }

  // ---- this thread's two rows (accumulator rows 16 warp_in + lane / 4, + 8)
  int row_i[2], row_jb[2], row_je[2];
  float row_slope[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = r0 + 16 * warp_in + lane / 4 + 8 * hf;
    const bool valid = r < nrows;
    const int i = valid ? r / h_ratio : i_lo;
    row_i[hf] = i;
    const semantics::KeyRange kr = semantics::visible_keys(i, s_q, s_k, p.mask);
    row_jb[hf] = valid ? static_cast<int>(kr.begin) : 0;
    row_je[hf] = valid ? static_cast<int>(kr.end) : 0;
    row_slope[hf] = valid ? p.alibi_slope(b, g_kv * h_ratio + r % h_ratio) : 0.0f;
  }

  const bool plain = p.softcap == 0.0f && p.alibi_slopes == nullptr;
  const float scale_log2 = p.scale * kLog2e;

  float o[128];
#pragma unroll
  for (int n = 0; n < 128; ++n) o[n] = 0.0f;
  // The rows' reference max (the same in both consumers: the owner of a tile computes it,
  // the other reads it with the tile's P) and this consumer's share of the row sums (its
  // own tiles' P, rescaled with every tile's factor as its O is: the shares add up at the end).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  float s[32];
  std::uint32_t pa[4][4];

  // Descriptor low words (sm90_wgmma.cuh): one add per k-step; q', k' and P share the
  // column-block layout (64 rows of 128 bytes per block).
  const std::uint32_t q_lo0 = smem_desc_lo(smem_addr(sQ), 0);
  const std::uint32_t kv_addr = smem_addr(sKV);
  const int row_a = 16 * warp_in + lane / 4;  // this thread's rows row_a, row_a + 8
  const int n_tiles = t_end > t_begin ? static_cast<int>((t_end - t_begin + splits - 1) / splits) : 0;
  const int other = 1 - cw;

  // Tile t (local index: the ring's order) is in stage t % kStages; consumer t % 2 owns it
  // (with 2 stages, consumer c's tiles are the stage-c tiles). Each warp of both consumers
  // releases it once, after its own P V of the tile completed.
  auto release = [&](int t) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[t % Cfg::kStages]);
  };
  auto stage_addr = [&](int t) { return kv_addr + (t % Cfg::kStages) * Cfg::kTileBytes; };
  // O[:, 256 cw ..] += P V: V = the tile's latent blocks 1 + 4 cw .. 4 + 4 cw, MN-major
  // (blocks 8192 bytes apart), 16 keys (2048 bytes) per k-step.
  auto v_lo = [&](int t) { return smem_desc_lo(stage_addr(t) + (1 + 4 * cw) * kSegBytes, kSegBytes); };
  auto rescale = [&](const float (&corr)[2]) {
    // Warp-uniform: skipped unless some row of the warp moved its reference max.
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < 128; ++n) o[n] *= corr[(n % 4) / 2];
    }
  };

  // Tile t's column-block group g has landed (the TMA's writes visible to this thread).
  auto wait_group = [&](int t, int g) {
    mbar_wait(&full[(t % Cfg::kStages) * Cfg::kGroups + g], (t / Cfg::kStages) & 1);
  };
  auto issue_s = [&](int own) {
    // S = q' k'^T over the 576 dims: 36 k-steps of 32 bytes, 4 per column block; a commit
    // group per column-block group, each issued once its blocks have landed.
    // q's descriptor opaque here: hoisted out of the tile loop, every k-step's would stay live.
    std::uint32_t q_lo = q_lo0;
    asm volatile("" : "+r"(q_lo));
    const std::uint32_t k_lo = smem_desc_lo(stage_addr(own), 0);
#pragma unroll
    for (int g = 0; g < Cfg::kGroups; ++g) {
      wait_group(own, g);
      wgmma_fence();
#pragma unroll
      for (int kg = 0; kg < Cfg::kGroupSegs * 4; ++kg) {
        const int ks = g * Cfg::kGroupSegs * 4 + kg;
        const std::uint32_t off = ((ks / 4) * kSegBytes + (ks % 4) * 32) / 16;
        Wgmma<64>::template ss<Element, 0>(s, smem_desc_from_lo(q_lo + off), smem_desc_from_lo(k_lo + off),
                                           ks > 0 ? 1 : 0);
      }
      wgmma_commit();
    }
  };
  // The other consumer's tile t: once its owner handed P(t) over (P in the stage's rope
  // block, the rows' reference max and factor in sMax / sCorr, stored and fenced before
  // the owner's p_ready arrive), this consumer's O and row sums take the factor (its O is
  // not in flight: its own P V of t - 1 was waited on) and the max.
  auto take_over = [&](int t) {
    mbar_wait(&p_ready[other], (t / 2) & 1);
    float corr[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      corr[hf] = sCorr[other * Cfg::kRows + row_a + 8 * hf];
      row_max[hf] = sMax[other * Cfg::kRows + row_a + 8 * hf];
      row_sum[hf] *= corr[hf];
    }
    rescale(corr);
  };
  // P(t) V from shared memory: A = the stage's rope block (P, K-major as q'), B = V. Tile
  // t's copy completed before its owner's S; this consumer's own wait on the full barrier
  // (its phase long complete) is what makes the TMA's writes visible to it.
  auto pv_shared = [&](int t) {
#pragma unroll
    for (int g = 0; g < Cfg::kGroups; ++g) wait_group(t, g);
    const std::uint32_t p_lo = smem_desc_lo(stage_addr(t), 0);
    const std::uint32_t vl = v_lo(t);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Wgmma<256>::template ss<Element, 1>(o, smem_desc_from_lo(p_lo + kk * 32 / 16),
                                          smem_desc_from_lo(vl + kk * 16 * 128 / 16), 1);
    }
    wgmma_commit();
  };
  // Scores, mask, online softmax (lazy rescale) of the own tile on the accumulator layout:
  // s[4 c + 2 hf + e] is row hf's key 8 c + 2 (lane % 4) + e of the tile; P to pa (16-bit)
  // and to s (fp32, for the row sums). The common tile (no softcap, no ALiBi, every row of
  // the chunk sees every key, scale > 0) takes a straight path: the max of the raw scores,
  // then one FFMA and one EX2 per score. Otherwise the scores go to log2 units first (each
  // option a loop under its own uniform branch), then the mask.
  auto softmax = [&](int own, float (&corr)[2]) {
    const std::int64_t j0 = (t_begin + std::int64_t(own) * splits) * kBlockN;
    const bool full_tile = j0 >= full_lo && j0 + kBlockN <= full_hi;
    float mul = 1.0f;
    if (plain && full_tile && scale_log2 > 0.0f) {
      mul = scale_log2;
    } else if (plain) {
#pragma unroll
      for (int n = 0; n < 32; ++n) s[n] *= scale_log2;
    } else {
#pragma unroll
      for (int n = 0; n < 32; ++n) s[n] *= p.scale;
      if (p.softcap > 0.0f) {
#pragma unroll
        for (int n = 0; n < 32; ++n) s[n] = p.softcap * tanhf(s[n] / p.softcap);
      }
      if (p.alibi_slopes != nullptr) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          const int hf = (n % 4) / 2;
          std::int64_t dist = std::int64_t(row_i[hf]) + s_k - s_q - (j0 + 8 * (n / 4) + 2 * (lane % 4) + n % 2);
          if (dist < 0) dist = -dist;
          s[n] -= row_slope[hf] * static_cast<float>(dist);
        }
      }
#pragma unroll
      for (int n = 0; n < 32; ++n) s[n] *= kLog2e;
    }
    if (!full_tile) {
      // The rows' visible keys relative to the tile, clamped to [-1, 65].
      int lo[2], hi[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const std::int64_t b_rel = row_jb[hf] - j0, e_rel = row_je[hf] - j0;
        lo[hf] = b_rel < -1 ? -1 : b_rel > kBlockN + 1 ? kBlockN + 1 : static_cast<int>(b_rel);
        hi[hf] = e_rel < -1 ? -1 : e_rel > kBlockN + 1 ? kBlockN + 1 : static_cast<int>(e_rel);
      }
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int hf = (n % 4) / 2, j = 8 * (n / 4) + 2 * (lane % 4) + n % 2;
        s[n] = j >= lo[hf] && j < hi[hf] ? s[n] : -INFINITY;
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < 8; ++c) m = fmaxf(m, fmaxf(s[4 * c + 2 * hf], s[4 * c + 2 * hf + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      m = fmaxf(row_max[hf], m * mul);
      // A row with no visible key yet keeps -inf (-inf - -inf is NaN and compares false).
      const bool move = m - row_max[hf] > kMlaRescaleLog2;
      const float old = row_max[hf];
      if (move) row_max[hf] = m;
      const float base = row_max[hf] == -INFINITY ? 0.0f : row_max[hf];
      corr[hf] = move ? sm80::fast_exp2(old - base) : 1.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
#pragma unroll
        for (int e = 0; e < 2; ++e) s[4 * c + 2 * hf + e] = sm80::fast_exp2(fmaf(s[4 * c + 2 * hf + e], mul, -base));
      }
    }
    pack_a_frags<Element>(s, pa);
  };
  // P of the own tile to its stage's rope block for the other consumer (S(own), block 0's
  // only reader, has completed: waited on before the softmax; the block is loaded again
  // only after both consumers released the tile, the other after its P V of it): the A
  // operand's layout, row r at 128 r, key chunk c (8 keys, 16 bytes) at the 128-byte
  // swizzle's position c ^ (r % 8). stmatrix x4 per 16 keys: matrix i (lanes 8 i .. 8 i + 7
  // give its rows) is rows 16 warp_in + 8 (i % 2) + (0..7) of chunk 2 kk + i / 2, register
  // i = pa[kk][i]. Each 8-row matrix covers 8 distinct 16-byte bank groups. Then the rows'
  // max and factor; all fenced for the async proxy, then every thread's arrive (release):
  // each thread's own stores are ordered before the other consumer's wait (acquire), with
  // no warp barrier in the chain (compute-sanitizer's racecheck does not carry the order
  // through __syncwarp to lane 0's arrive: it reported the rows' max / factor stores of
  // the other lanes as RAW hazards). One warp instruction either way.
  auto hand_over = [&](int own, const float (&corr)[2]) {
    // The row part opaque: hoisted out of the tile loop, the 4 addresses would stay live.
    int mi = lane / 8, mr = lane % 8;
    asm volatile("" : "+r"(mi), "+r"(mr));
    const std::uint32_t row_addr = stage_addr(own) + (16 * warp_in + 8 * (mi % 2) + mr) * 128;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      stmatrix_x4(row_addr + (((2 * kk + mi / 2) ^ mr) * 16), pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
    }
    if (lane % 4 == 0) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        sMax[cw * Cfg::kRows + row_a + 8 * hf] = row_max[hf];
        sCorr[cw * Cfg::kRows + row_a + 8 * hf] = corr[hf];
      }
    }
    fence_proxy_async_smem();  // P written by the generic proxy, read by the other's wgmma
    mbar_arrive(&p_ready[cw]);
  };
  // P V of the own tile from registers, waited on: this consumer's next tile (own + 2)
  // needs the stage back, and its next rescale needs O.
  auto pv_own = [&](int own, const float (&corr)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) sum += s[4 * c + 2 * hf] + s[4 * c + 2 * hf + 1];
      row_sum[hf] = row_sum[hf] * corr[hf] + sum;
    }
    rescale(corr);
    const std::uint32_t vl = v_lo(own);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Wgmma<256>::template rs<Element, 1>(o, pa[kk], smem_desc_from_lo(vl + kk * 16 * 128 / 16), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    release(own);
  };
  // Which comes first in a round: S of the own tile (its stage has landed) or P V of the
  // other's previous tile (its P has been handed over). One thread polls both barriers;
  // the warpgroup takes its answer (wgmma's issue order must be the warpgroup's).
  auto s_goes_first = [&](int own, int oth) {
    int* slot = s_order + 2 * cw + ((own / 2) & 1);
    if (warp_in == 0 && lane == 0) {
      int first = 0;
      for (;;) {
        if (mbar_test(&full[(own % Cfg::kStages) * Cfg::kGroups], (own / Cfg::kStages) & 1)) {
          first = 1;
          break;
        }
        if (mbar_test(&p_ready[other], (oth / 2) & 1)) break;
      }
      *slot = first;
    }
    // (Constant barrier ids: a computed one makes ptxas reserve all 16.)
    if (cw == 0) {
      named_barrier_sync(Cfg::kBarOrder, 128);
    } else {
      named_barrier_sync(Cfg::kBarOrder + 1, 128);
    }
    return warp_uniform(*slot) != 0;
  };

  // The schedule (the header's timeline): consumer cw's round k takes the other's tile
  // oth = own - 1 and its own tile own = 2 k + cw. S(own) goes to the tensor pipe as soon as
  // its first column-block group has landed, also before P(oth) arrives: then it runs while
  // the other consumer computes the softmax of oth, and P(oth) V queues behind it (this
  // consumer's wgmma run in issue order). When P(oth) comes first (the stage is still
  // loading), P(oth) V goes first and is waited on, releasing oth (the ring's next load)
  // before the wait for own's stage. The
  // softmax of own always follows the take-over of oth (the reference max runs through the
  // tiles in order); P(own) is handed over before P(own) V from registers.
  for (int own = cw;; own += 2) {
    const int oth = own - 1;
    const bool has_oth = oth >= 0 && oth < n_tiles;
    if (own >= n_tiles) {
      // The other consumer's last tile (or none).
      if (has_oth) {
        take_over(oth);
        pv_shared(oth);
        wgmma_wait<0>();
        release(oth);
      }
      break;
    }
    bool oth_held = false;  // P(oth) V issued, its wait (and the release of oth) still to come
    if (!has_oth) {
      // Consumer 0's tile 0: nothing to take over.
      issue_s(own);
      wgmma_wait<0>();
    } else if (s_goes_first(own, oth)) {
      issue_s(own);
      take_over(oth);
      pv_shared(oth);
      wgmma_wait<1>();  // S(own)'s groups; P(oth) V may still run
      oth_held = true;
    } else {
      // P(oth) V waited on and oth released before the wait for the own stage: the ring's
      // next load into oth's stage does not wait for own's to land.
      take_over(oth);
      pv_shared(oth);
      wgmma_wait<0>();
      release(oth);
      issue_s(own);
      wgmma_wait<0>();  // S(own)
    }
    float corr[2];
    softmax(own, corr);
    hand_over(own, corr);
    wgmma_wait<0>();  // P(oth) V where it is still in flight; nothing otherwise
    if (oth_held) release(oth);
    pv_own(own, corr);
  }

  // ---- the row sums: this consumer's share plus the other's.
  float row_l[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = row_sum[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    row_l[hf] = l;
    if (lane % 4 == 0) sL[cw * Cfg::kRows + row_a + 8 * hf] = l;
  }
  named_barrier_sync(Cfg::kBarConsumers, 128 * Cfg::kConsumers);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) row_l[hf] += sL[(1 - cw) * Cfg::kRows + row_a + 8 * hf];
  // ---- epilogue: each consumer its 256 columns of its rows; lse from consumer 0.
  const bool out_bf16 = __is_same(Element, __nv_bfloat16);
  const bool sink_here = p.sink != nullptr && splits == 1;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const float l = row_l[hf];
    const int r = r0 + row_a + 8 * hf;
    const bool valid = r < nrows;
    const int i = row_i[hf], h = g_kv * h_ratio + (valid ? r % h_ratio : 0);
    // Base 0 when the row saw no key; a learnable sink (without splits; with them it joins
    // in the merge) adds exp2(sink_log2) to the sum (as the sm80 MLA kernel).
    float mb = row_max[hf] == -INFINITY ? 0.0f : row_max[hf];
    float ll = l;
    if (sink_here && valid) {
      const float s2 = p.sink[h] * kLog2e;
      const float top = ll != 0.0f ? fmaxf(mb, s2) : s2;
      ll = (ll != 0.0f ? ll * sm80::fast_exp2(mb - top) : 0.0f) + sm80::fast_exp2(s2 - top);
      mb = top;
    }
    const float f = (ll != 0.0f && l != 0.0f) ? sm80::fast_exp2(row_max[hf] - mb) / ll : 0.0f;
    if (!valid) continue;
    const std::int64_t ws_row = ((std::int64_t(split) * p.batch + b) * p.h_q + h) * p.seqlen_q + i;
    const int col0 = 256 * cw + 2 * (lane % 4);
    if (splits > 1) {
      float* dst = a.split.ws_o + ws_row * p.d_v + col0;
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        if (256 * cw + 8 * c < p.d_v) {
          *reinterpret_cast<float2*>(dst + 8 * c) = make_float2(o[4 * c + 2 * hf] * f, o[4 * c + 2 * hf + 1] * f);
        }
      }
    } else {
      auto* out = static_cast<std::uint16_t*>(p.out) + p.o_offset(b) + std::int64_t(i) * p.o_row_stride +
                  std::int64_t(h) * p.o_head_stride + col0;
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        if (256 * cw + 8 * c < p.d_v) {
          *reinterpret_cast<std::uint32_t*>(out + 8 * c) =
              sm80::pack_out(o[4 * c + 2 * hf] * f, o[4 * c + 2 * hf + 1] * f, out_bf16);
        }
      }
    }
    if (cw == 0 && lane % 4 == 0) {
      // -inf when the row saw no key (and no sink); NaN when its sum is NaN.
      const float lse = ll == 0.0f ? -INFINITY : (mb + log2f(ll)) * 0.6931471805599453f;
      if (splits > 1) {
        a.split.ws_lse[ws_row] = lse;
      } else if (p.lse) {
        p.lse[p.lse_offset(b, h) + i] = lse;
      }
    }
  }

  // ---- splits: the last of this row chunk's splits to arrive merges them, a warp per row
  // (the consumers' 8 warps; the producer has left).
  if (splits > 1) {
    named_barrier_sync(Cfg::kBarConsumers, 128 * Cfg::kConsumers);  // both consumers' partials are stored
    if (ctid == 0) {
      *merge_flag = sm80::arrive_split(a.split.ws_count + (std::int64_t(b) * p.h_k + g_kv) * row_chunks + chunk, splits);
    }
    named_barrier_sync(Cfg::kBarConsumers, 128 * Cfg::kConsumers);
    if (!*merge_flag) return;
    for (int r = r0 + ctid / 32; r <= r_last; r += 4 * Cfg::kConsumers) {
      const int i = r / h_ratio, h = g_kv * h_ratio + r % h_ratio;
      sm80::merge_split_row(p, a.split, b, h, i, lane, p.d_v);
    }
  }
#endif
}

}  // namespace flashattn::detail::cuda::sm90
