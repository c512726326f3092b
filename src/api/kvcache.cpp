// KV-cache entry points: argument checking, then the in-place append and the forward.
#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/check.hpp"
#include "api/dispatch.hpp"
#include "core/backend.hpp"
#include "flashattn/attention.hpp"

namespace flashattn {

namespace {

using detail::AppendParams;
using detail::FwdParams;
using detail::api::Check;
using detail::api::Scratch;
using detail::api::Target;
using detail::api::to_int;

constexpr int kMaxSplits = 256;

struct CacheDims {
  int b, s_q, h_q, h_k, d;
  int d_v;         // head dim of v_cache / v_new / out (and opts.qv)
  int s_new;       // rows of k_new / v_new (0 without them)
  bool paged;
  int cache_rows;  // b_cache (dense) or num_blocks (paged): k_cache.shape[0]
  int block_size;  // paged: k_cache.shape[1]
  int capacity;    // keys one sequence can hold: s_cache or max_blocks * block_size
  bool fp8;              // float8_e4m3 cache with k_scale / v_scale (16-bit, fp32, fp64 q)
  bool fp8_q;            // float8_e4m3 q and cache with opts.q/k/v_descale [b, h_k] (FA3)
  bool scale_per_block;  // scales [cache_rows, h_k] (else [h_k])
};

// The dequantization scales of an fp8 cache: both given, fp32 on q's device, [h_k] or
// [cache_rows, h_k] with one layout. Returns whether they are per (block, head).
bool check_scales(const Check& c, const KVCacheArgs& a, Device device, std::int64_t cache_rows,
                  std::int64_t h_k) {
  const std::string dims = "[h_k] = [" + std::to_string(h_k) + "] or [cache_rows, h_k] = [" +
                           std::to_string(cache_rows) + ", " + std::to_string(h_k) +
                           "] (cache_rows = k_cache.shape[0])";
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"k_scale", a.k_scale},
                                {"v_scale", a.v_scale}}) {
    if (!t.defined()) {
      c.fail(name, "a defined fp32 tensor " + dims + " (k_cache is float8_e4m3)",
             "an undefined tensor");
    }
    const bool per_head = t.rank == 1 && t.shape[0] == h_k;
    const bool per_block = t.rank == 2 && t.shape[0] == cache_rows && t.shape[1] == h_k;
    if (!per_head && !per_block) c.fail(name, "shape " + dims, shape_string(t));
    c.dtype(name, t, DType::kFloat32, "fp8 dequantization scales");
    c.device(name, t, device, "same as q");
    c.layout(name, t);
  }
  if (a.v_scale.rank != a.k_scale.rank ||
      (a.k_scale.rank == 2 && a.v_scale.stride[0] != a.k_scale.stride[0])) {
    c.fail("v_scale",
           "the layout of k_scale (shape " + shape_string(a.k_scale) + ", stride[0] " +
               std::to_string(a.k_scale.stride[0]) + ")",
           "shape " + shape_string(a.v_scale) + ", stride[0] " + std::to_string(a.v_scale.stride[0]));
  }
  return a.k_scale.rank == 2;
}

