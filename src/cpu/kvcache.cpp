// CPU KV-cache append: row r of k_new / v_new for sequence b is copied to cache
// position cache_seqlens[b] + r, through the block table when the cache is paged and
// through cache_batch_idx when it is dense. Both tensors have the cache's dtype, so
// each (b, r, head) row is a plain byte copy.
#include <cstring>

#include "core/backend.hpp"
#include "cpu/tile.hpp"

namespace flashattn::detail::cpu {

void append_kv(const AppendParams& p) {
  const FwdParams& c = p.cache;
  const std::size_t elem = dtype_size(p.dtype);
  const std::size_t row_bytes = elem * std::size_t(p.d);
  const std::int64_t rows = std::int64_t(p.batch) * p.seqlen_new;
  if (rows == 0 || p.h_k == 0 || p.d == 0) return;
  auto* k_cache = static_cast<unsigned char*>(const_cast<void*>(c.k));
  auto* v_cache = static_cast<unsigned char*>(const_cast<void*>(c.v));
  const auto* k_new = static_cast<const unsigned char*>(p.k_new);
  const auto* v_new = static_cast<const unsigned char*>(p.v_new);
#pragma omp parallel for schedule(static) num_threads(team_size(c.num_threads))
  for (std::int64_t row = 0; row < rows; ++row) {
    const int b = static_cast<int>(row / p.seqlen_new);
    const int r = static_cast<int>(row % p.seqlen_new);
    const std::int64_t j = std::int64_t(c.cache_seqlens[b]) + r;
    for (int g = 0; g < p.h_k; ++g) {
      const std::int64_t kn = std::int64_t(b) * p.kn_batch_stride + std::int64_t(r) * p.kn_row_stride +
                              std::int64_t(g) * p.kn_head_stride;
      const std::int64_t vn = std::int64_t(b) * p.vn_batch_stride + std::int64_t(r) * p.vn_row_stride +
                              std::int64_t(g) * p.vn_head_stride;
      std::memcpy(k_cache + c.k_offset(b, j, g) * elem, k_new + kn * elem, row_bytes);
      std::memcpy(v_cache + c.v_offset(b, j, g) * elem, v_new + vn * elem, row_bytes);
    }
  }
}

}  // namespace flashattn::detail::cpu
