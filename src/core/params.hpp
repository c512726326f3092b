// Internal: the normalised problem description that argument checking builds and
// every backend consumes. One struct covers dense batches, variable-length packing
// and KV caches (dense or paged), so a backend has one forward and one backward.
//
// It is trivially copyable: CUDA kernels take it by value. Pointers are on the
// call's device. All strides are in elements.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashattn/attention.hpp"
#include "flashattn/semantics.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::detail {

struct FwdParams {
  DType dtype = DType::kFloat16;  // of q, k, v, out (and dout, dq, dk, dv); fp8 q: of out
  int batch = 0;                  // sequences
  int h_q = 0, h_k = 0, d = 0;    // heads and head dim of q, k; h_q % h_k == 0
  int d_v = 0;                    // head dim of v, out (and dout, dv); may differ from d
  int h_ratio = 1;                // h_q / h_k: query head h uses KV head h / h_ratio

  // q, out: element (seq b, row i, head h, dim c) is at
  //   base(b) + i * row_stride + h * head_stride + c
  // with base(b) = b * batch_stride (dense) or cu_seqlens_q[b] * row_stride (varlen).
  const void* q = nullptr;
  std::int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  void* out = nullptr;
  std::int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  // MLA decode (FlashAttention-3's qv): [b, s_q, h_q, d_v] laid out like q (same batch /
  // row / head addressing with its own strides), or null. With it the raw score of
  // (i, j) is q_i . k_j + qv_i . v_j (scaled as one dot product). Forward only.
  const void* qv = nullptr;
  std::int64_t qv_batch_stride = 0, qv_row_stride = 0, qv_head_stride = 0;
  // lse (fp32, may be null): element (b, h, i) at b * lse_batch_stride + h * lse_head_stride + i
  // (dense [b, h_q, s_q]) or h * lse_head_stride + cu_seqlens_q[b] + i (varlen [h_q, total_q]).
  float* lse = nullptr;
  std::int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // k, v: key j of sequence b, KV head g, dim c is at
  //   dense:  kbase(b) + j * row_stride + g * head_stride + c, with kbase(b) =
  //           cache_row(b) * batch_stride (dense/cache) or cu_seqlens_k[b] * row_stride (varlen);
  //   paged:  block_table[b][j / block_size] * batch_stride + (j % block_size) * row_stride + ...
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  std::int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  // Lengths. Dense: every sequence has seqlen_q queries and seqlen_k keys.
  // Varlen: seqlen_q/seqlen_k are max_seqlen_q/max_seqlen_k (upper bounds).
  int seqlen_q = 0, seqlen_k = 0;
  const int* cu_seqlens_q = nullptr;  // [batch + 1] or null
  const int* cu_seqlens_k = nullptr;  // [batch + 1] or null
  const int* seqused_k = nullptr;     // [batch] or null: overrides the key count
  const int* seqused_q = nullptr;     // [batch] or null (varlen): overrides the query count
  // Varlen: the rows of the packed q / out (total_q) and k / v (total_k) tensors, the
  // bounds of the sm90 tensor copies; 0 otherwise.
  std::int64_t total_q = 0, total_k = 0;

  // KV cache. With cache_seqlens, sequence b has cache_seqlens[b] + seqlen_k_new keys.
  const int* cache_seqlens = nullptr;    // [batch] or null
  int seqlen_k_new = 0;                  // keys appended by this call (already in the cache)
  const int* cache_batch_idx = nullptr;  // [batch] or null: cache row of sequence b
  // [batch] or null (dense caches, CPU backend): sequence b's keys start at cache row
  // cache_leftpad[b]; it has cache_seqlens[b] - cache_leftpad[b] + seqlen_k_new keys and
  // key j is cache row cache_leftpad[b] + j.
  const int* cache_leftpad = nullptr;
  const int* block_table = nullptr;      // [batch, max_blocks] or null (dense)
  std::int64_t block_table_batch_stride = 0;
  int block_table_max_blocks = 0;        // block_table's second extent (paged only)
  int block_size = 0;  // rows per block (paged only)
  // The cache tensors' first two extents: kv_cache_rows = b_cache (dense) or num_blocks
  // (paged), kv_cache_len = s_cache or block_size (bounds of the sm90 tensor copies).
  int kv_cache_rows = 0, kv_cache_len = 0;