std::string indexed(std::string_view name, std::size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

CacheDims check_kvcache_shapes(const Check& c, const KVCacheArgs& a, const Options& opts) {
  const Tensor& q = a.q;
  c.rank("q", q, 4, "[b, s_q, h_q, d]");
  c.layout("q", q);
  detail::api::check_query_heads(c, q, 2);
  const std::int64_t b = q.shape[0], h_q = q.shape[2], d = q.shape[3];
  const bool paged = a.block_table.defined();

  c.rank("k_cache", a.k_cache, 4,
         paged ? "[num_blocks, block_size, h_k, d]" : "[b_cache, s_cache, h_k, d]");
  c.layout("k_cache", a.k_cache);
  c.dim("k_cache", a.k_cache, 3, d, "head dim of q");
  detail::api::check_kv_heads(c, "k_cache", a.k_cache, 2, h_q);
  const bool fp8_q = q.dtype == DType::kFloat8E4M3;
  const bool fp8 = a.k_cache.dtype == DType::kFloat8E4M3 && !fp8_q;
  if (fp8_q && a.k_cache.dtype != DType::kFloat8E4M3) {
    // FlashAttention-3: q, k_cache, v_cache (and k_new, v_new) share the fp8 dtype.
    c.fail("k_cache",
           "dtype float8_e4m3 (q is float8_e4m3: an fp8 q takes an fp8 cache, dequantized by "
           "opts.k_descale / v_descale, as in FlashAttention-3)",
           dtype_name(a.k_cache.dtype));
  }
  if (!fp8_q && !fp8 && a.k_cache.dtype != q.dtype) {
    c.fail("k_cache",
           "dtype " + std::string(dtype_name(q.dtype)) + " (same as q) or float8_e4m3 (an fp8 cache)",
           dtype_name(a.k_cache.dtype));
  }
  c.device("k_cache", a.k_cache, q.device, "same as q");
  c.rank("v_cache", a.v_cache, 4,
         paged ? "[num_blocks, block_size, h_k, d_v]" : "[b_cache, s_cache, h_k, d_v]");
  c.like_head_dim("v_cache", a.v_cache, "k_cache", a.k_cache, a.v_cache.shape[3],
                  "same as k_cache but any head dim d_v");
  const std::int64_t h_k = a.k_cache.shape[2], d_v = a.v_cache.shape[3];
  // Descales [b, h_k] only with fp8 q (FlashAttention-3), no qv with them.
  detail::api::check_fp8(c, opts, q, detail::api::to_int(b), detail::api::to_int(h_k));
  detail::api::check_qv(c, opts, q, d_v);

  c.tensor("cache_seqlens", a.cache_seqlens, {b}, "[b]", DType::kInt32, q.device);

  std::int64_t capacity = a.k_cache.shape[1];
  if (paged) {
    if (a.cache_batch_idx.defined()) {
      c.fail("cache_batch_idx",
             "an undefined tensor (cache_batch_idx is for dense caches; block_table is given)",
             "a tensor of shape " + shape_string(a.cache_batch_idx));
    }
    c.rank("block_table", a.block_table, 2, "[b, max_blocks_per_seq]");
    c.dim("block_table", a.block_table, 0, b, "batch of q");
    c.dtype("block_table", a.block_table, DType::kInt32, "");
    c.device("block_table", a.block_table, q.device, "same as q");
    c.layout("block_table", a.block_table);
    if (a.k_cache.shape[1] < 1) {
      c.fail("k_cache", "shape[1] (block_size) >= 1 for a paged cache",
             std::to_string(a.k_cache.shape[1]));
    }
    capacity = a.block_table.shape[1] * a.k_cache.shape[1];
  } else if (a.cache_batch_idx.defined()) {
    c.tensor("cache_batch_idx", a.cache_batch_idx, {b}, "[b]", DType::kInt32, q.device);
  } else if (a.k_cache.shape[0] < b) {
    c.fail("k_cache", "shape[0] (b_cache) >= " + std::to_string(b) + " (batch of q)",
           std::to_string(a.k_cache.shape[0]));
  }

  if (a.cache_leftpad.defined()) {
    if (paged) {
      c.unsupported("cache_leftpad",
                    "an undefined tensor with a paged cache (block_table is given; a "
                    "left-padded cache must be dense, as in flash_attn)",
                    "a tensor of shape " + shape_string(a.cache_leftpad));
    }
    c.tensor("cache_leftpad", a.cache_leftpad, {b}, "[b]", DType::kInt32, q.device);
  }

  if (a.k_new.defined() != a.v_new.defined()) {
    const char* missing = a.k_new.defined() ? "v_new" : "k_new";
    c.fail(missing, "a defined tensor (k_new and v_new are given together)",
           "an undefined tensor");
  }
  std::int64_t s_new = 0;
  if (a.k_new.defined()) {
    c.rank("k_new", a.k_new, 4, "[b, s_new, h_k, d]");
    s_new = a.k_new.shape[1];
    c.shape("k_new", a.k_new, {b, s_new, h_k, d}, "[b, s_new, h_k, d]");
    c.dtype("k_new", a.k_new, q.dtype, "same as q");
    c.device("k_new", a.k_new, q.device, "same as q");
    c.layout("k_new", a.k_new);
    c.rank("v_new", a.v_new, 4, "[b, s_new, h_k, d_v]");
    c.like_head_dim("v_new", a.v_new, "k_new", a.k_new, d_v,
                    "same as k_new but the head dim d_v of v_cache");
  }
  bool scale_per_block = false;
  if (fp8_q) {
    for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"k_scale", a.k_scale},
                                  {"v_scale", a.v_scale}}) {
      if (t.defined()) {
        c.fail(name,
               "an undefined tensor (q is float8_e4m3: the fp8 cache is dequantized by "
               "opts.k_descale / v_descale [b, h_k], as in FlashAttention-3; k_scale / v_scale "
               "are for an fp8 cache under float16 / bfloat16 / float32 / float64 q)",
               "a tensor of shape " + shape_string(t));
      }
    }
  } else if (fp8) {
    scale_per_block = check_scales(c, a, q.device, a.k_cache.shape[0], h_k);
  } else {
    for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"k_scale", a.k_scale},
                                  {"v_scale", a.v_scale}}) {
      if (t.defined()) {
        c.fail(name,
               "an undefined tensor (scales are for a float8_e4m3 cache; k_cache is " +
                   std::string(dtype_name(a.k_cache.dtype)) + ")",
               "a tensor of shape " + shape_string(t));
      }
    }
  }
  if (a.tree_mask.defined()) {
    const std::int64_t s_q = q.shape[1];
    c.tensor("tree_mask", a.tree_mask, {b, s_q, (s_q + 31) / 32}, "[b, s_q, ceil(s_q / 32)]",
             DType::kInt32, q.device);
  }
  if (a.num_splits < 0 || a.num_splits > kMaxSplits) {
    c.fail("num_splits", "a value in [0, 256] (0 = heuristic)", std::to_string(a.num_splits));
  }
  if (capacity > std::numeric_limits<int>::max()) {
    c.fail("block_table", "max_blocks_per_seq * block_size < 2^31", std::to_string(capacity));
  }
  return {to_int(b),     to_int(q.shape[1]),       to_int(h_q),     to_int(h_k),
          to_int(d),     to_int(d_v),              to_int(s_new),   paged,
          to_int(a.k_cache.shape[0]), to_int(a.k_cache.shape[1]), to_int(capacity), fp8,
          fp8_q, scale_per_block};
}

