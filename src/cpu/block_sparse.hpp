// CPU backend: block-sparse masks (FwdParams::block_kinds, semantics.hpp "block sparsity").
//
// The CPU tiles (kBlockM x kBlockN) need not line up with the mask's blocks
// (bs_block_q x bs_block_k): a CPU tile is visited when any mask block it overlaps is
// listed for any of its rows, and inside it the keys of unlisted blocks are neither read
// (their K / V rows are zero-filled, not loaded) nor seen (their scores are -inf). With
// mask blocks that are multiples of the CPU tiles (128 x 128, the default) every CPU
// tile lies in one mask block, so the work is the visited blocks' and nothing else.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/params.hpp"
#include "cpu/tile.hpp"

namespace flashattn::detail::cpu {

// Keys [j0, j0 + n) of sequence b that query rows [i0, i1) of head h visit (their block is
// listed): used[j - j0] = 1 for those, 0 for the others (used may be null). Returns
// whether any is visited.
inline bool block_sparse_keys(const FwdParams& p, int b, int h, std::int64_t i0, std::int64_t i1,
                              std::int64_t j0, int n, std::uint8_t* used) {
  if (used) std::fill(used, used + kBlockN, std::uint8_t(0));
  if (i1 <= i0 || n <= 0) return false;
  const std::int64_t m0 = i0 / p.bs_block_q, m1 = (i1 - 1) / p.bs_block_q;
  const std::int64_t n0 = j0 / p.bs_block_k, n1 = (j0 + n - 1) / p.bs_block_k;
  const std::uint8_t* table = p.block_kinds + std::int64_t(b) * p.bs_batch_stride +
                              std::int64_t(h) * p.bs_head_stride;
  bool any = false;
  for (std::int64_t nb = n0; nb <= n1; ++nb) {
    bool listed = false;
    for (std::int64_t m = m0; m <= m1 && !listed; ++m)
      listed = table[m * p.bs_blocks_k + nb] != semantics::kBlockSkip;
    if (!listed) continue;
    any = true;
    if (!used) return true;
    const std::int64_t lo = std::max(j0, nb * p.bs_block_k);
    const std::int64_t hi = std::min(j0 + n, (nb + 1) * p.bs_block_k);
    std::fill(used + (lo - j0), used + (hi - j0), std::uint8_t(1));
  }
  return any;
}

// The mask of query i (of head h, sequence b) on the kBlockN scores s of keys j0 ..:
// scores of keys that i does not see (unlisted block, the partial-block element rule, or
// past s_k) become -inf, by a select. Visible scores are unchanged.
template <class T>
void block_sparse_mask_row(const FwdParams& p, int b, int h, std::int64_t i, std::int64_t j0,
                           int s_q, int s_k, T* s) {
  const T ninf = -static_cast<T>(INFINITY);
  const std::uint8_t* row = p.block_kinds + std::int64_t(b) * p.bs_batch_stride +
                            std::int64_t(h) * p.bs_head_stride +
                            (i / p.bs_block_q) * p.bs_blocks_k;
  const std::int64_t end = std::min<std::int64_t>(j0 + kBlockN, s_k);
  std::int64_t j = j0;
  while (j < end) {
    const std::int64_t nb = j / p.bs_block_k;
    const std::int64_t seg_end = std::min(end, (nb + 1) * p.bs_block_k);
    const auto kind = static_cast<semantics::BlockKind>(row[nb]);
    if (kind == semantics::kBlockSkip) {
      for (std::int64_t x = j; x < seg_end; ++x) s[x - j0] = ninf;
    } else if (kind == semantics::kBlockPartial) {
      for (std::int64_t x = j; x < seg_end; ++x)
        if (!p.block_sparse_visible(b, h, i, x, s_q, s_k)) s[x - j0] = ninf;
    }
    j = seg_end;
  }
  for (std::int64_t x = std::max(end, j0); x < j0 + kBlockN; ++x) s[x - j0] = ninf;
}

}  // namespace flashattn::detail::cpu