  // fp8 (e4m3) KV cache: k/v hold e4m3 bytes and k_scale/v_scale are non-null; the value
  // of key j of sequence b, KV head g, is e4m3 * scale[kv_block(b, j) * scale_block_stride + g]
  // (scale_block_stride is 0 for per-head scales [h_k], h_k for [cache_rows, h_k]).
  // Otherwise kv_dtype == dtype and the scales are null.
  // fp8 (e4m3) q, k, v (Options::q_descale ..., CPU backend; also kvcache_forward with an
  // fp8 cache, FlashAttention-3): q_dtype and kv_dtype are float8_e4m3, dtype is out's
  // (float16 / bfloat16); k_scale / v_scale are the [b, h_k] descales, scale_by_sequence
  // is set (the scale row of key j of sequence b is b, whatever block or cache row holds
  // it; scale_block_stride = h_k) and query row (b, h) has the value
  // e4m3 * q_descale[b * h_k + h / h_ratio]. Otherwise q_dtype == dtype and q_descale is
  // null.
  DType q_dtype = DType::kFloat16;
  const float* q_descale = nullptr;
  DType kv_dtype = DType::kFloat16;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  std::int64_t scale_block_stride = 0;
  bool scale_by_sequence = false;

  // Tree mask (speculative decoding), int32 words or null: query i of sequence b sees
  // draft key t (key s_k - s_q + t) only when bit t % 32 of
  // tree_mask[b * tree_batch_stride + i * tree_row_stride + t / 32] is set.
  const std::uint32_t* tree_mask = nullptr;
  std::int64_t tree_batch_stride = 0, tree_row_stride = 0;

  // Block-sparse mask (Options::block_sparse), or null: the kind
  // (semantics::BlockKind) of block (m, n) of sequence b, query head h is
  //   block_kinds[b * bs_batch_stride + h * bs_head_stride + m * bs_blocks_k + n]
  // (strides 0 where the mask broadcasts over batch or heads), a table built from the count
  // / index lists: by the entry point while checking them (CPU backend), or on the device
  // from bs_lists in the call's workspace (CUDA backend; the entry point sets bs_lists and
  // leaves block_kinds null) (varlen: positions i, j within
  // sequence b, the grid of max_seqlen_q x max_seqlen_k). Partial blocks apply the element
  // rule with doc_ids_q[b * doc_q_batch_stride + i] == doc_ids_k[b * .. + j] (varlen: the
  // packed rows q_start(b) + i, k_start(b) + j) when doc_ids_q is non-null, and
  // prefix_keys[b] when non-null.
  const std::uint8_t* block_kinds = nullptr;
  // CUDA, with block_kinds: each table row's listed key blocks, highest first, at the row's
  // table offset (block_list[b * bs_batch_stride + h * bs_head_stride + m * bs_blocks_k + x],
  // x < block_list_len[that offset / bs_blocks_k]): the kernels' visit order without a walk
  // of the row.
  const std::int32_t* block_list = nullptr;
  const std::int32_t* block_list_len = nullptr;
  // The lists on the device (CUDA): [0] mask_block_cnt / _idx (partial), [1] full_block_cnt
  // / _idx (cnt null: none). Entry (b, h, m) of a list at b * cnt_b + h * cnt_h + m (0
  // strides where it broadcasts), its e-th index at b * idx_b + h * idx_h + m * idx_m + e.
  struct BlockList {
    const int* cnt = nullptr;
    const int* idx = nullptr;
    std::int64_t cnt_b = 0, cnt_h = 0, idx_b = 0, idx_h = 0, idx_m = 0;
  };
  BlockList bs_lists[2];
  int bs_table_batch = 0, bs_table_heads = 0;  // the table's extents (1 where it broadcasts)
  // Bytes of the table the device builds from bs_lists (0 without them), unaligned.
  std::size_t bs_table_bytes() const {
    if (bs_lists[0].cnt == nullptr) return 0;
    return std::size_t(bs_table_batch) * std::size_t(bs_table_heads) * std::size_t(bs_blocks_q) *
           std::size_t(bs_blocks_k);
  }
  int bs_block_q = 0, bs_block_k = 0;    // block sizes
  int bs_blocks_q = 0, bs_blocks_k = 0;  // blocks per sequence: ceil(s / block)
  std::int64_t bs_batch_stride = 0, bs_head_stride = 0;
  const int* doc_ids_q = nullptr;
  const int* doc_ids_k = nullptr;
  std::int64_t doc_q_batch_stride = 0, doc_k_batch_stride = 0;
  const int* prefix_keys = nullptr;     // [1] or [b]
  std::int64_t prefix_batch_stride = 0;  // 0 when [1]

