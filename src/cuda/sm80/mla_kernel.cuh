// Multi-head latent attention (MLA, FlashAttention-3's qv) on mma.sync (sm80 and later):
// score(i, j) = scale * (q_i . k_j + qv_i . v_j), out_i = sum_j P_ij v_j, for the
// DeepSeek-style decode shape (k the rope keys, d <= 64; v the latent, d_v <= 512; one KV
// head under many query heads), dense or paged caches, and the dense / varlen forward.
//
// One block per (64-row query chunk, split) x KV head x sequence, 8 warps. GQA packing as
// in the decode kernel (decode_kernel.cuh): the s_q * h_ratio query rows of KV head g are
// row r = i * h_ratio + hh, so each latent byte is read once per 64 query rows. q' = [q |
// qv] (64 rows x 576 dims, zero-padded past d and d_v) stays in shared memory; each 32-key
// tile k' = [k | v] arrives by 16-byte cp.async (paged block tables, varlen, cache rows:
// FwdParams' per-key addressing) into a 2-stage pipeline, the latent copied once for the
// score and the value.
//
// Per tile:
//   S: warp w computes rows 16 (w % 4) .. +15 x keys 16 (w / 4) .. +15 over the 576 dims
//      (m16n8k16, q' and k' fragments by ldmatrix), scales and masks it, and stores it to
//      shared memory (fp32);
//   softmax: the two warps of a row group (w, w + 4) each read the group's 16 x 32 scores
//      and run the same online softmax on them (the same bits in both, so no further
//      exchange), P in registers as the A fragments of the PV product;
//   O += P V: warp w holds O's rows of its group and the columns 256 (w / 4) .. +255
//      (32 n8 tiles, 128 fp32 registers), V fragments by ldmatrix.trans of the tile's
//      latent part.
// The epilogue needs no merge between warps: each writes its own columns of out (or with
// splits > 1 its fp32 partials; the last split of a row chunk merges them,
// collective/split_kv_merge.cuh). Masks, softcap, ALiBi and the learnable sink as in the
// decode kernel (semantics::visible_keys per row).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/arch/sm80.cuh"
#include "cuda/collective/convert.cuh"
#include "cuda/collective/split_kv_merge.cuh"
#include "cuda/sm80/decode_loaders.cuh"
#include "cuda/sm80/mla_launch.hpp"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda::sm80 {

