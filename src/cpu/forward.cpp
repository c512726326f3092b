// CPU forward: the FlashAttention algorithm over blocks.
//
// One task is (sequence b, query head h, block of kBlockM query rows[, key split]).
// It converts its query rows once into a thread-local tile, then streams the key
// blocks its rows can see: S = Q K^T (kBlockM x kBlockN), scores in semantics order,
// the element mask only on blocks that straddle a row's visible range, an online
// softmax (running max and sum per row, rescaling the accumulator when the max
// grows), dropout, and O += P V. Extra memory is the per-thread tiles: O(kBlockM * d).
//
// A block-sparse mask (FwdParams::block_kinds, cpu/block_sparse.hpp) replaces the visible
// key range: a task visits only the key blocks that hold a listed block of its rows, reads
// only their listed keys, and masks by the block kinds and the partial blocks' rule.
//
// Split-KV (num_splits > 1) gives each task one chunk of the sequence's key blocks and
// writes a normalised partial (o, lse) to the workspace; a second loop over row blocks
// merges the partials by log-sum-exp (semantics::merged_lse / merge_weight).
#include <cstring>
#include <limits>

#include "core/backend.hpp"
#include "cpu/bf16_kernels.hpp"
#include "cpu/block_sparse.hpp"
#include "cpu/f64_kernels.hpp"
#include "cpu/isa.hpp"
#include "cpu/pool.hpp"
#include "cpu/tile.hpp"

namespace flashattn::detail::cpu {
namespace {

// Columns of a debug-probs row: the longest sequence's key count for a KV cache
// (seqlen_k is then the cache capacity), else seqlen_k (max_seqlen_k when varlen).
int probs_width(const FwdParams& p) {
  if (!p.cache_seqlens) return p.seqlen_k;
  int m = 0;
  for (int b = 0; b < p.batch; ++b) m = std::max(m, p.cache_seqlens[b] + p.seqlen_k_new);
  return m;
}

// Length of the score dot product: d, plus d_v with qv (q . k + qv . v).
int score_dim(const FwdParams& p) { return p.qv ? p.d + p.d_v : p.d; }

int query_blocks(const FwdParams& p) { return (p.seqlen_q + kBlockM - 1) / kBlockM; }

// Query heads per task. Decode (one query row per sequence) with GQA packs the h_ratio
// query heads of a KV head as the rows of one task, so that each K / V block is loaded
// and converted once per KV head rather than once per query head, and the GEMMs run on
// h_ratio rows. Every row still computes exactly what it computes alone (the GEMM rows
// are independent and the softmax is per row). Not with dropout, debug probs or a tree
// mask (their per-row inputs are written per query block).
int heads_per_task(const FwdParams& p) {
  const bool pack = p.seqlen_q == 1 && p.h_ratio > 1 && p.h_ratio <= kBlockM && !p.probs &&
                    !p.tree_mask && p.rng.threshold == 0u && !p.block_kinds;
  return pack ? p.h_ratio : 1;
}

// num_splits with 0 resolved: split only when the (b, h, query block) tasks cannot
// keep the team busy and the keys are long enough that each split gets >= 4 blocks.
// It reads only scalars (seqlen_k is the upper bound of every sequence's key count),
// so forward_workspace_size and forward agree even if cache_seqlens changes between.
int resolve_num_splits(const FwdParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  const std::int64_t tasks = std::int64_t(p.batch) * (p.h_q / heads_per_task(p)) * query_blocks(p);
  const int threads = team_size(p.num_threads);
  const int key_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  if (tasks == 0 || tasks >= threads || key_blocks < 8) return 1;
  const int wanted = static_cast<int>((2 * threads + tasks - 1) / tasks);
  return std::max(1, std::min({16, key_blocks / 4, wanted}));
}

template <class T>
std::size_t split_workspace_bytes(const FwdParams& p, int splits) {
  if (splits <= 1) return 0;
  // o partials [splits][batch * seqlen_q][h_q][d_v] and lse partials [splits][batch * seqlen_q][h_q].
  const std::size_t rows = std::size_t(splits) * p.batch * p.seqlen_q * p.h_q;
  return rows * (std::size_t(p.d_v) + 1) * sizeof(T);
}

// The rows of one task: query rows i0 .. i0 + rows of head h0, or (packed decode) row i0
// of heads h0 .. h0 + rows.
struct TaskRows {
  int h0, i0, rows;
  bool packed;
  int h(int r) const { return packed ? h0 + r : h0; }
  int i(int r) const { return packed ? i0 : i0 + r; }
  int i_end() const { return packed ? i0 + 1 : i0 + rows; }  // one past the last query index
};

// Offsets of the key / value rows j of (sequence b, KV head g), walked in increasing j: the
// full FwdParams::k_offset / v_offset (cache row or block table lookup, clamps, left
// padding) once per run of rows that are contiguous in memory (the whole sequence for
// dense and varlen tensors, a block of a paged cache), then a row stride per key.
class KvRowWalk {
 public:
  KvRowWalk(const FwdParams& p, int b, int g) : p_(p), b_(b), g_(g) {}
  // Offsets (elements) of key j; calls must come with j increasing.
  void at(std::int64_t j, std::int64_t& k_off, std::int64_t& v_off) {
    if (j >= end_ || j < start_) {
      start_ = j;
      end_ = p_.block_table ? (j / p_.block_size + 1) * p_.block_size
                            : std::numeric_limits<std::int64_t>::max();
      k0_ = p_.k_offset(b_, j, g_);
      v0_ = p_.v_offset(b_, j, g_);
    }
    k_off = k0_ + (j - start_) * p_.k_row_stride;
    v_off = v0_ + (j - start_) * p_.v_row_stride;
  }