  // Scores.
  float scale = 1.0f;
  float softcap = 0.0f;  // 0 = off
  semantics::Mask mask;
  const float* alibi_slopes = nullptr;  // [h_q] or [b, h_q]
  std::int64_t alibi_batch_stride = 0;  // 0 when [h_q]

  // Learnable sink: fp32 [h_q] logits joining every row's softmax denominator, or null.
  const float* sink = nullptr;

  // Dropout.
  float dropout_p = 0.0f;
  float rp_dropout = 1.0f;  // 1 / (1 - p)
  semantics::DropoutRng rng;

  // Debug: probabilities after dropout (before 1/(1-p)), fp32, or null.
  // Element (b, h, i, j) at b * probs_batch_stride + h * probs_head_stride + i * probs_row_stride + j
  // (varlen: i is the packed row cu_seqlens_q[b] + i and probs_batch_stride is 0).
  float* probs = nullptr;
  std::int64_t probs_batch_stride = 0, probs_head_stride = 0, probs_row_stride = 0;

  // Split-KV: the keys of each sequence are split into num_splits contiguous chunks;
  // partials go to the workspace and are merged by log-sum-exp. 1 = no split.
  int num_splits = 1;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // The decode path's split-merge arrival counters (in the workspace) when this call's
  // device index check zeroed them in stream order before its kernels (kvcache_forward,
  // cuda::split_counters): their address and bytes. The decode path then enqueues no memset
  // of its own (one graph node fewer, and the decode kernel's launch can overlap the
  // check's by programmatic dependent launch); null: it zeroes them itself.
  const void* zeroed_counters = nullptr;
  std::size_t zeroed_counter_bytes = 0;
  // A KV-cache call whose index check the decode kernel makes itself, with no check kernel
  // before it (cuda::fuse_row_checks: no append, no block table): one thread per sequence
  // checks cache_seqlens[b] and cache_batch_idx[b] as the check kernel would and reports to
  // the device's error record (null: nothing is recorded) under its report lock, as call
  // row_check_call (an IndexCall); -1: no such check.
  void* row_check_record = nullptr;
  int* row_check_lock = nullptr;
  int row_check_call = -1;

  // Execution.
  bool deterministic = false;
  int num_threads = 0;   // CPU
  void* stream = nullptr;  // CUDA
  int device_index = 0;    // CUDA
  // CUDA kernel choice (src/cuda/dispatch.cu): the family and shared-memory cap per block
  // asked for (Options or the environment; kAuto / 0 = the device's best / limit), and the
  // limit the dispatch resolved from them for this call's configuration choices.
  KernelFamily kernel_family = KernelFamily::kAuto;
  int smem_cap = 0;
  int smem_limit = 0;