template <typename Element>
__global__ void __launch_bounds__(MlaTraits::kThreads, 1)
    mla_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ MlaArgs a) {
  using Tr = MlaTraits;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kRowBytes = Tr::kRowBytes;
  constexpr int kOTiles = Tr::kDimV / 2 / 8;  // this warp's 256 columns of O in n8 tiles
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_smem = smem;
  unsigned char* pipe = smem + Tr::kQBytes;
  float* s_smem = reinterpret_cast<float*>(pipe + Tr::kStages * Tr::kTileBytes);

  const int chunk = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.row_chunks));
  const int split = static_cast<int>(blockIdx.x / static_cast<unsigned>(a.row_chunks));
  const int g_kv = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int rg = warp & 3;  // row group: rows 16 rg .. 16 rg + 15 of the chunk
  const int half = warp >> 2;  // S: keys 16 half .. +15; O: columns 256 half .. +255
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
  const std::int64_t kb = lo.begin, ke = hi.end;            // union of the rows' intervals
  const std::int64_t full_lo = hi.begin, full_hi = lo.end;  // their intersection

  // Split `split` takes key tiles t_begin, t_begin + splits, ... < t_end (interleaved, as
  // the decode kernel: the blocks of a sequence stream through one region of the cache).
  std::int64_t t_begin = 0, t_end = 0;
  if (ke > kb) {
    t_begin = kb / kBlockN + split;
    t_end = (ke + kBlockN - 1) / kBlockN;
  }
  const int t_step = a.splits;

  // ---- this thread's two packed rows (MMA rows gq and gq + 8 of its row group)
  int row_i[2], row_jb[2], row_je[2];
  float row_slope[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = r0 + 16 * rg + gq + 8 * hf;
    const bool valid = r < nrows;
    const int i = valid ? r / h_ratio : i_lo;
    row_i[hf] = i;
    const semantics::KeyRange kr = semantics::visible_keys(i, s_q, s_k, p.mask);
    row_jb[hf] = valid ? static_cast<int>(kr.begin) : 0;
    row_je[hf] = valid ? static_cast<int>(kr.end) : 0;
    row_slope[hf] = valid ? p.alibi_slope(b, g_kv * h_ratio + r % h_ratio) : 0.0f;
  }

  // ---- k' tile loader: thread t copies row t / 8 of the tile, chunk t % 8 of k and chunks
  // t % 8 + 8 m (m < 8) of v, zero-filled past the sequence, past d and past d_v (one
  // address computation per row and tile, whatever the cache's layout).
  const auto* kg = static_cast<const unsigned char*>(p.k);
  const auto* vg = static_cast<const unsigned char*>(p.v);
  const int ld_row = tid >> 3, ld_c8 = tid & 7;
  auto load_tile = [&](std::int64_t tile, int stage) {
    unsigned char* dst = pipe + stage * Tr::kTileBytes + ld_row * kRowBytes;
    const std::int64_t j = tile * kBlockN + ld_row;
    const bool ok = j < s_k;
    const std::int64_t ko = ok ? p.k_offset(b, j, g_kv) * 2 : 0;
    const std::int64_t vo = ok ? p.v_offset(b, j, g_kv) * 2 : 0;
    const bool k_ok = ok && ld_c8 * 8 < p.d;
    decode_detail::cp_async_n(smem_u32(dst + ld_c8 * 16), k_ok ? kg + ko + ld_c8 * 16 : kg, k_ok ? 16 : 0);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int c = ld_c8 + 8 * m;  // chunk of v
      const bool v_ok = ok && c * 8 < p.d_v;
      decode_detail::cp_async_n(smem_u32(dst + (8 + c) * 16), v_ok ? vg + vo + c * 16 : vg, v_ok ? 16 : 0);
    }
  };

  // ---- prologue: q' (4 threads per row, 18 chunks each) and the first tile, one group
  {
    const int rr = tid >> 2;
    const int r = r0 + rr;
    const bool ok = r < nrows;
    const int i = ok ? r / h_ratio : 0, h = g_kv * h_ratio + (ok ? r % h_ratio : 0);
    const auto* qrow = static_cast<const unsigned char*>(p.q) +
                       (p.q_offset(b) + std::int64_t(i) * p.q_row_stride + std::int64_t(h) * p.q_head_stride) * 2;
    const auto* qvrow = static_cast<const unsigned char*>(p.qv) +
                        (p.qv_offset(b) + std::int64_t(i) * p.qv_row_stride + std::int64_t(h) * p.qv_head_stride) * 2;
    unsigned char* dst = q_smem + rr * kRowBytes;
#pragma unroll
    for (int m = 0; m < Tr::kChunks / 4; ++m) {
      const int c = (tid & 3) + 4 * m;
      if (c < 8) {
        const bool v = ok && c * 8 < p.d;
        decode_detail::cp_async_n(smem_u32(dst + c * 16), v ? qrow + c * 16 : p.q, v ? 16 : 0);
      } else {
        const bool v = ok && (c - 8) * 8 < p.d_v;
        decode_detail::cp_async_n(smem_u32(dst + c * 16), v ? qvrow + (c - 8) * 16 : p.qv, v ? 16 : 0);
      }
    }
  }
  if (t_begin < t_end) load_tile(t_begin, 0);
  cp_async_commit();

  // ---- scores
  const bool plain = p.softcap == 0.0f && p.alibi_slopes == nullptr;
  const float scale_log2 = p.scale * kLog2e;
  // Score x of row hf with key j, in log2 units, -inf where masked (unless `full`: every
  // row of the chunk sees the whole tile).
  auto score = [&](float x, int hf, std::int64_t j, bool full) {
    if (plain) {
      x *= scale_log2;
    } else {
      x *= p.scale;
      if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
      if (row_slope[hf] != 0.0f) {
        std::int64_t dist = std::int64_t(row_i[hf]) + s_k - s_q - j;
        if (dist < 0) dist = -dist;
        x -= row_slope[hf] * static_cast<float>(dist);
      }
      x *= kLog2e;
    }
    if (!full && !(j >= row_jb[hf] && j < row_je[hf])) x = -INFINITY;
    return x;
  };

  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  // ldmatrix addresses: q' rows of the group (A: matrices rows 0-7 / 8-15 x chunks 0 / 1);
  // k' rows of this warp's 16 keys (B, non-transposed: keys 0-7 / 8-15 x chunks 0 / 1);
  // v rows for PV (B, transposed: keys 0-7 / 8-15 x chunks 0 / 1 of a 16-dim group).
  const std::uint32_t q_addr = smem_u32(q_smem) + (16 * rg + (lane & 15)) * kRowBytes + (lane >> 4) * 16;
  const std::uint32_t k_off = (16 * half + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((lane >> 3) & 1) * 16;
  const std::uint32_t v_off =
      ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (8 + 32 * half + (lane >> 4)) * 16;

  int stage = 0;
  for (std::int64_t tile = t_begin; tile < t_end; tile += t_step) {
    cp_async_wait<0>();
    __syncthreads();  // the tile (and q') in; every warp is done with the other stage and S
    if (tile + t_step < t_end) load_tile(tile + t_step, stage ^ 1);
    cp_async_commit();
    const std::uint32_t ks = smem_u32(pipe + stage * Tr::kTileBytes);
    const std::int64_t j0 = tile * kBlockN;
    const bool full = j0 >= full_lo && j0 + kBlockN <= full_hi;

    // S for this warp's 16 rows x 16 keys over the 576 dims, even and odd 16-dim steps in
    // their own accumulators (two dependency chains of 18 MMAs per n8 tile, not one of 36).
    {
      float sacc[2][4], sodd[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] = sodd[nt][e] = 0.0f;
      }
#pragma unroll 3
      for (int s = 0; s < Tr::kDimS / 16; s += 2) {
        std::uint32_t qa[4], kr[4], qb[4], kq[4];
        ldmatrix_x4(q_addr + s * 32, qa);
        ldmatrix_x4(ks + k_off + s * 32, kr);
        ldmatrix_x4(q_addr + s * 32 + 32, qb);
        ldmatrix_x4(ks + k_off + s * 32 + 32, kq);
        mma_m16n8k16<Element>(sacc[0], qa, kr[0], kr[1]);
        mma_m16n8k16<Element>(sacc[1], qa, kr[2], kr[3]);
        mma_m16n8k16<Element>(sodd[0], qb, kq[0], kq[1]);
        mma_m16n8k16<Element>(sodd[1], qb, kq[2], kq[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] += sodd[nt][e];
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int kl = 16 * half + 8 * nt + 2 * tq;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float x0 = score(sacc[nt][2 * hf], hf, j0 + kl, full);
          const float x1 = score(sacc[nt][2 * hf + 1], hf, j0 + kl + 1, full);
          *reinterpret_cast<float2*>(s_smem + (16 * rg + gq + 8 * hf) * Tr::kSStride + kl) = make_float2(x0, x1);
        }
      }
    }
    __syncthreads();  // S of the whole chunk in shared memory

    // Online softmax over the row group's 32 keys (the same in both warps of the group).
    float sf[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 v =
            *reinterpret_cast<const float2*>(s_smem + (16 * rg + gq + 8 * hf) * Tr::kSStride + 8 * nt + 2 * tq);
        sf[nt][2 * hf] = v.x;
        sf[nt][2 * hf + 1] = v.y;
      }
    }
    float alpha[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(sf[nt][2 * hf], sf[nt][2 * hf + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[hf], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      alpha[hf] = fast_exp2(row_max[hf] - m_use);
      row_max[hf] = m_new;
      float sum = row_sum[hf] * alpha[hf];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = fast_exp2(sf[nt][2 * hf + e] - m_use);
          sum += pv;
          sf[nt][2 * hf + e] = pv;
        }
      }
      row_sum[hf] = sum;
    }
    // O rescale, skipped when no row of the warp saw a new maximum (alpha == 1 exactly).
    if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
      for (int nt = 0; nt < kOTiles; ++nt) {
        o[nt][0] *= alpha[0];
        o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1];
        o[nt][3] *= alpha[1];
      }
    }

    // O += P V over the tile's two 16-key steps.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      std::uint32_t pa[4];
      pa[0] = pack2<Element>(sf[2 * kk][0], sf[2 * kk][1]);
      pa[1] = pack2<Element>(sf[2 * kk][2], sf[2 * kk][3]);
      pa[2] = pack2<Element>(sf[2 * kk + 1][0], sf[2 * kk + 1][1]);
      pa[3] = pack2<Element>(sf[2 * kk + 1][2], sf[2 * kk + 1][3]);
      const std::uint32_t vb = ks + v_off + kk * 16 * kRowBytes;