 private:
  const FwdParams& p_;
  const int b_, g_;
  std::int64_t start_ = 0, end_ = 0, k0_ = 0, v0_ = 0;
};

// Whether the scores S = Q K^T run as bf16 dot products (Isa::kAvx512Bf16, bf16 q, k, v):
// the tile then keeps q and the key block as raw bf16 words (q16, kp) instead of fp32.
bool bf16_scores(const FwdParams& p) {
  return p.dtype == DType::kBFloat16 && p.q_dtype == DType::kBFloat16 &&
         p.kv_dtype == DType::kBFloat16 && active_isa() == Isa::kAvx512Bf16;
}

// Whether the attend loop of fp32 tensors runs the AVX-512 fp64 kernels (Isa::kAvx512Bf16,
// cpu/f64_kernels.hpp) on tasks of at most f64x::kMaxRows rows (decode: one query row, or the
// packed GQA heads of a KV head): key and value rows read from the tensors and widened in
// registers instead of the converted, transposed block, with the same sums in the same
// order (bit-identical). Not with qv, an fp8 cache or block sparsity (their key rows are not
// plain fp32 rows of one tensor).
bool f64_fused(const FwdParams& p) {
  return p.dtype == DType::kFloat32 && p.q_dtype == DType::kFloat32 &&
         p.kv_dtype == DType::kFloat32 && !p.qv && !p.block_kinds && f64x::built() &&
         active_isa() == Isa::kAvx512Bf16;
}

// Per-thread tiles of one forward task, in the compute type T.
//
// The score dot product runs over d_s = d (q . k) or, with qv (MLA), d + d_v: each query
// row holds [q | qv] and each key row [k | v], so that one GEMM gives q . k + qv . v.
template <class E>
struct ForwardTile {
  using T = typename E::compute;
  int d, dp;                    // score dim d_s and its padded width
  int dv, dvp;                  // value head dim d_v and its padded width
  std::vector<T> q;             // [kBlockM][dp]      query rows (unscaled), [q | qv]
  std::vector<T> kt;            // [d][kBlockN]       key block, transposed
  std::vector<T> k;             // [kBlockN][dp]      key block (converted, before the transpose)
  std::vector<T> v;             // [kBlockN][dvp]     value block
  std::vector<T> s;             // [kBlockM][kBlockN] scores, then probabilities
  std::vector<T> keep;          // [kBlockM][kBlockN] dropout keep mask, 1 or 0
  std::vector<T> acc;           // [kBlockM][dvp]     unnormalised output rows
  std::vector<T> row_max;       // [kBlockM]          running max of the scores
  std::vector<T> row_sum;       // [kBlockM]          running sum of exp(score - max)
  std::vector<T> lse;           // [kBlockM]          final log-sum-exp (probs pass)
  std::vector<std::uint8_t> used;  // [kBlockN]       block sparsity: keys of the block read
  // bf16 scores (bf16_scores): words of two bf16 values, pairs = ceil(d_s / 2).
  int pairs;
  std::vector<std::uint32_t> q16;   // [kBlockM][pairs]  query rows [q | qv], zero-padded
  std::vector<std::uint32_t> kp;    // [pairs][kBlockN]  key block packed by bf16x::pack_block
  std::vector<std::uint16_t> k16;   // [kBlockN][d_s]    key rows [k | v] (with qv)
  std::vector<const std::uint16_t*> key_rows;  // [kBlockN]  rows to pack (nullptr: zero)
  std::vector<std::uint32_t> vp;    // [kBlockN / 2][dvp] value rows in pairs (pack_value_pairs)
  std::vector<const std::uint16_t*> value_rows;  // [kBlockN]
  // fp64 kernels of fp32 tensors (f64_fused): the block's key and value rows in the tensors.
  std::vector<const float*> key_rows32, value_rows32;  // [kBlockN]

  // Buffers a call does not use are left empty (no allocation, no zeroing: a decode call
  // spent a fifth of its fixed time clearing them): q, kt, k, v with bf16 scores, keep
  // without dropout.
  ForwardTile(int score_dim, int value_dim, bool bf16, bool dropout)
      : d(score_dim),
        dp(padded_dim<T>(score_dim)),
        dv(value_dim),
        dvp(padded_dim<T>(value_dim)),
        q(bf16 ? 0 : std::size_t(kBlockM) * dp),
        kt(bf16 ? 0 : std::size_t(score_dim) * kBlockN),
        k(bf16 ? 0 : std::size_t(kBlockN) * dp),
        v(bf16 ? 0 : std::size_t(kBlockN) * dvp),
        s(std::size_t(kBlockM) * kBlockN),
        keep(dropout ? std::size_t(kBlockM) * kBlockN : 0),
        acc(std::size_t(kBlockM) * dvp),
        row_max(kBlockM),
        row_sum(kBlockM),
        lse(kBlockM),
        used(kBlockN),
        pairs((score_dim + 1) / 2),
        q16(bf16 ? std::size_t(kBlockM) * pairs : 0),
        kp(bf16 ? std::size_t(pairs) * kBlockN : 0),
        k16(bf16 ? std::size_t(kBlockN) * score_dim : 0),
        key_rows(bf16 ? kBlockN : 0),
        vp(bf16 ? std::size_t(kBlockN / 2) * dvp : 0),
        value_rows(bf16 ? kBlockN : 0),
        key_rows32(kBlockN),
        value_rows32(kBlockN) {}
};

template <class E>
class Forward {
 public:
  using T = typename E::compute;
  using S = typename E::storage;