  // ---- per-sequence helpers (host and device) ----
  FA_HD bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FA_HD bool is_paged() const { return block_table != nullptr; }

  // ---- index guards ----
  // The index tensors (cu_seqlens_q / _k, seqused_k, cache_seqlens, cache_batch_idx,
  // block_table) are checked on the host before a CPU call runs; a CUDA call checks them
  // on the device, in stream order before its kernels (core/backend.hpp,
  // check_indices_on_device), so its kernels may see bad values (and a captured graph's
  // replays other contents). Every read of them, on the host and in the kernels, goes through
  // the helpers below, which clamp each value into what the tensors hold, so that no
  // contents address memory outside q, k, v, out, lse and the caches. Checked values pass
  // unchanged; docs/semantics.md ("Index tensors checked on the device") states what
  // clamped ones compute. A few integer operations per read, none per element.
  FA_HD static int clamp_index(std::int64_t v, std::int64_t lo, std::int64_t hi) {
    if (hi < lo) hi = lo;
    return static_cast<int>(v < lo ? lo : v > hi ? hi : v);
  }
  // cu_seqlens_q[b] in [0, min(total_q, b * max_seqlen_q)]; the end cu_seqlens_q[b + 1] in
  // [start, min(total_q, start + max_seqlen_q)] (varlen: seqlen_q holds max_seqlen_q). The
  // max_seqlen bounds keep every row inside the backward's workspace, whose query tiles
  // and D rows are laid out per sequence by max_seqlen_q (bwd_workspace.hpp); valid
  // cu_seqlens meet them already.
  FA_HD int q_start(int b) const { return clamp_index(cu_seqlens_q[b], 0, min64(total_q, std::int64_t(b) * seqlen_q)); }
  FA_HD int q_end(int b) const {
    const int start = q_start(b);
    return clamp_index(cu_seqlens_q[b + 1], start, min64(total_q, std::int64_t(start) + seqlen_q));
  }
  FA_HD int k_start(int b) const { return clamp_index(cu_seqlens_k[b], 0, min64(total_k, std::int64_t(b) * seqlen_k)); }
  FA_HD int k_end(int b) const {
    const int start = k_start(b);
    return clamp_index(cu_seqlens_k[b + 1], start, min64(total_k, std::int64_t(start) + seqlen_k));
  }
  FA_HD static std::int64_t min64(std::int64_t a, std::int64_t b) { return a < b ? a : b; }
  // Keys a KV-cache row can hold: s_cache (dense) or max_blocks * block_size (paged).
  FA_HD std::int64_t cache_capacity() const {
    return block_table ? std::int64_t(block_table_max_blocks) * block_size : std::int64_t(kv_cache_len);
  }
  // Keys stored for sequence b (varlen: its cu_seqlens_k range), the bound of seqused_k.
  FA_HD int stored_len_k(int b) const { return cu_seqlens_k ? k_end(b) - k_start(b) : seqlen_k; }

