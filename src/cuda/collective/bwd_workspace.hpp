// The backward's fp32 workspace, shared by its three kernels (preprocess D = rowsum(dO * O),
// the main kernel of a family, postprocess dQ = scale * dq_accum) and by both kernel
// families: the dQ accumulator is laid out in the mma accumulator fragment order, which
// is also the order of a Hopper wgmma accumulator, so sm80's mma.sync and sm90's wgmma
// kernels add to it the same way (one 16-byte vector reduction per lane and fragment).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/backend.hpp"
#include "core/params.hpp"

namespace flashattn::detail::cuda {

// Query rows per dq_accum tile and per deterministic-mode counter; every bucket uses the
// same value so that the workspace layout does not depend on the bucket. The main
// kernel's query tile is a whole number of these (128 rows = two at d <= 64).
inline constexpr int kBwdBlockM = 64;

// Workspace, one allocation, each part 256-byte aligned:
//   dq_accum [batch, m_blocks, h_q, kBwdBlockM * d]  fp32, sum over key tiles of dS K (scale
//                                      not applied), each query tile's [kBwdBlockM, d] block
//                                      in mma.sync accumulator order (dq_accum_index), so a
//                                      warp adds a whole 16 x 8 fragment (512 contiguous
//                                      bytes) with one vector red per lane
//   dpsum    [h_q, rows_total]         fp32, D = rowsum(dO * O)
//   dq_sem   [batch, h_q, m_blocks]    uint32, deterministic mode only: how many key tiles
//                                      have added their dQ contribution to a query tile
//   kinds    a block-sparse mask's kinds table (FwdParams::block_kinds) and its rows' lists, built on the
//            device from the lists (bs_lists) before the main kernel; none without a mask
// rows_total = batch * seqlen_q (dense) or batch * max_seqlen_q (varlen: an upper bound of
// total_q that the host knows without reading cu_seqlens); row of (b, i) is
// cu_seqlens_q[b] + i (varlen) or b * seqlen_q + i (dense). m_blocks = ceil(seqlen_q /
// kBwdBlockM) with seqlen_q the (maximum) query length.
struct BwdWorkspace {
  float* dq_accum = nullptr;
  float* dpsum = nullptr;
  unsigned* dq_sem = nullptr;
  std::int64_t rows_total = 0;
  int m_blocks = 0;
};

// First float of query tile m_block of (sequence b, query head h) in dq_accum.
__host__ __device__ inline std::int64_t dq_accum_tile(const BwdWorkspace& ws, int b, int m_block,
                                                      int h, int h_q, int d) {
  return ((std::int64_t(b) * ws.m_blocks + m_block) * h_q + h) * std::int64_t(kBwdBlockM) * d;
}

// Offset inside a tile of element (r, c), r < kBwdBlockM, c < d (d % 8 == 0): the 16 x 8
// accumulator fragment (r / 16, c / 8) occupies 128 floats, lane (g, t) of the mma C
// layout holds its four values (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) contiguously.
__host__ __device__ inline int dq_accum_index(int r, int c) {
  const int fragment = (c / 8) * (kBwdBlockM / 16) + r / 16;
  const int lane = (r % 8) * 4 + (c % 8) / 2;
  const int e = ((r / 8) % 2) * 2 + c % 2;
  return fragment * 128 + lane * 4 + e;
}

struct BwdWorkspaceLayout {
  std::size_t dq_accum_bytes = 0, dpsum_bytes = 0, sem_bytes = 0;
  std::size_t kinds_bytes = 0;  // a block-sparse mask's kinds table
  std::int64_t rows_total = 0;
  int m_blocks = 0;
  std::size_t kinds_offset() const { return dq_accum_bytes + dpsum_bytes + sem_bytes; }
  std::size_t total() const { return kinds_offset() + kinds_bytes; }
};

inline std::size_t bwd_align256(std::size_t x) { return (x + 255) & ~std::size_t(255); }

inline BwdWorkspaceLayout bwd_workspace_layout(const BwdParams& p) {
  BwdWorkspaceLayout l;
  l.rows_total = std::int64_t(p.batch) * p.seqlen_q;
  l.m_blocks = (p.seqlen_q + kBwdBlockM - 1) / kBwdBlockM;
  l.dq_accum_bytes = bwd_align256(std::size_t(p.batch) * l.m_blocks * p.h_q * kBwdBlockM * p.d *
                                  sizeof(float));
  l.dpsum_bytes = bwd_align256(std::size_t(l.rows_total) * p.h_q * sizeof(float));
  l.sem_bytes = p.deterministic
                    ? bwd_align256(std::size_t(p.batch) * p.h_q * l.m_blocks * sizeof(unsigned))
                    : 0;
  l.kinds_bytes = block_kinds_bytes(p);  // the kinds table and its rows' lists (runtime.cu)
  return l;
}

}  // namespace flashattn::detail::cuda