  explicit Forward(const FwdParams& p) : p_(p), bf16_(bf16_scores(p)), f64_(f64_fused(p)) {}

  // The query rows of a task into tile.q (with qv: q's d columns, then qv's d_v).
  void load_q(ForwardTile<E>& t, int b, const TaskRows& rs) const {
    if (p_.q_dtype == DType::kFloat8E4M3) {
      load_q_fp8(t, b, rs);
      return;
    }
    const S* q = static_cast<const S*>(p_.q) + p_.q_offset(b);
    if (bf16_) {
      load_q_bf16(t, b, rs);
      return;
    }
    for (int r = 0; r < rs.rows; ++r) {
      T* dst = &t.q[std::size_t(r) * t.dp];
      const S* src = q + std::int64_t(rs.h(r)) * p_.q_head_stride + std::int64_t(rs.i(r)) * p_.q_row_stride;
      if (!p_.qv) {
        load_row<E>(dst, src, t.d, t.dp);
        continue;
      }
      const S* qv = static_cast<const S*>(p_.qv) + p_.qv_offset(b) +
                    std::int64_t(rs.h(r)) * p_.qv_head_stride + std::int64_t(rs.i(r)) * p_.qv_row_stride;
      load_row<E>(dst, src, p_.d, p_.d);
      load_row<E>(dst + p_.d, qv, p_.d_v, t.dp - p_.d);
    }
  }

  // load_q for bf16 scores: the raw bf16 rows [q | qv] into tile.q16, zero-padded to
  // whole words.
  void load_q_bf16(ForwardTile<E>& t, int b, const TaskRows& rs) const {
    const auto* q = static_cast<const std::uint16_t*>(p_.q) + p_.q_offset(b);
    for (int r = 0; r < rs.rows; ++r) {
      std::uint32_t* w = &t.q16[std::size_t(r) * t.pairs];
      w[t.pairs - 1] = 0;
      auto* dst = reinterpret_cast<unsigned char*>(w);
      const std::uint16_t* src =
          q + std::int64_t(rs.h(r)) * p_.q_head_stride + std::int64_t(rs.i(r)) * p_.q_row_stride;
      std::memcpy(dst, src, sizeof(std::uint16_t) * std::size_t(p_.d));
      if (p_.qv) {
        const auto* qv = static_cast<const std::uint16_t*>(p_.qv) + p_.qv_offset(b) +
                         std::int64_t(rs.h(r)) * p_.qv_head_stride +
                         std::int64_t(rs.i(r)) * p_.qv_row_stride;
        std::memcpy(dst + sizeof(std::uint16_t) * std::size_t(p_.d), qv,
                    sizeof(std::uint16_t) * std::size_t(p_.d_v));
      }
    }
  }

  // load_kv for bf16 scores: the key rows ([k | v] with qv) packed into tile.kp straight
  // from the tensors, and with with_v the values in pairs of rows into tile.vp.
  void load_kv_bf16(ForwardTile<E>& t, int b, int g, std::int64_t j0, int n, bool with_v,
                    const std::uint8_t* used) const {
    const auto* k = static_cast<const std::uint16_t*>(p_.k);
    const auto* v = static_cast<const std::uint16_t*>(p_.v);
    KvRowWalk walk(p_, b, g);
    for (int j = 0; j < n; ++j) {
      if (used != nullptr && !used[j]) {
        t.key_rows[j] = nullptr;
        t.value_rows[j] = nullptr;
        continue;
      }
      std::int64_t k_off, v_off;
      walk.at(j0 + j, k_off, v_off);
      const std::uint16_t* krow = k + k_off;
      const std::uint16_t* vsrc = v + v_off;
      if (p_.qv) {
        std::uint16_t* row = &t.k16[std::size_t(j) * t.d];
        std::memcpy(row, krow, sizeof(std::uint16_t) * std::size_t(p_.d));
        std::memcpy(row + p_.d, vsrc, sizeof(std::uint16_t) * std::size_t(p_.d_v));
        krow = row;
      }
      t.key_rows[j] = krow;
      t.value_rows[j] = vsrc;
    }
    bf16x::pack_block(t.key_rows.data(), n, t.d, t.kp.data());
    if (with_v) bf16x::pack_value_pairs(t.value_rows.data(), n, t.dv, t.vp.data(), t.dvp);
  }

  // load_q for fp8 q (no qv): each e4m3 byte decoded and multiplied by the descale of
  // (b, the KV head of its query head), value = e4m3 * q_descale in the compute type.
  void load_q_fp8(ForwardTile<E>& t, int b, const TaskRows& rs) const {
    const auto* q = static_cast<const std::uint8_t*>(p_.q) + p_.q_offset(b);
    for (int r = 0; r < rs.rows; ++r) {
      T* dst = &t.q[std::size_t(r) * t.dp];
      const std::uint8_t* src =
          q + std::int64_t(rs.h(r)) * p_.q_head_stride + std::int64_t(rs.i(r)) * p_.q_row_stride;
      const T qs = static_cast<T>(p_.q_descale[std::int64_t(b) * p_.h_k + rs.h(r) / p_.h_ratio]);
      load_row_e4m3<T>(dst, src, t.d, t.dp, qs);
    }
  }