// The cache slots one sequence reads as cached keys or writes by the append: slots
// [lo, hi) of cache row (dense) or block (paged) `row`.
struct SlotRange {
  std::int64_t row, lo, hi;
  bool append;
  std::int64_t seq, entry;  // sequence and block-table column (-1 for a dense cache)
};

std::string describe(const SlotRange& r, bool paged) {
  std::string where = paged ? "block_table[" + std::to_string(r.seq) + "][" +
                                  std::to_string(r.entry) + "] = block " + std::to_string(r.row)
                            : "cache row " + std::to_string(r.row);
  return "sequence " + std::to_string(r.seq) + (r.append ? " appends to " : " reads ") + where +
         ", slots " + std::to_string(r.lo) + ".." + std::to_string(r.hi - 1);
}

// The append must not write a slot twice, nor a slot that some sequence reads as a cached
// key (positions < cache_seqlens): either write would be lost or would change what the
// attention reads. Blocks or rows shared for reading only (prefix sharing) are fine.
void check_append_targets(const Check& c, const KVCacheArgs& a, const CacheDims& dims,
                          const std::vector<std::int32_t>& seqlens,
                          const std::vector<std::int32_t>* rows,
                          const std::vector<std::int32_t>* table,
                          const std::vector<std::int32_t>* leftpad) {
  if (dims.s_new == 0 || (!dims.paged && !rows)) return;  // distinct rows 0 .. b-1
  std::vector<SlotRange> ranges;
  for (std::size_t i = 0; i < seqlens.size(); ++i) {
    const std::int64_t len = seqlens[i], keys = len + dims.s_new, seq = std::int64_t(i);
    if (!dims.paged) {
      const std::int64_t row = (*rows)[i];
      const std::int64_t first = leftpad ? (*leftpad)[i] : 0;  // rows before: padding
      if (len > first) ranges.push_back({row, first, len, false, seq, -1});
      ranges.push_back({row, len, keys, true, seq, -1});
      continue;
    }
    const std::int64_t bs = dims.block_size, max_blocks = a.block_table.shape[1];
    for (std::int64_t blk = 0; blk * bs < keys; ++blk) {
      const std::int64_t row = (*table)[i * static_cast<std::size_t>(max_blocks) + blk];
      const std::int64_t p0 = blk * bs, end = std::min(p0 + bs, keys);
      if (p0 < len) ranges.push_back({row, 0, std::min(end, len) - p0, false, seq, blk});
      if (end > len) ranges.push_back({row, std::max(p0, len) - p0, end - p0, true, seq, blk});
    }
  }
  std::sort(ranges.begin(), ranges.end(), [](const SlotRange& x, const SlotRange& y) {
    return x.row != y.row ? x.row < y.row : x.lo < y.lo;
  });
  // Sorted by (row, lo): x overlaps an earlier range of its row iff that one ends after x.lo.
  const SlotRange* last_read = nullptr;    // of the current row, the read ending last
  const SlotRange* last_append = nullptr;  // of the current row, the append ending last
  for (const SlotRange& x : ranges) {
    if (last_read && last_read->row != x.row) last_read = nullptr;
    if (last_append && last_append->row != x.row) last_append = nullptr;
    const SlotRange* hit = last_append && last_append->hi > x.lo ? last_append
                           : x.append && last_read && last_read->hi > x.lo ? last_read
                                                                           : nullptr;
    if (hit) {
      c.fail(dims.paged ? "block_table" : "cache_batch_idx",
             "append targets that no other append and no cached key use (sequence i appends "
             "to positions cache_seqlens[i] .. cache_seqlens[i] + s_new - 1; " +
                 std::string(dims.paged ? "blocks" : "cache rows") +
                 " may be shared for reading only)",
             describe(*hit, dims.paged) + ", and " + describe(x, dims.paged));
    }
    auto& slot = x.append ? last_append : last_read;
    if (!slot || slot->hi < x.hi) slot = &x;
  }
}