#pragma unroll
      for (int c = 0; c < kOTiles / 2; ++c) {
        std::uint32_t r[4];
        ldmatrix_x4_trans(vb + c * 32, r);
        mma_m16n8k16<Element>(o[2 * c], pa, r[0], r[1]);
        mma_m16n8k16<Element>(o[2 * c + 1], pa, r[2], r[3]);
      }
    }
    stage ^= 1;
  }
  cp_async_wait<0>();

  // ---- epilogue: each warp its 16 rows x 256 columns; lse from the warps of half 0.
  const bool out_bf16 = __is_same(Element, __nv_bfloat16);
  const bool sink_here = p.sink != nullptr && a.splits == 1;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = row_sum[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = r0 + 16 * rg + gq + 8 * hf;
    const bool valid = r < nrows;
    const int i = row_i[hf], h = g_kv * h_ratio + (valid ? r % h_ratio : 0);
    // Base 0 when the row saw no key; a learnable sink (without splits; with them it joins
    // in the merge) adds exp2(sink_log2) to the sum (decode_kernel_epilogue.inc: fold_sink).
    float mb = row_max[hf] == -INFINITY ? 0.0f : row_max[hf];
    float ll = l;
    if (sink_here && valid) {
      const float s2 = p.sink[h] * kLog2e;
      const float top = ll != 0.0f ? fmaxf(mb, s2) : s2;
      ll = (ll != 0.0f ? ll * fast_exp2(mb - top) : 0.0f) + fast_exp2(s2 - top);
      mb = top;
    }
    const float f = (ll != 0.0f && l != 0.0f) ? fast_exp2(row_max[hf] - mb) / ll : 0.0f;
    if (!valid) continue;
    const std::int64_t ws_row = ((std::int64_t(split) * p.batch + b) * p.h_q + h) * p.seqlen_q + i;
    if (a.splits > 1) {
      float* dst = a.ws_o + ws_row * p.d_v + 256 * half + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < kOTiles; ++nt) {
        if (256 * half + 8 * nt < p.d_v) {
          *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(o[nt][2 * hf] * f, o[nt][2 * hf + 1] * f);
        }
      }
    } else {
      auto* out = static_cast<std::uint16_t*>(p.out) + p.o_offset(b) + std::int64_t(i) * p.o_row_stride +
                  std::int64_t(h) * p.o_head_stride + 256 * half + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < kOTiles; ++nt) {
        if (256 * half + 8 * nt < p.d_v) {
          *reinterpret_cast<std::uint32_t*>(out + 8 * nt) =
              pack_out(o[nt][2 * hf] * f, o[nt][2 * hf + 1] * f, out_bf16);
        }
      }
    }
    if (half == 0 && tq == 0) {
      // -inf when the row saw no key (and no sink); NaN when its sum is NaN.
      const float lse = ll == 0.0f ? -INFINITY : (mb + log2f(ll)) * 0.6931471805599453f;
      if (a.splits > 1) {
        a.ws_lse[ws_row] = lse;
      } else if (p.lse) {
        p.lse[p.lse_offset(b, h) + i] = lse;
      }
    }
  }

  // ---- splits: the last of this row chunk's splits to arrive merges them, a warp per row
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
      merge_split_row(p, a, b, h, i, lane, p.d_v);
    }
  }
}

}  // namespace flashattn::detail::cuda::sm80