  // Keys j0 .. j0 + n of (b, KV head g) into tile.kt (zero beyond n) and, when
  // with_v, the values into tile.v. With `used` (block sparsity; no fp8 cache), keys
  // whose block no row of the task visits (used[j] == 0) are zero rows, never read.
  void load_kv(ForwardTile<E>& t, int b, int g, std::int64_t j0, int n, bool with_v,
               const std::uint8_t* used = nullptr) const {
    if (p_.kv_dtype == DType::kFloat8E4M3) {
      load_kv_fp8(t, b, g, j0, n, with_v, used);
      return;
    }
    if (bf16_) {
      load_kv_bf16(t, b, g, j0, n, with_v, used);
      return;
    }
    const S* k = static_cast<const S*>(p_.k);
    const S* v = static_cast<const S*>(p_.v);
    // Rows converted with unit stride, then one blocked transpose into kt. With qv each
    // key row is [k | v] (the value takes part in the score).
    KvRowWalk walk(p_, b, g);
    for (int j = 0; j < n; ++j) {
      T* krow = &t.k[std::size_t(j) * t.dp];
      T* vrow = &t.v[std::size_t(j) * t.dvp];
      if (used != nullptr && !used[j]) {
        std::fill(krow, krow + t.dp, T(0));
        if (with_v) std::fill(vrow, vrow + t.dvp, T(0));
        continue;
      }
      std::int64_t k_off, v_off;
      walk.at(j0 + j, k_off, v_off);
      if (p_.qv) {
        load_row<E>(krow, k + k_off, p_.d, p_.d);
        load_row<E>(krow + p_.d, v + v_off, p_.d_v, t.dp - p_.d);
      } else {
        load_row<E>(krow, k + k_off, t.d, t.dp);
      }
      if (with_v) load_row<E>(vrow, v + v_off, t.dv, t.dvp);
    }
    transpose<T>(t.k.data(), t.dp, n, t.d, t.kt.data(), kBlockN);
    for (int c = 0; c < t.d; ++c)
      for (int j = n; j < kBlockN; ++j) t.kt[std::size_t(c) * kBlockN + j] = 0;
  }

  // The fp64 kernels' inputs: pointers to the fp32 key and value rows j0 .. j0 + n of
  // (b, KV head g) in the tensors.
  void key_rows_f32(ForwardTile<E>& t, int b, int g, std::int64_t j0, int n) const {
    const float* k = static_cast<const float*>(p_.k);
    const float* v = static_cast<const float*>(p_.v);
    KvRowWalk walk(p_, b, g);
    for (int j = 0; j < n; ++j) {
      std::int64_t k_off, v_off;
      walk.at(j0 + j, k_off, v_off);
      t.key_rows32[j] = k + k_off;
      t.value_rows32[j] = v + v_off;
    }
  }

  // load_kv for fp8 keys and values (an fp8 cache, or fp8 k, v with [b, h_k] descales):
  // each e4m3 byte decoded and multiplied by the scale of its (block, KV head), or of its
  // (sequence, KV head) with descales (FwdParams::kv_scale_index), value = e4m3 * scale in
  // the compute type. Keys with used[j] == 0 are zero rows, never read.
  void load_kv_fp8(ForwardTile<E>& t, int b, int g, std::int64_t j0, int n, bool with_v,
                   const std::uint8_t* used) const {
    const auto* k = static_cast<const std::uint8_t*>(p_.k);
    const auto* v = static_cast<const std::uint8_t*>(p_.v);
    for (int j = 0; j < n; ++j) {
      if (used != nullptr && !used[j]) {
        for (int c = 0; c < t.d; ++c) t.kt[std::size_t(c) * kBlockN + j] = 0;
        std::fill(&t.v[std::size_t(j) * t.dvp], &t.v[std::size_t(j) * t.dvp] + t.dvp, T(0));
        continue;
      }
      const std::int64_t scale_at = p_.kv_scale_index(b, j0 + j, g);
      const std::uint8_t* krow = k + p_.k_offset(b, j0 + j, g);
      const T ks = static_cast<T>(p_.k_scale[scale_at]);
      for (int c = 0; c < p_.d; ++c)
        t.kt[std::size_t(c) * kBlockN + j] = static_cast<T>(semantics::e4m3_to_float(krow[c])) * ks;
      if (with_v || p_.qv) {
        const std::uint8_t* vrow = v + p_.v_offset(b, j0 + j, g);
        const T vs = static_cast<T>(p_.v_scale[scale_at]);
        T* dst = &t.v[std::size_t(j) * t.dvp];
        load_row_e4m3<T>(dst, vrow, t.dv, t.dvp, vs);
        if (p_.qv)  // the value's part of the score row [k | v]
          for (int c = 0; c < t.dv; ++c) t.kt[std::size_t(p_.d + c) * kBlockN + j] = dst[c];
      }
    }
    for (int c = 0; c < t.d; ++c)
      for (int j = n; j < kBlockN; ++j) t.kt[std::size_t(c) * kBlockN + j] = 0;
  }