  // Query rows stored for sequence b (>= seq_len_q(b); the rest are written as empty).
  FA_HD int seq_rows_q(int b) const { return cu_seqlens_q ? q_end(b) - q_start(b) : seqlen_q; }
  // Queries of sequence b that are computed: seqused_q[b] clamped to [0, stored rows] when
  // given, else the stored rows.
  FA_HD int seq_len_q(int b) const {
    if (seqused_q) return clamp_index(seqused_q[b], 0, seq_rows_q(b));
    return seq_rows_q(b);
  }
  FA_HD int seq_len_k(int b) const {
    if (seqused_k) return clamp_index(seqused_k[b], 0, stored_len_k(b));
    if (cache_seqlens) return cached_len(b) - key_leftpad(b) + seqlen_k_new;
    return stored_len_k(b);
  }
  // cache_seqlens[b] in [0, capacity - seqlen_k_new].
  FA_HD int cached_len(int b) const {
    return clamp_index(cache_seqlens[b], 0, cache_capacity() - seqlen_k_new);
  }
  // cache_leftpad[b] in [0, cached_len(b)]; 0 without cache_leftpad.
  FA_HD int key_leftpad(int b) const {
    return cache_leftpad ? clamp_index(cache_leftpad[b], 0, cached_len(b)) : 0;
  }
  FA_HD std::int64_t q_offset(int b) const {
    return cu_seqlens_q ? std::int64_t(q_start(b)) * q_row_stride : std::int64_t(b) * q_batch_stride;
  }
  FA_HD std::int64_t qv_offset(int b) const {
    return cu_seqlens_q ? std::int64_t(q_start(b)) * qv_row_stride : std::int64_t(b) * qv_batch_stride;
  }
  FA_HD std::int64_t o_offset(int b) const {
    return cu_seqlens_q ? std::int64_t(q_start(b)) * o_row_stride : std::int64_t(b) * o_batch_stride;
  }
  FA_HD std::int64_t lse_offset(int b, int h) const {
    return cu_seqlens_q ? std::int64_t(h) * lse_head_stride + q_start(b)
                        : std::int64_t(b) * lse_batch_stride + std::int64_t(h) * lse_head_stride;
  }
  // Packed row index of query 0 of sequence b (varlen), else 0.
  FA_HD std::int64_t q_row0(int b) const { return cu_seqlens_q ? q_start(b) : 0; }
  // cache_batch_idx[b] in [0, kv_cache_rows).
  FA_HD int cache_row(int b) const {
    return cache_batch_idx ? clamp_index(cache_batch_idx[b], 0, kv_cache_rows - 1) : b;
  }
  // block_table[b][t] in [0, num_blocks) (kv_cache_rows is the cache's block count).
  FA_HD int block_id(int b, std::int64_t t) const {
    return clamp_index(block_table[std::int64_t(b) * block_table_batch_stride + t], 0, kv_cache_rows - 1);
  }
  // Element offset of key j of sequence b, KV head g (for k; v uses its own strides).
  FA_HD std::int64_t k_offset(int b, std::int64_t j, int g) const {
    return kv_row_offset(b, j, k_batch_stride, k_row_stride) + std::int64_t(g) * k_head_stride;
  }
  FA_HD std::int64_t v_offset(int b, std::int64_t j, int g) const {
    return kv_row_offset(b, j, v_batch_stride, v_row_stride) + std::int64_t(g) * v_head_stride;
  }
  FA_HD std::int64_t kv_row_offset(int b, std::int64_t j, std::int64_t batch_stride,
                                   std::int64_t row_stride) const {
    if (block_table) {
      const int blk = block_id(b, j / block_size);
      return std::int64_t(blk) * batch_stride + (j % block_size) * row_stride;
    }
    if (cu_seqlens_k) return (std::int64_t(k_start(b)) + j) * row_stride;
    if (cache_leftpad) j += key_leftpad(b);
    return std::int64_t(cache_row(b)) * batch_stride + j * row_stride;
  }
  // The block (paged) or cache row (dense) holding key j of sequence b: the first
  // index of per-(block, head) fp8 scales.
  FA_HD std::int64_t kv_block(int b, std::int64_t j) const {
    if (block_table) return block_id(b, j / block_size);
    return cache_row(b);
  }
  // Index of the fp8 scale of key j of sequence b, KV head g, in k_scale / v_scale.
  FA_HD std::int64_t kv_scale_index(int b, std::int64_t j, int g) const {
    const std::int64_t row = scale_by_sequence ? std::int64_t(b) : kv_block(b, j);
    return row * scale_block_stride + g;
  }
  // Block sparsity: the kind of the block holding (i, j) and the element rule.
  FA_HD semantics::BlockKind block_kind(int b, int h, std::int64_t i, std::int64_t j) const {
    return static_cast<semantics::BlockKind>(
        block_kinds[std::int64_t(b) * bs_batch_stride + std::int64_t(h) * bs_head_stride +
                    (i / bs_block_q) * bs_blocks_k + j / bs_block_k]);
  }
  FA_HD bool block_sparse_visible(int b, int h, std::int64_t i, std::int64_t j, int s_q,
                                  int s_k) const {
    if (i < 0 || i >= s_q || j < 0 || j >= s_k) return false;
    const semantics::BlockKind kind = block_kind(b, h, i, j);
    if (kind == semantics::kBlockSkip) return false;
    const bool docs = doc_ids_q != nullptr;
    return semantics::block_sparse_visible(
        kind, i, j, s_q, s_k, mask, prefix_keys ? prefix_keys[std::int64_t(b) * prefix_batch_stride] : 0, docs,
        docs ? doc_ids_q[cu_seqlens_q ? q_start(b) + i : std::int64_t(b) * doc_q_batch_stride + i] : 0,
        docs ? doc_ids_k[cu_seqlens_k ? k_start(b) + j : std::int64_t(b) * doc_k_batch_stride + j] : 0);
  }
  FA_HD float sink_logit(int h) const { return sink ? sink[h] : -INFINITY; }
  FA_HD float alibi_slope(int b, int h) const {
    return alibi_slopes ? alibi_slopes[std::int64_t(b) * alibi_batch_stride + h] : 0.0f;
  }
  // Dropout's (batch, head) word: batch * h_q + head.
  FA_HD std::uint32_t dropout_bh(int b, int h) const {
    return static_cast<std::uint32_t>(b) * static_cast<std::uint32_t>(h_q) +
           static_cast<std::uint32_t>(h);
  }
};