// Index contents: cache lengths, cache rows, used block-table entries, append targets.
// Returns the longest key count max_i(cache_seqlens[i] + s_new), or -1 when the contents
// were not read (CUDA tensors: checked on the device instead, unless
// FLASHATTN_DEVICE_INDEX_CHECKS=0 outside graph capture).
std::int64_t check_kvcache_contents(const Check& c, const KVCacheArgs& a, const CacheDims& dims,
                                    Target target, void* stream) {
  const auto seqlens = detail::api::read_int32(a.cache_seqlens, target, stream);
  if (!seqlens) return -1;
  std::int64_t longest = 0;
  for (std::size_t i = 0; i < seqlens->size(); ++i) {
    const std::int64_t len = (*seqlens)[i];
    if (len < 0) {
      c.fail("cache_seqlens", "values >= 0",
             indexed("cache_seqlens", i) + " = " + std::to_string(len));
    }
    const std::int64_t keys = len + dims.s_new;
    if (keys > dims.capacity) {
      const std::string room =
          dims.paged ? "max_blocks_per_seq * block_size = " +
                           std::to_string(a.block_table.shape[1]) + " * " +
                           std::to_string(dims.block_size) + " of block_table and k_cache"
                     : "s_cache = k_cache.shape[1]";
      c.fail("cache_seqlens",
             "cache_seqlens[i] + s_new <= " + std::to_string(dims.capacity) + " (" + room + ")",
             indexed("cache_seqlens", i) + " + " + std::to_string(dims.s_new) + " = " +
                 std::to_string(keys));
    }
    longest = std::max(longest, keys);
  }

  std::optional<std::vector<std::int32_t>> rows, table, leftpad;
  if (a.cache_leftpad.defined()) {
    leftpad = detail::api::read_int32(a.cache_leftpad, target, stream);
    if (!leftpad) return -1;
    for (std::size_t i = 0; i < leftpad->size(); ++i) {
      if ((*leftpad)[i] < 0 || (*leftpad)[i] > (*seqlens)[i]) {
        c.fail("cache_leftpad",
               "values in [0, cache_seqlens[i]] (cache_seqlens[" + std::to_string(i) +
                   "] = " + std::to_string((*seqlens)[i]) + ")",
               indexed("cache_leftpad", i) + " = " + std::to_string((*leftpad)[i]));
      }
    }
  }
  if (a.cache_batch_idx.defined()) {
    rows = detail::api::read_int32(a.cache_batch_idx, target, stream);
    if (!rows) return -1;
    for (std::size_t i = 0; i < rows->size(); ++i) {
      if ((*rows)[i] < 0 || (*rows)[i] >= dims.cache_rows) {
        c.fail("cache_batch_idx",
               "values in [0, " + std::to_string(dims.cache_rows) + ") (b_cache = k_cache.shape[0])",
               indexed("cache_batch_idx", i) + " = " + std::to_string((*rows)[i]));
      }
    }
  }

  if (dims.paged) {
    table = detail::api::read_int32(a.block_table, target, stream);
    if (!table) return -1;
    const std::int64_t max_blocks = a.block_table.shape[1];
    for (std::size_t i = 0; i < seqlens->size(); ++i) {
      const std::int64_t keys = (*seqlens)[i] + dims.s_new;
      const std::int64_t used = (keys + dims.block_size - 1) / dims.block_size;
      for (std::int64_t blk = 0; blk < used; ++blk) {
        const std::int32_t entry = (*table)[i * static_cast<std::size_t>(max_blocks) + blk];
        if (entry < 0 || entry >= dims.cache_rows) {
          const std::string at = "block_table[" + std::to_string(i) + "][" + std::to_string(blk) + "]";
          c.fail("block_table",
                 "used entries in [0, " + std::to_string(dims.cache_rows) +
                     ") (num_blocks = k_cache.shape[0])",
                 at + " = " + std::to_string(entry));
        }
      }
    }
  }
  check_append_targets(c, a, dims, *seqlens, rows ? &*rows : nullptr, table ? &*table : nullptr,
                       leftpad ? &*leftpad : nullptr);
  return longest;
}