  // The draft-tree rule on the scores of rows i0 .. i0 + rows against key block j0:
  // drafts (keys s_k - s_q ..) whose bit is clear become -inf.
  void tree_mask_scores(ForwardTile<E>& t, int b, int i0, int rows, int s_q, int s_k,
                        std::int64_t j0) const {
    const std::int64_t first_draft = std::int64_t(s_k) - s_q;
    const std::int64_t lo = std::max<std::int64_t>(j0, first_draft);
    const std::int64_t hi = std::min<std::int64_t>(j0 + kBlockN, s_k);
    if (lo >= hi) return;
    const std::uint32_t* base = p_.tree_mask + std::int64_t(b) * p_.tree_batch_stride;
    for (int r = 0; r < rows; ++r) {
      const std::uint32_t* row = base + std::int64_t(i0 + r) * p_.tree_row_stride;
      T* sr = &t.s[std::size_t(r) * kBlockN];
      for (std::int64_t j = lo; j < hi; ++j) {
        if (!semantics::tree_key_visible(row, j, s_q, s_k)) sr[j - j0] = -static_cast<T>(INFINITY);
      }
    }
  }

  // Scores of the loaded query rows against the loaded key block j0 into tile.s
  // (-inf where not visible).
  // With products_done, tile.s already holds the raw dot products (the fp64 kernels).
  void scores(ForwardTile<E>& t, int b, const TaskRows& rs, int s_q, int s_k,
              std::int64_t j0, bool products_done = false) const {
    const int rows = rs.rows;
    if (products_done) {
    } else if constexpr (std::is_same_v<T, float>) {
      if (bf16_)
        bf16x::dot_block(rows, t.pairs, t.q16.data(), t.pairs, t.kp.data(), t.s.data(), kBlockN);
      else
        gemm<T>(rows, t.d, kBlockN, t.q.data(), t.dp, t.kt.data(), kBlockN, t.s.data(), kBlockN, false);
    } else {
      gemm<T>(rows, t.d, kBlockN, t.q.data(), t.dp, t.kt.data(), kBlockN, t.s.data(), kBlockN, false);
    }
    if (p_.block_kinds) {
      // Block sparsity: the block kinds and the partial blocks' element rule replace the
      // plain mask (a full block is not causal / window masked).
      for (int r = 0; r < rows; ++r) {
        const std::int64_t i = rs.i(r);
        T* sr = &t.s[std::size_t(r) * kBlockN];
        make_scores<T>(sr, nullptr, static_cast<T>(p_.scale), static_cast<T>(p_.softcap),
                       static_cast<T>(p_.alibi_slope(b, rs.h(r))), i, j0, s_q, s_k, false, 0, 0);
        block_sparse_mask_row<T>(p_, b, rs.h(r), i, j0, s_q, s_k, sr);
      }
      return;
    }
    // Ranges are monotone in i, so the block is inside every row's range when it is
    // inside the first row's end and the last row's begin.
    const semantics::KeyRange first = semantics::visible_keys(rs.i0, s_q, s_k, p_.mask);
    const semantics::KeyRange last = semantics::visible_keys(rs.i_end() - 1, s_q, s_k, p_.mask);
    const bool interior = last.begin <= j0 && j0 + kBlockN <= first.end;
    for (int r = 0; r < rows; ++r) {
      const std::int64_t i = rs.i(r);
      const T slope = static_cast<T>(p_.alibi_slope(b, rs.h(r)));
      const semantics::KeyRange range =
          interior ? semantics::KeyRange{0, 0} : semantics::visible_keys(i, s_q, s_k, p_.mask);
      make_scores<T>(&t.s[std::size_t(r) * kBlockN], nullptr, static_cast<T>(p_.scale),
                     static_cast<T>(p_.softcap), slope, i, j0, s_q, s_k, !interior, range.begin,
                     range.end);
    }
    if (p_.tree_mask) tree_mask_scores(t, b, rs.i0, rows, s_q, s_k, j0);  // never packed
  }

