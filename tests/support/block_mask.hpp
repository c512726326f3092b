// Block-sparse masks on the host for the tests (CPU and CUDA suites): FlashAttention-4's
// count / index lists with their tensors, the element-rule inputs (doc ids, prefix keys),
// an independent reading of the rule (kind(), element_mask(): the dense element mask the
// fp64 oracle receives), and random masks with shuffled lists and garbage past each count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "flashattn/semantics.hpp"
#include "support/cases.hpp"
#include "support/random.hpp"
#include "support/host_tensor.hpp"

namespace flashattn::test {

// A block mask on the host: lists and their tensors, plus the optional element-rule inputs.
struct HostBlockMask {
  int B = 1, H = 1, M = 0, N = 0, bq = 1, bk = 1;
  int FB = 1, FH = 1;  // the full pair's broadcast extents
  std::vector<int> mask_cnt, mask_idx, full_cnt, full_idx;  // full_* empty = no full lists
  std::vector<int> docs_q, docs_k;  // [b * s_q], [b * s_k] (varlen: [total_q], [total_k]), or empty
  bool packed_docs = false;         // varlen: docs are [total_q], [total_k]
  std::vector<int> prefix;          // [b] or empty
  HostTensor mask_cnt_t, mask_idx_t, full_cnt_t, full_idx_t, docs_q_t, docs_k_t, prefix_t;

  // Kind of block (m, n) for (b, h): 0 skip, 1 partial, 2 full, read from the lists.
  int kind(int b, int h, int m, int n) const {
    auto find = [&](const std::vector<int>& cnt, const std::vector<int>& idx, int PB, int PH) {
      const int bb = PB == 1 ? 0 : b, hh = PH == 1 ? 0 : h;
      const int row = (bb * PH + hh) * M + m;
      for (int e = 0; e < cnt[row]; ++e)
        if (idx[row * N + e] == n) return true;
      return false;
    };
    if (!full_cnt.empty() && find(full_cnt, full_idx, FB, FH)) return 2;
    if (find(mask_cnt, mask_idx, B, H)) return 1;
    return 0;
  }

  // The dense element mask [h_q][s_q][s_k] of sequence b; its doc ids start at dq0 / dk0
  // (default: b * s_q, b * s_k, the dense layout).
  std::vector<std::uint8_t> element_mask(int b, int h_q, int s_q, int s_k, semantics::Mask mask,
                                         int dq0 = -1, int dk0 = -1) const {
    if (dq0 < 0) dq0 = b * s_q;
    if (dk0 < 0) dk0 = b * s_k;
    std::vector<std::uint8_t> e(std::size_t(h_q) * s_q * s_k, 0);
    for (int h = 0; h < h_q; ++h)
      for (int i = 0; i < s_q; ++i)
        for (int j = 0; j < s_k; ++j) {
          const int k = kind(b, h, i / bq, j / bk);
          bool vis = false;
          if (k == 2) {
            vis = true;
          } else if (k == 1) {
            const bool pre = !prefix.empty() && j < prefix[prefix.size() == 1 ? 0 : b];
            vis = pre || semantics::key_visible(i, j, s_q, s_k, mask);
            if (!docs_q.empty() && docs_q[dq0 + i] != docs_k[dk0 + j]) vis = false;
          }
          e[(std::size_t(h) * s_q + i) * s_k + j] = vis;
        }
    return e;
  }

  static HostTensor int_tensor(const std::vector<int>& v, std::vector<std::int64_t> shape) {
    HostTensor t(DType::kInt32, std::move(shape));
    std::copy(v.begin(), v.end(), t.as<std::int32_t>());
    return t;
  }
  void build_tensors(int batch, int s_q, int s_k) {
    mask_cnt_t = int_tensor(mask_cnt, {B, H, M});
    mask_idx_t = int_tensor(mask_idx, {B, H, M, N});
    if (!full_cnt.empty()) {
      full_cnt_t = int_tensor(full_cnt, {FB, FH, M});
      full_idx_t = int_tensor(full_idx, {FB, FH, M, N});
    }
    if (!docs_q.empty() && packed_docs) {
      docs_q_t = int_tensor(docs_q, {std::int64_t(docs_q.size())});
      docs_k_t = int_tensor(docs_k, {std::int64_t(docs_k.size())});
    } else if (!docs_q.empty()) {
      docs_q_t = int_tensor(docs_q, {batch, s_q});
      docs_k_t = int_tensor(docs_k, {batch, s_k});
    }
    if (!prefix.empty()) prefix_t = int_tensor(prefix, {std::int64_t(prefix.size())});  // [b] or [1]
  }
  void apply(Options& o) const {
    BlockSparseTensors& bs = o.block_sparse;
    bs = {};
    bs.block_size_q = bq;
    bs.block_size_k = bk;
    bs.mask_block_cnt = mask_cnt_t.view();
    bs.mask_block_idx = mask_idx_t.view();
    if (!full_cnt.empty()) {
      bs.full_block_cnt = full_cnt_t.view();
      bs.full_block_idx = full_idx_t.view();
    }
    if (!docs_q.empty()) {
      bs.q_doc_ids = docs_q_t.view();
      bs.k_doc_ids = docs_k_t.view();
    }
    if (!prefix.empty()) bs.prefix_keys = prefix_t.view();
  }
};

// A random block mask: each block skipped, partial or full with the given odds; lists in
// shuffled order with garbage past each count (never read). with_full = false puts every
// listed block in the partial list.
inline HostBlockMask random_mask(Rng& rng, int batch, int h_q, int s_q, int s_k, int bq, int bk,
                          bool per_batch, bool per_head, double density, bool with_full) {
  HostBlockMask m;
  m.bq = bq, m.bk = bk;
  m.M = (s_q + bq - 1) / bq;
  m.N = (s_k + bk - 1) / bk;
  m.B = m.FB = per_batch ? batch : 1;
  m.H = m.FH = per_head ? h_q : 1;
  const int rows = m.B * m.H * m.M;
  m.mask_cnt.assign(rows, 0);
  m.mask_idx.assign(std::size_t(rows) * m.N, 0);
  if (with_full) {
    m.full_cnt.assign(rows, 0);
    m.full_idx.assign(std::size_t(rows) * m.N, 0);
  }
  for (int r = 0; r < rows; ++r) {
    std::vector<int> order(m.N);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int n : order) {
      if (!coin(rng, density)) continue;
      if (with_full && coin(rng, 0.5)) {
        m.full_idx[std::size_t(r) * m.N + m.full_cnt[r]++] = n;
      } else {
        m.mask_idx[std::size_t(r) * m.N + m.mask_cnt[r]++] = n;
      }
    }
    for (int e = m.mask_cnt[r]; e < m.N; ++e) m.mask_idx[std::size_t(r) * m.N + e] = 1000 + e;
    if (with_full)
      for (int e = m.full_cnt[r]; e < m.N; ++e) m.full_idx[std::size_t(r) * m.N + e] = -1 - e;
  }
  m.build_tensors(batch, s_q, s_k);
  return m;
}

inline RefProblem problem_with(const DenseCase& c, const HostBlockMask& m) {
  RefProblem p = c.problem();
  for (int b = 0; b < c.shape.batch; ++b)
    p.seqs[std::size_t(b)].element_mask =
        m.element_mask(b, c.shape.h_q, c.shape.s_q, c.shape.s_k, p.mask);
  return p;
}

}  // namespace flashattn::test