struct BwdParams : FwdParams {
  // dout like out; dq like q; dk, dv like k, v (dense or varlen, never paged).
  const void* dout = nullptr;
  std::int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  void* dq = nullptr;
  std::int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  void* dk = nullptr;
  std::int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  void* dv = nullptr;
  std::int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  // fp32 [h_q] gradient of the learnable sink (overwritten), or null; needs sink.
  float* dsink = nullptr;

  FA_HD std::int64_t do_offset(int b) const {
    return cu_seqlens_q ? std::int64_t(q_start(b)) * do_row_stride : std::int64_t(b) * do_batch_stride;
  }
  FA_HD std::int64_t dq_offset(int b) const {
    return cu_seqlens_q ? std::int64_t(q_start(b)) * dq_row_stride : std::int64_t(b) * dq_batch_stride;
  }
  FA_HD std::int64_t dk_offset(int b, std::int64_t j, int g) const {
    return (cu_seqlens_k ? (std::int64_t(k_start(b)) + j) * dk_row_stride
                         : std::int64_t(b) * dk_batch_stride + j * dk_row_stride) +
           std::int64_t(g) * dk_head_stride;
  }
  FA_HD std::int64_t dv_offset(int b, std::int64_t j, int g) const {
    return (cu_seqlens_k ? (std::int64_t(k_start(b)) + j) * dv_row_stride
                         : std::int64_t(b) * dv_batch_stride + j * dv_row_stride) +
           std::int64_t(g) * dv_head_stride;
  }
};

// The in-place append of a KV-cache call: row r of k_new / v_new for sequence b goes
// to cache position cache_seqlens[b] + r (through the block table when paged).
struct AppendParams {
  DType dtype = DType::kFloat16;
  int batch = 0, h_k = 0, d = 0, seqlen_new = 0;
  int d_v = 0;  // head dim of v_new / v_cache (d is k_new's / k_cache's)
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  std::int64_t kn_batch_stride = 0, kn_row_stride = 0, kn_head_stride = 0;
  std::int64_t vn_batch_stride = 0, vn_row_stride = 0, vn_head_stride = 0;
  FwdParams cache;  // k/v (as non-const destinations), cache_seqlens, batch idx, block table
  void* stream = nullptr;
  int device_index = 0;
};

}  // namespace flashattn::detail