  // Streams key blocks [block_begin, block_end) (block indices within the sequence)
  // that rows i0 .. i0 + rows can see, leaving acc, row_max and row_sum in the tile.
  void attend(ForwardTile<E>& t, int b, const TaskRows& rs, int s_q, int s_k,
              int block_begin, int block_end) const {
    const int rows = rs.rows;
    std::fill(t.acc.begin(), t.acc.begin() + std::size_t(rows) * t.dvp, T(0));
    std::fill(t.row_max.begin(), t.row_max.end(), -static_cast<T>(INFINITY));
    std::fill(t.row_sum.begin(), t.row_sum.end(), T(0));
    const bool sparse = p_.block_kinds != nullptr;
    if (!sparse) {
      const semantics::KeyRange keys =
          semantics::visible_keys_of_rows(rs.i0, rs.i_end(), s_q, s_k, p_.mask);
      if (keys.empty()) return;
      block_begin = std::max(block_begin, static_cast<int>(keys.begin / kBlockN));
      block_end = std::min(block_end, static_cast<int>((keys.end + kBlockN - 1) / kBlockN));
    }
    const int g = rs.h0 / p_.h_ratio;
    const std::uint32_t bh = p_.dropout_bh(b, rs.h0);  // dropout is never packed
    const bool dropout = p_.rng.threshold != 0u;
    const bool fused = f64_ && rows <= f64x::kMaxRows;
    for (int kb = block_begin; kb < block_end; ++kb) {
      const std::int64_t j0 = std::int64_t(kb) * kBlockN;
      const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, s_k - j0));
      // Block sparsity: only tiles with a listed block, and only its listed keys, are read.
      if (sparse && !block_sparse_keys(p_, b, rs.h0, rs.i0, rs.i_end(), j0, n, t.used.data()))
        continue;
      if constexpr (std::is_same_v<S, float> && std::is_same_v<T, double>) {
        if (fused) {  // the fp64 kernels: rows read in place, the same sums (bit-identical)
          key_rows_f32(t, b, g, j0, n);
          f64x::scores(rows, t.d, t.q.data(), t.dp, t.key_rows32.data(), n, t.s.data(), kBlockN);
          scores(t, b, rs, s_q, s_k, j0, true);
          if (dropout) dropout_keep_tile<T>(p_.rng, bh, rs.i0, rows, j0, n, t.keep.data(), kBlockN);
          online_softmax(t, rows, dropout);
          f64x::pv(rows, n, t.s.data(), kBlockN, t.value_rows32.data(), t.dv, t.dvp, t.acc.data(),
                   t.dvp);
          continue;
        }
      }
      load_kv(t, b, g, j0, n, true, sparse ? t.used.data() : nullptr);
      scores(t, b, rs, s_q, s_k, j0);
      if (dropout) dropout_keep_tile<T>(p_.rng, bh, rs.i0, rows, j0, n, t.keep.data(), kBlockN);
      online_softmax(t, rows, dropout);
      if constexpr (std::is_same_v<T, float>) {
        if (bf16_) {  // P rounded to bf16 for P V (docs/semantics.md, CPU backend)
          bf16x::pv_block(rows, (n + 1) / 2, t.s.data(), kBlockN, t.vp.data(), t.dvp, t.dvp,
                          t.acc.data(), t.dvp);
          continue;
        }
      }
      gemm<T>(rows, n, t.dvp, t.s.data(), kBlockN, t.v.data(), t.dvp, t.acc.data(), t.dvp, true);
    }
  }