// Everything after the shapes; fills p for the forward over the cache.
// contents_read: false when the index contents were not read (CUDA tensors, unless
// FLASHATTN_DEVICE_INDEX_CHECKS=0 outside graph capture): the call then checks them on the
// device. read_cuda_contents false (kvcache_workspace_size): CUDA index tensors are not
// read at all (a size depends on shapes only; no host copy, no synchronisation).
Target check_and_fill(const Check& c, const KVCacheArgs& a, const CacheDims& dims,
                      const Options& opts, FwdParams& p, bool* contents_read = nullptr,
                      bool read_cuda_contents = true) {
  // With qv the score is one dot product over d + d_v (FlashAttention-3's default scale).
  detail::api::fill_options(c, opts, a.q.device, dims.b, dims.h_q,
                            detail::api::scale_dim(opts, dims.d, dims.d_v), p);
  detail::api::decline_block_sparse(c, opts, "KV-cache calls take no block-sparse mask");
  if (opts.dropout_p > 0.0f) {
    c.unsupported("opts.dropout_p", "0 (kvcache_forward is inference only)",
                  std::to_string(opts.dropout_p));
  }
  const Target target = detail::api::resolve_target(c, opts, a.q.device);
  // fp8 q over an fp8 cache runs on both backends (CUDA: the decode kernel, d_v == d, its
  // descales contiguous [b, h_k]). With qv on CUDA the MLA kernel's head dims (d <= 64,
  // d_v <= 512) and rules: 16-bit caches, no draft-tree mask (before anything of the call
  // runs, the append included).
  const bool mla_cuda = opts.qv.defined() && target == Target::kCUDA;
  detail::api::check_supported(c, target, a.q.dtype, dims.d, dims.d_v, dims.b, dims.h_q,
                               mla_cuda ? detail::api::CudaCall::kMla : detail::api::CudaCall::kKVCache,
                               "v_cache");
  detail::api::check_fp8_cuda(c, opts, a.q, target == Target::kCUDA, dims.b, dims.h_k);
  detail::api::check_qv_target(c, opts, target == Target::kCUDA);
  if (mla_cuda && dims.fp8) {
    c.unsupported("k_cache",
                  "a cache of q's dtype with opts.qv on CUDA (the MLA kernel reads 16-bit caches; "
                  "fp8 caches with qv run on the CPU backend)",
                  std::string(dtype_name(a.k_cache.dtype)));
  }
  if (mla_cuda && a.tree_mask.defined()) {
    c.unsupported("tree_mask", "an undefined tensor with opts.qv on CUDA (the MLA kernel takes no draft-tree mask)",
                  "a tensor of shape " + shape_string(a.tree_mask));
  }
  if (!mla_cuda) {
    detail::api::check_kvcache_head_dim_v(c, target, dims.d, dims.d_v, dims.fp8 || dims.fp8_q,
                                          a.tree_mask.defined());
  }
  if (a.cache_leftpad.defined() && target != Target::kCPU) {
    c.unsupported("cache_leftpad", "an undefined tensor on the CUDA backend (left-padded "
                  "caches run on the CPU backend for now)",
                  "a tensor of shape " + shape_string(a.cache_leftpad));
  }
  detail::api::check_cuda_layouts(c, target,
                                  {{"q", a.q}, {"k_cache", a.k_cache}, {"v_cache", a.v_cache},
                                   {"k_new", a.k_new}, {"v_new", a.v_new}});
  const std::int64_t longest = read_cuda_contents || target != Target::kCUDA
                                   ? check_kvcache_contents(c, a, dims, target, opts.stream)
                                   : -1;
  if (contents_read) *contents_read = longest >= 0;
  detail::api::fill_probs(c, opts, target == Target::kCPU, a.q.device,
                          {dims.b, dims.h_q, dims.s_q, longest}, p);

  detail::api::set_qkv(a.q, a.k_cache, a.v_cache, p);
  detail::api::set_qv(opts.qv, p);
  p.batch = dims.b;
  p.seqlen_q = dims.s_q;
  // Per-sequence key counts come from cache_seqlens; seqlen_k is their upper bound
  // (known without reading device memory, so workspace sizing is the same in
  // kvcache_workspace_size and kvcache_forward).
  p.seqlen_k = dims.capacity;
  p.cache_seqlens = static_cast<const int*>(a.cache_seqlens.data);
  p.seqlen_k_new = dims.s_new;
  p.cache_batch_idx = static_cast<const int*>(a.cache_batch_idx.data);
  p.cache_leftpad = static_cast<const int*>(a.cache_leftpad.data);
  p.kv_cache_rows = dims.cache_rows;
  p.kv_cache_len = static_cast<int>(a.k_cache.shape[1]);
  if (dims.paged) {
    p.block_table = static_cast<const int*>(a.block_table.data);
    p.block_table_batch_stride = a.block_table.stride[0];
    p.block_table_max_blocks = static_cast<int>(a.block_table.shape[1]);
    p.block_size = dims.block_size;
  }
  if (dims.fp8) {
    p.k_scale = static_cast<const float*>(a.k_scale.data);
    p.v_scale = static_cast<const float*>(a.v_scale.data);
    p.scale_block_stride = dims.scale_per_block ? a.k_scale.stride[0] : 0;
  }
  if (a.tree_mask.defined()) {
    p.tree_mask = static_cast<const std::uint32_t*>(a.tree_mask.data);
    p.tree_batch_stride = a.tree_mask.stride[0];
    p.tree_row_stride = a.tree_mask.stride[1];
  }
  p.num_splits = a.num_splits;
  return target;
}

}  // namespace

