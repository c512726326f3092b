// CPU KV-cache append: row r of k_new / v_new for sequence b is copied to cache
// position cache_seqlens[b] + r (key cache_seqlens[b] - cache_leftpad[b] + r), through
// the block table when the cache is paged and
// through cache_batch_idx when it is dense. When the cache has the dtype of k_new /
// v_new (also float8_e4m3 k_new / v_new into an fp8 cache: fp8 q, FlashAttention-3's
// descales) each (b, r, head) row is a plain byte copy; an fp8 cache appended from 16-bit
// (or fp32 / fp64) k_new / v_new stores semantics::quantize_e4m3(x, scale) with the scale
// of the destination (block, head). The rows are tasks of run_workers (cpu/pool.hpp): a
// decode step's append (a few rows) does not wait for a thread team to wake.
#include <cstring>

#include "core/backend.hpp"
#include "cpu/pool.hpp"
#include "cpu/tile.hpp"

namespace flashattn::detail::cpu {

namespace {

// On the worker pool, f(b, j, g, kn, vn) for every new row r of sequence b and KV head g: j
// the key index the row takes (with cache_leftpad, key j is cache row leftpad + j), kn / vn
// the element offsets of its k_new / v_new rows.
template <class F>
void for_each_new_row(const AppendParams& p, F&& f) {
  const FwdParams& c = p.cache;
  TaskQueue queue(std::int64_t(p.batch) * p.seqlen_new);
  auto body = [&](TaskQueue& q) {
    for (std::int64_t row; (row = q.next()) >= 0;) {
      const int b = static_cast<int>(row / p.seqlen_new);
      const int r = static_cast<int>(row % p.seqlen_new);
      const std::int64_t j = std::int64_t(c.cache_seqlens[b]) - c.key_leftpad(b) + r;
      for (int g = 0; g < p.h_k; ++g) {
        const std::int64_t kn = std::int64_t(b) * p.kn_batch_stride + std::int64_t(r) * p.kn_row_stride +
                                std::int64_t(g) * p.kn_head_stride;
        const std::int64_t vn = std::int64_t(b) * p.vn_batch_stride + std::int64_t(r) * p.vn_row_stride +
                                std::int64_t(g) * p.vn_head_stride;
        f(b, j, g, kn, vn);
      }
    }
  };
  run_workers(queue, team_size(c.num_threads), body);
}

// Append into a float8_e4m3 cache: E is the element type of k_new / v_new.
template <class E>
void append_fp8(const AppendParams& p) {
  using S = typename E::storage;
  const FwdParams& c = p.cache;
  auto* k_cache = static_cast<std::uint8_t*>(const_cast<void*>(c.k));
  auto* v_cache = static_cast<std::uint8_t*>(const_cast<void*>(c.v));
  const auto* k_new = static_cast<const S*>(p.k_new);
  const auto* v_new = static_cast<const S*>(p.v_new);
  for_each_new_row(p, [&](int b, std::int64_t j, int g, std::int64_t kn, std::int64_t vn) {
    const float ks = c.k_scale[c.kv_scale_index(b, j, g)];
    const float vs = c.v_scale[c.kv_scale_index(b, j, g)];
    std::uint8_t* kd = k_cache + c.k_offset(b, j, g);
    std::uint8_t* vd = v_cache + c.v_offset(b, j, g);
    for (int e = 0; e < p.d; ++e)
      kd[e] = semantics::quantize_e4m3(static_cast<float>(E::load(k_new[kn + e])), ks);
    for (int e = 0; e < p.d_v; ++e)
      vd[e] = semantics::quantize_e4m3(static_cast<float>(E::load(v_new[vn + e])), vs);
  });
}

}  // namespace

void append_kv(const AppendParams& p) {
  const FwdParams& c = p.cache;
  if (c.kv_dtype == DType::kFloat8E4M3 && p.dtype != DType::kFloat8E4M3) {
    if (std::int64_t(p.batch) * p.seqlen_new == 0 || p.h_k == 0) return;
    dispatch_dtype(p.dtype, [&](auto e) { append_fp8<decltype(e)>(p); });
    return;
  }
  const std::size_t elem = dtype_size(p.dtype);
  const std::size_t row_bytes = elem * std::size_t(p.d);
  const std::size_t v_row_bytes = elem * std::size_t(p.d_v);
  const std::int64_t rows = std::int64_t(p.batch) * p.seqlen_new;
  if (rows == 0 || p.h_k == 0) return;
  auto* k_cache = static_cast<unsigned char*>(const_cast<void*>(c.k));
  auto* v_cache = static_cast<unsigned char*>(const_cast<void*>(c.v));
  const auto* k_new = static_cast<const unsigned char*>(p.k_new);
  const auto* v_new = static_cast<const unsigned char*>(p.v_new);
  for_each_new_row(p, [&](int b, std::int64_t j, int g, std::int64_t kn, std::int64_t vn) {
    std::memcpy(k_cache + c.k_offset(b, j, g) * elem, k_new + kn * elem, row_bytes);
    std::memcpy(v_cache + c.v_offset(b, j, g) * elem, v_new + vn * elem, v_row_bytes);
  });
}

}  // namespace flashattn::detail::cpu