  // Folds the scores in tile.s into the running max / sum and rescales the
  // accumulator; tile.s becomes exp(score - max), times the keep mask.
  static void online_softmax(ForwardTile<E>& t, int rows, bool dropout) {
    for (int r = 0; r < rows; ++r) {
      T* sr = &t.s[std::size_t(r) * kBlockN];
      // Max over kW lanes, then over the lanes (GCC leaves the 'omp simd reduction(max)'
      // form scalar: a 4-cycle dependent max per key). The max does not depend on order.
      constexpr int kW = kVecCols<T>;
      T lane[kW];
      for (int l = 0; l < kW; ++l) lane[l] = -static_cast<T>(INFINITY);
      for (int j0 = 0; j0 < kBlockN; j0 += kW) {
#pragma omp simd
        for (int l = 0; l < kW; ++l) lane[l] = std::max(lane[l], sr[j0 + l]);
      }
      T block_max = -static_cast<T>(INFINITY);
      for (int l = 0; l < kW; ++l) block_max = std::max(block_max, lane[l]);
      const T m_old = t.row_max[r];
      const T m_new = std::max(m_old, block_max);
      // The max skips NaN scores (std::max keeps its first argument); they reach the sum
      // below instead, which makes the row's sum, lse and output NaN (docs/semantics.md,
      // non-finite values). A row with no finite score yet (all -inf or NaN) takes 0 as
      // its exponent base: exp(-inf - 0) = 0, exp(NaN) = NaN, never -inf - -inf.
      const T base = m_new == -static_cast<T>(INFINITY) ? T(0) : m_new;
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < kBlockN; ++j) {
        const T e = E::exp(sr[j] - base);
        sr[j] = e;
        sum += e;
      }
      const T alpha = E::exp(m_old - base);
      t.row_sum[r] = t.row_sum[r] * alpha + sum;
      t.row_max[r] = m_new;
      if (alpha != T(1)) {
        T* ar = &t.acc[std::size_t(r) * t.dvp];
#pragma omp simd
        for (int c = 0; c < t.dvp; ++c) ar[c] *= alpha;
      }
      if (dropout) {
        const T* kr = &t.keep[std::size_t(r) * kBlockN];
#pragma omp simd
        for (int j = 0; j < kBlockN; ++j) sr[j] *= kr[j];
      }
    }
  }

  // lse of each row from the running max / sum: -inf for rows that saw nothing (sum 0),
  // NaN for rows whose sum is NaN (a NaN or +inf score: max + log(NaN)).
  static T row_lse(const ForwardTile<E>& t, int r) {
    return t.row_sum[r] == T(0) ? -static_cast<T>(INFINITY) : t.row_max[r] + std::log(t.row_sum[r]);
  }

  // The learnable sink of query head h in the compute type (-inf without one).
  T sink_of(int h) const { return static_cast<T>(p_.sink_logit(h)); }

  void store_out_row(int b, int h, int i, const T* o, T factor) const {
    S* out = static_cast<S*>(p_.out) + p_.o_offset(b) + std::int64_t(h) * p_.o_head_stride +
             std::int64_t(i) * p_.o_row_stride;
    store_row<E>(out, o, p_.d_v, factor);
  }

  void store_lse(int b, int h, int i, T lse) const {
    if (p_.lse) p_.lse[p_.lse_offset(b, h) + i] = static_cast<float>(lse);
  }

  // Debug probabilities of rows i0 .. i0 + rows (tile.q loaded, tile.lse final):
  // P * keep over the visible keys, 0 elsewhere in [0, width).
  void write_probs(ForwardTile<E>& t, int b, int h, int i0, int rows, int s_q, int s_k,
                   int width) const {
    float* base = p_.probs + std::int64_t(b) * p_.probs_batch_stride +
                  std::int64_t(h) * p_.probs_head_stride;
    auto row_ptr = [&](int r) { return base + (p_.q_row0(b) + i0 + r) * p_.probs_row_stride; };
    for (int r = 0; r < rows; ++r) std::fill(row_ptr(r), row_ptr(r) + width, 0.0f);
    const semantics::KeyRange keys =
        p_.block_kinds ? semantics::KeyRange{0, s_k}
                       : semantics::visible_keys_of_rows(i0, i0 + rows, s_q, s_k, p_.mask);
    if (keys.empty()) return;
    const int g = h / p_.h_ratio;
    const std::uint32_t bh = p_.dropout_bh(b, h);
    const bool dropout = p_.rng.threshold != 0u;
    for (std::int64_t j0 = keys.begin / kBlockN * kBlockN; j0 < keys.end; j0 += kBlockN) {
      const int n = static_cast<int>(std::min<std::int64_t>({kBlockN, s_k - j0, width - j0}));
      if (n <= 0) break;
      const bool sparse = p_.block_kinds != nullptr;
      if (sparse && !block_sparse_keys(p_, b, h, i0, i0 + rows, j0, n, t.used.data())) continue;
      load_kv(t, b, g, j0, n, false, sparse ? t.used.data() : nullptr);
      scores(t, b, TaskRows{h, i0, rows, false}, s_q, s_k, j0);
      if (dropout) dropout_keep_tile<T>(p_.rng, bh, i0, rows, j0, n, t.keep.data(), kBlockN);
      for (int r = 0; r < rows; ++r) {
        if (t.lse[r] == -static_cast<T>(INFINITY)) continue;
        const T* sr = &t.s[std::size_t(r) * kBlockN];
        float* dst = row_ptr(r) + j0;
        for (int j = 0; j < n; ++j) {
          // Masked keys (-inf) are 0 also in a NaN row (exp(-inf - NaN) would be NaN).
          const T pr = sr[j] == -static_cast<T>(INFINITY) ? T(0) : E::exp(std::min(sr[j] - t.lse[r], T(0)));
          dst[j] = static_cast<float>(dropout ? pr * t.keep[std::size_t(r) * kBlockN + j] : pr);
        }
      }
    }
  }

  // seqused_q: rows past seq_len_q(b) are not computed; they are written as a row that
  // sees no key (out 0, lse -inf, debug probs 0).
  void write_unused_rows(int width) const {
    if (!p_.seqused_q) return;
    const std::vector<T> zeros(std::size_t(p_.d_v), T(0));
    for (int b = 0; b < p_.batch; ++b)
      for (int i = p_.seq_len_q(b); i < p_.seq_rows_q(b); ++i)
        for (int h = 0; h < p_.h_q; ++h) {
          store_out_row(b, h, i, zeros.data(), T(1));
          store_lse(b, h, i, -static_cast<T>(INFINITY));
          if (p_.probs) {
            float* row = p_.probs + std::int64_t(b) * p_.probs_batch_stride +
                         std::int64_t(h) * p_.probs_head_stride +
                         (p_.q_row0(b) + i) * p_.probs_row_stride;
            std::fill(row, row + width, 0.0f);
          }
        }
  }

  void run() const {
    write_unused_rows(p_.probs ? probs_width(p_) : 0);
    const int splits = resolve_num_splits(p_);
    const int qblocks = query_blocks(p_);
    const std::int64_t row_tasks = std::int64_t(p_.batch) * p_.h_q * qblocks;
    if (row_tasks == 0) return;
    const int nh = heads_per_task(p_);  // query heads per attend task (> 1: packed decode)
    const int head_groups = p_.h_q / nh;
    const std::int64_t attend_tasks = std::int64_t(p_.batch) * head_groups * qblocks;
    const int width = p_.probs ? probs_width(p_) : 0;

    // Partials: o [splits][batch * seqlen_q][h_q][d_v], lse [splits][batch * seqlen_q][h_q].
    std::vector<T> own_workspace;
    T* o_part = nullptr;
    T* lse_part = nullptr;
    const std::int64_t part_rows = std::int64_t(p_.batch) * p_.seqlen_q * p_.h_q;
    if (splits > 1) {
      const std::size_t bytes = split_workspace_bytes<T>(p_, splits);
      if (p_.workspace && p_.workspace_bytes >= bytes) {
        o_part = static_cast<T*>(p_.workspace);
      } else {
        own_workspace.resize(bytes / sizeof(T));
        o_part = own_workspace.data();
      }
      lse_part = o_part + std::int64_t(splits) * part_rows * p_.d_v;
    }
    auto part_row = [&](int split, int b, int h, int i) {
      return (std::int64_t(split) * p_.batch * p_.seqlen_q + std::int64_t(b) * p_.seqlen_q + i) *
                 p_.h_q + h;
    };

    // Workers (cpu/pool.hpp): the caller starts on the tasks at once and returns when they
    // are done, without waiting for helpers that wake after the last task was claimed.
    const int threads = team_size(p_.num_threads);
    const T keep_scale = static_cast<T>(semantics::dropout_keep_scale(p_.dropout_p));
    TaskQueue attend_queue(attend_tasks * splits);
    auto attend_body = [&](TaskQueue& queue) {
      ForwardTile<E> t(score_dim(p_), p_.d_v, bf16_, p_.rng.threshold != 0u);
      for (std::int64_t task; (task = queue.next()) >= 0;) {
        const int split = static_cast<int>(task % splits);
        const std::int64_t row_task = task / splits;
        const int qb = static_cast<int>(row_task % qblocks);
        const int hg = static_cast<int>(row_task / qblocks % head_groups);
        const int b = static_cast<int>(row_task / qblocks / head_groups);
        const int s_q = p_.seq_len_q(b), s_k = p_.seq_len_k(b);
        const int i0 = qb * kBlockM;
        if (i0 >= s_q) continue;
        const TaskRows rs = nh > 1 ? TaskRows{hg * nh, i0, nh, true}
                                   : TaskRows{hg, i0, std::min(kBlockM, s_q - i0), false};
        const int rows = rs.rows;
        const int key_blocks = (s_k + kBlockN - 1) / kBlockN;
        const int per_split = (key_blocks + splits - 1) / splits;
        const int kb0 = std::min(key_blocks, split * per_split);
        const int kb1 = std::min(key_blocks, kb0 + per_split);
        load_q(t, b, rs);
        attend(t, b, rs, s_q, s_k, kb0, kb1);
        for (int r = 0; r < rows; ++r) {
          const T lse = row_lse(t, r);
          T factor = lse == -static_cast<T>(INFINITY) ? T(0) : keep_scale / t.row_sum[r];
          const T* o = &t.acc[std::size_t(r) * t.dvp];
          if (splits == 1) {
            // The sink joins the denominator once, after every key (split partials get it
            // after their merge).
            const T total = semantics::lse_with_sink<T>(lse, sink_of(rs.h(r)));
            if (p_.sink) factor *= semantics::sink_rescale<T>(lse, total);
            store_out_row(b, rs.h(r), rs.i(r), o, factor);
            store_lse(b, rs.h(r), rs.i(r), total);
            t.lse[r] = total;
          } else {
            const std::int64_t pr = part_row(split, b, rs.h(r), rs.i(r));
            T* dst = o_part + pr * p_.d_v;
            for (int c = 0; c < p_.d_v; ++c) dst[c] = o[c] * factor;
            lse_part[pr] = lse;
          }
        }
        if (splits == 1 && p_.probs) write_probs(t, b, rs.h0, i0, rows, s_q, s_k, width);  // never packed
      }
    };
    run_workers(attend_queue, threads, attend_body);
    if (splits == 1) return;

    // The merge, after every partial is written (run_workers returned).
    TaskQueue merge_queue(row_tasks);
    auto merge_body = [&](TaskQueue& queue) {
      ForwardTile<E> t(score_dim(p_), p_.d_v, bf16_, p_.rng.threshold != 0u);
      std::vector<T> merged(p_.d_v);
      for (std::int64_t row_task; (row_task = queue.next()) >= 0;) {
        const int qb = static_cast<int>(row_task % qblocks);
        const int h = static_cast<int>(row_task / qblocks % p_.h_q);
        const int b = static_cast<int>(row_task / qblocks / p_.h_q);
        const int s_q = p_.seq_len_q(b), s_k = p_.seq_len_k(b);
        const int i0 = qb * kBlockM;
        if (i0 >= s_q) continue;
        const int rows = std::min(kBlockM, s_q - i0);
        const std::int64_t split_stride = std::int64_t(p_.batch) * p_.seqlen_q * p_.h_q;
        for (int r = 0; r < rows; ++r) {
          const std::int64_t pr0 = part_row(0, b, h, i0 + r);
          const T keys_lse = semantics::merged_lse<T>(lse_part + pr0, splits, split_stride);
          // With a sink, the merge weights are taken against the lse that includes it.
          const T lse = semantics::lse_with_sink<T>(keys_lse, sink_of(h));
          std::fill(merged.begin(), merged.end(), T(0));
          if (keys_lse != -static_cast<T>(INFINITY)) {
            for (int s = 0; s < splits; ++s) {
              const std::int64_t pr = pr0 + s * split_stride;
              const T w = semantics::merge_weight<T>(lse_part[pr], lse);
              if (w == T(0)) continue;
              const T* o = o_part + pr * p_.d_v;
              for (int c = 0; c < p_.d_v; ++c) merged[c] += w * o[c];
            }
          }
          store_out_row(b, h, i0 + r, merged.data(), T(1));
          store_lse(b, h, i0 + r, lse);
          t.lse[r] = lse;
        }
        if (p_.probs) {
          load_q(t, b, TaskRows{h, i0, rows, false});
          write_probs(t, b, h, i0, rows, s_q, s_k, width);
        }
      }
    };
    run_workers(merge_queue, threads, merge_body);
  }

 private:
  const FwdParams& p_;
  const bool bf16_;  // bf16_scores(p_)
  const bool f64_;   // f64_fused(p_)
};

}  // namespace

void forward(const FwdParams& p) {
  dispatch_dtype(p.dtype, [&](auto e) { Forward<decltype(e)>(p).run(); });
}

std::size_t forward_workspace_size(const FwdParams& p) {
  const int splits = resolve_num_splits(p);
  std::size_t bytes = 0;
  dispatch_dtype(p.dtype, [&](auto e) {
    bytes = split_workspace_bytes<typename decltype(e)::compute>(p, splits);
  });
  return bytes;
}

}  // namespace flashattn::detail::cpu