void kvcache_forward(const KVCacheArgs& args, const Tensor& out, const Tensor& lse,
                     const Options& opts, Workspace workspace) {
  const Check c("kvcache_forward");
  const CacheDims dims = check_kvcache_shapes(c, args, opts);
  // fp8 q: out bfloat16 / float16 (FlashAttention-3), else q's dtype.
  detail::api::check_out(c, out, args.q, dims.d_v);
  if (lse.defined()) {
    c.tensor("lse", lse, {dims.b, dims.h_q, dims.s_q}, "[b, h_q, s_q]", DType::kFloat32,
             args.q.device);
  }
  FwdParams p;
  bool contents_read = true;
  const Target target = check_and_fill(c, args, dims, opts, p, &contents_read);
  detail::api::check_cuda_layouts(c, target, {{"out", out}});
  c.no_overlap({{"out", out}, {"lse", lse}, {"opts.return_probs", opts.return_probs}},
               {{"q", args.q}, {"opts.qv", opts.qv}, {"k_cache", args.k_cache},
                {"v_cache", args.v_cache},
                {"k_new", args.k_new}, {"v_new", args.v_new}, {"cache_seqlens", args.cache_seqlens},
                {"block_table", args.block_table}, {"cache_batch_idx", args.cache_batch_idx},
                {"opts.alibi_slopes", opts.alibi_slopes}, {"k_scale", args.k_scale},
                {"v_scale", args.v_scale}, {"tree_mask", args.tree_mask},
                {"cache_leftpad", args.cache_leftpad},
                {"opts.learnable_sink", opts.learnable_sink},
                {"opts.q_descale", opts.q_descale}, {"opts.k_descale", opts.k_descale},
                {"opts.v_descale", opts.v_descale}});
  if (args.k_new.defined() && args.k_cache.numel() > 0 && args.k_cache.data == args.v_cache.data) {
    c.fail("v_cache", "memory apart from k_cache (the append writes both)",
           "the data pointer of k_cache, " + detail::api::address_string(args.v_cache.data));
  }
  if (args.k_new.defined()) {
    // The append writes the caches: they must not overlap what it or the forward reads.
    // k_cache and v_cache may share one buffer (interleaved), so they are checked apart.
    for (const detail::api::Arg cache : {detail::api::Arg{"k_cache", args.k_cache},
                                         detail::api::Arg{"v_cache", args.v_cache}}) {
      c.no_overlap({cache}, {{"q", args.q}, {"opts.qv", opts.qv}, {"k_new", args.k_new},
                             {"v_new", args.v_new},
                             {"cache_seqlens", args.cache_seqlens},
                             {"block_table", args.block_table},
                             {"cache_batch_idx", args.cache_batch_idx},
                             {"k_scale", args.k_scale}, {"v_scale", args.v_scale},
                             {"tree_mask", args.tree_mask},
                             {"cache_leftpad", args.cache_leftpad},
                             {"opts.learnable_sink", opts.learnable_sink},
                             {"opts.q_descale", opts.q_descale},
                             {"opts.k_descale", opts.k_descale},
                             {"opts.v_descale", opts.v_descale}});
    }
  }

  detail::api::set_out(out, p);
  std::vector<float> descales;  // fp8 q: the descales, read by the CPU backend
  detail::api::set_fp8(opts, out, target == Target::kCUDA, p, descales);
  if (lse.defined()) {
    p.lse = static_cast<float*>(lse.data);
    p.lse_batch_stride = lse.stride[0];
    p.lse_head_stride = lse.stride[1];
  }
  detail::api::check_cuda_forward_rows(c, target, p);
  Scratch scratch;
  const std::size_t ws_bytes = detail::api::forward_workspace_size(target, p);
  detail::api::attach_workspace(c, target, workspace, ws_bytes, p, scratch);
  detail::cuda::AppendVerdict verdict;
  if (target == Target::kCUDA && !contents_read &&
      detail::cuda::fuse_row_checks(p, detail::cuda::IndexCall::kKVCacheForward)) {
    // The decode kernel checks cache_seqlens and cache_batch_idx itself: no check kernel.
  } else if (target == Target::kCUDA && !contents_read) {
    // Before the append, in stream order (the append and the kernels clamp regardless).
    // An append's conflicts (what check_append_targets rejects on the host) are found there
    // too: the verdict, in the last append_check_bytes of the workspace, stops the append.
    const std::size_t verdict_bytes = args.k_new.defined() ? detail::cuda::append_check_bytes(p) : 0;
    int* flags = verdict_bytes > 0
                     ? reinterpret_cast<int*>(static_cast<char*>(p.workspace) + ws_bytes - verdict_bytes)
                     : nullptr;
    // The check also zeroes the decode path's split counters (no memset node of their own).
    // (Never the verdict's words, which the same kernel writes: the decode plan's span lies
    // before them, and a span that did not is left to the decode path's own memset.)
    detail::cuda::CounterSpan counters = detail::cuda::split_counters(p);
    const char* verdict_at = static_cast<char*>(p.workspace) + ws_bytes - verdict_bytes;
    if (counters.data != nullptr && static_cast<char*>(counters.data) + counters.bytes > verdict_at) counters = {};
    p.zeroed_counters = counters.data;
    p.zeroed_counter_bytes = counters.bytes;
    verdict = detail::cuda::check_indices_on_device(p, detail::cuda::IndexCall::kKVCacheForward, flags);
  }

  if (args.k_new.defined()) {
    AppendParams ap;
    ap.dtype = args.q.dtype;
    ap.batch = dims.b;
    ap.h_k = dims.h_k;
    ap.d = dims.d;
    ap.d_v = dims.d_v;
    ap.seqlen_new = dims.s_new;
    const auto ks = detail::api::row_strides(args.k_new), vs = detail::api::row_strides(args.v_new);
    ap.k_new = args.k_new.data;
    ap.kn_batch_stride = ks.batch, ap.kn_row_stride = ks.row, ap.kn_head_stride = ks.head;
    ap.v_new = args.v_new.data;
    ap.vn_batch_stride = vs.batch, ap.vn_row_stride = vs.row, ap.vn_head_stride = vs.head;
    ap.cache = p;
    ap.stream = p.stream;
    ap.device_index = p.device_index;
    detail::api::run_append_kv(target, ap, verdict);
  }
  detail::api::run_forward(target, p);
}

std::size_t kvcache_workspace_size(const KVCacheArgs& args, const Options& opts) {
  const Check c("kvcache_workspace_size");
  const CacheDims dims = check_kvcache_shapes(c, args, opts);
  FwdParams p;
  const Target target = check_and_fill(c, args, dims, opts, p, nullptr, /*read_cuda_contents=*/false);
  // fp8 q computes in out's type, bfloat16 or float16: both fp32 compute, one size.
  if (dims.fp8_q) p.dtype = DType::kBFloat16;
  return detail::api::forward_workspace_size(target, p);
}

}  // namespace flashattn
