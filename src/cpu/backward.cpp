// CPU backward: FlashAttention-2 structure, recomputing P from the forward's lse.
//
// For a query block (rows i) against a key block (keys j), with keep the dropout
// mask and rp = 1 / (1 - p):
//   P   = exp(S - lse)                      (0 where masked, and for rows with lse = -inf)
//   dV += (P * keep * rp)^T dO
//   dP  = dO V^T * keep * rp                (the gradient reaching P through dropout)
//   dS  = P * (dP - D),  D_i = rowsum(dO_i * O_i)   (= sum_j P_ij dP_ij)
//   dX  = dS * softcap_grad                 (X = scale * q.k, before the softcap)
//   dQ += scale * dX K,   dK += scale * dX^T Q
//
// Determinism for any thread count, by construction rather than by atomics: every
// output element has exactly one owner task, and each task sums in a fixed order. Two
// schedules (cpu/schedule.hpp), bit-identical to each other:
//   Key groups, parallel over (b, KV head g): the row blocks (q, dO, lse, D) of g's query
//     heads are loaded once; for each key block in order, for each query head and query
//     block in order, P and dS of the tile are computed once and feed dV, dK (of the key
//     block, in thread-local buffers) and dQ (of the query block, held for the task):
//     five products a tile. Used when there are at least two such tasks per thread.
//   Two passes, for fewer (b, g) than that, large groups and block sparsity:
//   Pass 1, parallel over (b, KV head g, key block): loops over the query heads of
//     g's GQA group and then over the query blocks, accumulating dK and dV of its key
//     block in thread-local buffers; the group sum is in head order.
//   Pass 2, parallel over (b, query head h, query block): recomputes P and
//     accumulates dQ of its rows over the key blocks in order.
// In two passes, P and dS are recomputed in both (the price of owning outputs without
// races over more, smaller tasks); no workspace is needed beyond the per-thread tiles. The
// tasks run on the worker pool (cpu/pool.hpp, run_workers; the two passes share one
// queue): the calling thread starts at once and the call never waits for a helper that
// wakes after the last task was claimed.
//
// A block-sparse mask (cpu/block_sparse.hpp) restricts both passes to the listed blocks: pass
// 1 skips the (head, query block) pairs that list none of its key block's keys, pass 2 the
// key blocks its rows list none of; keys no row lists are not read (zero rows).
//
// A learnable sink needs nothing in passes 1 and 2: lse includes it, so P = exp(S - lse)
// is already normalised with it, and D_i = sum_j P_ij dP_ij still equals rowsum(dO * O)
// (the sink's dP is 0: it carries no value). Its own gradient is a third pass.
#include <cstring>

#include "core/backend.hpp"
#include "cpu/bf16_kernels.hpp"
#include "cpu/block_sparse.hpp"
#include "cpu/isa.hpp"
#include "cpu/pool.hpp"
#include "cpu/schedule.hpp"
#include "cpu/tile.hpp"

namespace flashattn::detail::cpu {
namespace {

std::optional<BwdSchedule> g_schedule_override;

// Whether S = Q K^T and dP = dO V^T run as bf16 dot products (Isa::kAvx512Bf16, bf16
// tensors): the tile then also keeps q, dO and the key block as raw bf16 words.
bool bf16_products(const BwdParams& p) {
  return p.dtype == DType::kBFloat16 && active_isa() == Isa::kAvx512Bf16;
}

// The row operands of one query block (rows i0 .. i0 + rows of one query head), in the
// compute type T: what every tile of those rows reads.
template <class E>
struct RowBlock {
  using T = typename E::compute;
  std::vector<T> q;       // [kBlockM][dp]      query rows (fp32 / fp64 products only)
  std::vector<T> dout;    // [kBlockM][dvp]     output gradient rows (fp32 / fp64 products only)
  std::vector<T> delta;   // [kBlockM]          D_i = dO_i . O_i
  std::vector<T> lse;     // [kBlockM]
  // bf16 products (bf16_products): words of two bf16 values.
  std::vector<std::uint32_t> q16;       // [kBlockM][qpairs] query rows, zero-padded
  std::vector<std::uint32_t> do16;      // [kBlockM][vpairs] output gradient rows, zero-padded
  // The left-hand sides of dK^T += Q^T dS and dV^T += dO^T P in pairs of rows
  // (bf16x::pack_transposed_pairs).
  std::vector<std::uint32_t> qt;        // [d][kBlockM / 2]
  std::vector<std::uint32_t> dot;       // [d_v][kBlockM / 2]

  RowBlock(int d, int dv, int dp, int dvp, int qpairs, int vpairs, bool bf16)
      : q(bf16 ? 0 : std::size_t(kBlockM) * dp),
        dout(bf16 ? 0 : std::size_t(kBlockM) * dvp),
        delta(kBlockM),
        lse(kBlockM),
        q16(bf16 ? std::size_t(kBlockM) * qpairs : 0),
        do16(bf16 ? std::size_t(kBlockM) * vpairs : 0),
        qt(bf16 ? std::size_t(d) * (kBlockM / 2) : 0),
        dot(bf16 ? std::size_t(dv) * (kBlockM / 2) : 0) {}

  // Bytes of the buffers (the key-group schedule's memory bound).
  static std::size_t bytes(int d, int dv, int dp, int dvp, int qpairs, int vpairs, bool bf16) {
    const std::size_t words = bf16 ? std::size_t(kBlockM) * (qpairs + vpairs) +
                                         std::size_t(kBlockM / 2) * (d + dv)
                                   : 0;
    const std::size_t elems = (bf16 ? 0 : std::size_t(kBlockM) * (dp + dvp)) + 2 * kBlockM;
    return words * sizeof(std::uint32_t) + elems * sizeof(T);
  }
};

// Per-thread tiles of the backward, in the compute type T.
template <class E>
struct BackwardTile {
  using T = typename E::compute;
  int d, dp;    // head dim of q, k and its padded width
  int dv, dvp;  // head dim of v, out and its padded width
  int qpairs, vpairs;     // ceil(d / 2), ceil(d_v / 2)
  RowBlock<E> rows;       // the query block of the two-pass schedule and of the sink pass
  std::vector<T> o_row;   // [dvp]              one output row, for D
  std::vector<T> do_row;  // [dvp]              one output gradient row, for D (bf16 products)
  std::vector<T> kt;      // [d][kBlockN]       key block, transposed
  std::vector<T> vt;      // [dv][kBlockN]      value block, transposed
  std::vector<T> k;       // [kBlockN][dp]      key block (dQ += dS K)
  std::vector<T> v;       // [kBlockN][dvp]     value block (before the transpose into vt)
  std::vector<T> s;       // [kBlockM][kBlockN] scores, then P
  std::vector<T> capped;  // [kBlockM][kBlockN] softcapped scores before ALiBi
  std::vector<T> keep;    // [kBlockM][kBlockN] dropout keep mask, 1 or 0
  std::vector<T> ds;      // [kBlockM][kBlockN] dP, then dX
  std::vector<T> tr;      // [kBlockN][kBlockM] a transposed [rows][keys] tile
  std::vector<T> acc_a;   // [kBlockN][dp] dK (bf16 products: dK^T [d][kBlockN]) or [kBlockM][dp] dQ
  std::vector<T> acc_b;   // [kBlockN][dvp] dV (bf16 products: dV^T [d_v][kBlockN])
  std::vector<std::uint8_t> used;  // [kBlockN] block sparsity: keys of the block read
  std::vector<std::uint8_t> any;   // [kBlockN] block sparsity: their union (pass 1)
  // bf16 products (bf16_products): words of two bf16 values.
  std::vector<std::uint32_t> kp;   // [qpairs][kBlockN] key block packed by bf16x::pack_block
  std::vector<std::uint32_t> vp;   // [vpairs][kBlockN] value block, packed
  std::vector<const std::uint16_t*> k_rows, v_rows;  // [kBlockN] rows to pack (nullptr: zero)
  // The right-hand side of dQ += dS K in pairs of rows (bf16x::pack_value_pairs).
  std::vector<std::uint32_t> k_pairs;   // [kBlockN / 2][dp]
  // P and dS rounded to bf16 (bf16x::pack_probs): pairs of rows at each key, pairs of keys.
  std::vector<std::uint32_t> pt, dst;   // [kBlockM / 2][kBlockN]
  std::vector<std::uint32_t> ds16;      // [kBlockM][kBlockN / 2]
  std::vector<int> lo, hi;              // [kBlockM] visible keys of each row in the block
  std::vector<const std::uint16_t*> q_rows, do_rows;  // [kBlockM]
  // The key-group schedule: the row blocks of a KV head's query heads and their dQ.
  std::vector<RowBlock<E>> group_rows;  // [h_ratio * query blocks]
  std::vector<T> group_dq;              // [h_ratio * query blocks][kBlockM][dp]

  BackwardTile(int head_dim, int value_dim, bool bf16)
      : d(head_dim),
        dp(padded_dim<T>(head_dim)),
        dv(value_dim),
        dvp(padded_dim<T>(value_dim)),
        qpairs((head_dim + 1) / 2),
        vpairs((value_dim + 1) / 2),
        rows(head_dim, value_dim, dp, dvp, qpairs, vpairs, bf16),
        o_row(dvp),
        do_row(bf16 ? dvp : 0),
        kt(std::size_t(head_dim) * kBlockN),
        vt(std::size_t(value_dim) * kBlockN),
        k(std::size_t(kBlockN) * dp),
        v(std::size_t(kBlockN) * dvp),
        s(std::size_t(kBlockM) * kBlockN),
        capped(std::size_t(kBlockM) * kBlockN),
        keep(std::size_t(kBlockM) * kBlockN),
        ds(std::size_t(kBlockM) * kBlockN),
        tr(std::size_t(kBlockN) * kBlockM),
        acc_a(std::size_t(std::max(kBlockM, kBlockN)) * dp),
        acc_b(std::size_t(kBlockN) * dvp),
        used(kBlockN),
        any(kBlockN),
        kp(bf16 ? std::size_t(qpairs) * kBlockN : 0),
        vp(bf16 ? std::size_t(vpairs) * kBlockN : 0),
        k_rows(bf16 ? kBlockN : 0),
        v_rows(bf16 ? kBlockN : 0),
        k_pairs(bf16 ? std::size_t(kBlockN / 2) * dp : 0),
        pt(bf16 ? std::size_t(kBlockM / 2) * kBlockN : 0),
        dst(bf16 ? std::size_t(kBlockM / 2) * kBlockN : 0),
        ds16(bf16 ? std::size_t(kBlockM) * (kBlockN / 2) : 0),
        lo(kBlockM),
        hi(kBlockM),
        q_rows(bf16 ? kBlockM : 0),
        do_rows(bf16 ? kBlockM : 0) {}
};

template <class E>
class Backward {
 public:
  using T = typename E::compute;
  using S = typename E::storage;

  explicit Backward(const BwdParams& p) : p_(p), bf16_(bf16_products(p)) {}

  // Keys stored for sequence b (dk/dv rows to write); s_k(b) of them take part.
  int stored_keys(int b) const {
    return p_.stored_len_k(b);
  }

  // Rows i0 .. i0 + rows of (b, h) into rb: q, dO, lse and D = rowsum(dO * O) (t: scratch).
  void load_rows(RowBlock<E>& rb, BackwardTile<E>& t, int b, int h, int i0, int rows) const {
    const S* q = static_cast<const S*>(p_.q) + p_.q_offset(b) + std::int64_t(h) * p_.q_head_stride;
    const S* dout =
        static_cast<const S*>(p_.dout) + p_.do_offset(b) + std::int64_t(h) * p_.do_head_stride;
    const S* out = static_cast<const S*>(p_.out) + p_.o_offset(b) + std::int64_t(h) * p_.o_head_stride;
    for (int r = 0; r < rows; ++r) {
      const std::int64_t i = i0 + r;
      T* dor = bf16_ ? t.do_row.data() : &rb.dout[std::size_t(r) * t.dvp];
      load_row<E>(dor, dout + i * p_.do_row_stride, t.dv, t.dvp);
      if (bf16_) {
        copy_words(&rb.q16[std::size_t(r) * t.qpairs], q + i * p_.q_row_stride, t.d, t.qpairs);
        copy_words(&rb.do16[std::size_t(r) * t.vpairs], dout + i * p_.do_row_stride, t.dv, t.vpairs);
        t.q_rows[r] = reinterpret_cast<const std::uint16_t*>(q + i * p_.q_row_stride);
        t.do_rows[r] = reinterpret_cast<const std::uint16_t*>(dout + i * p_.do_row_stride);
      } else {
        load_row<E>(&rb.q[std::size_t(r) * t.dp], q + i * p_.q_row_stride, t.d, t.dp);
      }
      load_row<E>(t.o_row.data(), out + i * p_.o_row_stride, t.dv, t.dvp);
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < t.dvp; ++c) dot += dor[c] * t.o_row[c];
      rb.delta[r] = dot;
      rb.lse[r] = static_cast<T>(p_.lse[p_.lse_offset(b, h) + i]);
    }
    if (bf16_) {
      bf16x::pack_transposed_pairs(t.q_rows.data(), rows, t.d, rb.qt.data());
      bf16x::pack_transposed_pairs(t.do_rows.data(), rows, t.dv, rb.dot.data());
    }
  }

  // n bf16 values (storage elements) into `pairs` words, the last one zero-padded.
  static void copy_words(std::uint32_t* dst, const S* src, int n, int pairs) {
    dst[pairs - 1] = 0;
    std::memcpy(dst, src, sizeof(S) * std::size_t(n));
  }

  // Keys j0 .. j0 + n of (b, g): k (row-major), kt and vt (zero beyond n). Rows are
  // converted with unit stride, then transposed blockwise. With bf16 products: kp and vp
  // packed from the tensors, and k_pairs only when with_k (pass 2's dQ += dS K).
  // With `used` (block sparsity), keys with used[j] == 0 are zero rows, never read.
  void load_kv(BackwardTile<E>& t, int b, int g, std::int64_t j0, int n,
               const std::uint8_t* used = nullptr, bool with_k = true) const {
    const S* k = static_cast<const S*>(p_.k);
    const S* v = static_cast<const S*>(p_.v);
    if (bf16_) {
      for (int j = 0; j < n; ++j) {
        const bool skip = used && !used[j];
        const S* ksrc = k + p_.k_offset(b, j0 + j, g);
        t.k_rows[j] = skip ? nullptr : reinterpret_cast<const std::uint16_t*>(ksrc);
        t.v_rows[j] = skip ? nullptr : reinterpret_cast<const std::uint16_t*>(v + p_.v_offset(b, j0 + j, g));
      }
      bf16x::pack_block(t.k_rows.data(), n, t.d, t.kp.data());
      if (with_k) bf16x::pack_value_pairs(t.k_rows.data(), n, t.d, t.k_pairs.data(), t.dp);
      bf16x::pack_block(t.v_rows.data(), n, t.dv, t.vp.data());
      return;
    }
    for (int j = 0; j < n; ++j) {
      T* kr = &t.k[std::size_t(j) * t.dp];
      T* vr = &t.v[std::size_t(j) * t.dvp];
      if (used && !used[j]) {
        std::fill(kr, kr + t.dp, T(0));
        std::fill(vr, vr + t.dvp, T(0));
        continue;
      }
      load_row<E>(kr, k + p_.k_offset(b, j0 + j, g), t.d, t.dp);
      load_row<E>(vr, v + p_.v_offset(b, j0 + j, g), t.dv, t.dvp);
    }
    transpose<T>(t.k.data(), t.dp, n, t.d, t.kt.data(), kBlockN);
    transpose<T>(t.v.data(), t.dvp, n, t.dv, t.vt.data(), kBlockN);
    for (int c = 0; c < t.d; ++c)
      for (int j = n; j < kBlockN; ++j) t.kt[std::size_t(c) * kBlockN + j] = 0;
    for (int c = 0; c < t.dv; ++c)
      for (int j = n; j < kBlockN; ++j) t.vt[std::size_t(c) * kBlockN + j] = 0;
  }

  // For the loaded rows and key block j0 (n valid keys): t.s = P (times keep * rp
  // when dropout is on, i.e. the probabilities V was weighted with) and t.ds = dX.
  void probs_and_grads(BackwardTile<E>& t, const RowBlock<E>& rb, int b, int h, int i0, int rows,
                       int s_q, int s_k, std::int64_t j0, int n) const {
    if (bf16_) {
      if constexpr (std::is_same_v<T, float>) {
        bf16x::dot_block(rows, t.qpairs, rb.q16.data(), t.qpairs, t.kp.data(), t.s.data(), kBlockN);
        bf16x::dot_block(rows, t.vpairs, rb.do16.data(), t.vpairs, t.vp.data(), t.ds.data(), kBlockN);
      }
    } else {
      gemm<T>(rows, t.d, kBlockN, rb.q.data(), t.dp, t.kt.data(), kBlockN, t.s.data(), kBlockN, false);
      gemm<T>(rows, t.dv, kBlockN, rb.dout.data(), t.dvp, t.vt.data(), kBlockN, t.ds.data(), kBlockN,
              false);
    }
    const semantics::KeyRange first = semantics::visible_keys(i0, s_q, s_k, p_.mask);
    const semantics::KeyRange last = semantics::visible_keys(i0 + rows - 1, s_q, s_k, p_.mask);
    const bool interior = last.begin <= j0 && j0 + kBlockN <= first.end;
    const T slope = static_cast<T>(p_.alibi_slope(b, h));
    const T softcap = static_cast<T>(p_.softcap);
    const bool dropout = p_.rng.threshold != 0u;
    if constexpr (std::is_same_v<T, float>) {
      if (bf16_ && slope == T(0) && !(softcap > T(0)) && !dropout && !p_.block_kinds) {
        // The plain case on 16 lanes (bf16x::softmax_grad_rows): the mask as a key range per row.
        for (int r = 0; r < rows; ++r) {
          const semantics::KeyRange range =
              interior ? semantics::KeyRange{j0, j0 + kBlockN} : semantics::visible_keys(i0 + r, s_q, s_k, p_.mask);
          t.lo[r] = static_cast<int>(std::clamp<std::int64_t>(range.begin - j0, 0, kBlockN));
          t.hi[r] = static_cast<int>(std::clamp<std::int64_t>(range.end - j0, 0, kBlockN));
        }
        bf16x::softmax_grad_rows(rows, t.s.data(), t.ds.data(), kBlockN, static_cast<float>(p_.scale),
                                 rb.lse.data(), rb.delta.data(), t.lo.data(), t.hi.data());
        return;
      }
    }
    const T rp = static_cast<T>(semantics::dropout_keep_scale(p_.dropout_p));
    if (dropout)
      dropout_keep_tile<T>(p_.rng, p_.dropout_bh(b, h), i0, rows, j0, n, t.keep.data(), kBlockN);
    for (int r = 0; r < rows; ++r) {
      const std::int64_t i = i0 + r;
      T* sr = &t.s[std::size_t(r) * kBlockN];
      T* dsr = &t.ds[std::size_t(r) * kBlockN];
      T* cr = softcap > T(0) ? &t.capped[std::size_t(r) * kBlockN] : nullptr;
      if (p_.block_kinds) {
        // Block sparsity replaces the plain mask (semantics.hpp, block sparsity).
        make_scores<T>(sr, cr, static_cast<T>(p_.scale), softcap, slope, i, j0, s_q, s_k, false, 0,
                       0);
        block_sparse_mask_row<T>(p_, b, h, i, j0, s_q, s_k, sr);
      } else {
        const semantics::KeyRange range =
            interior ? semantics::KeyRange{0, 0} : semantics::visible_keys(i, s_q, s_k, p_.mask);
        make_scores<T>(sr, cr, static_cast<T>(p_.scale), softcap, slope, i, j0, s_q, s_k,
                       !interior, range.begin, range.end);
      }
      const T lse = rb.lse[r];
      if (lse == -static_cast<T>(INFINITY)) {
        std::fill(sr, sr + kBlockN, T(0));
        std::fill(dsr, dsr + kBlockN, T(0));
        continue;
      }
      const T delta = rb.delta[r];
      const T* kr = dropout ? &t.keep[std::size_t(r) * kBlockN] : nullptr;
      // A masked key (score -inf) gets P = 0 and dS = 0 by a select, not by 0 * x: a NaN
      // row (NaN lse, dO, D) or a NaN dP (a NaN value row) must not reach the keys and
      // rows the mask separates (docs/semantics.md, non-finite values).
      // One loop per (softcap, dropout) case: with the null-pointer tests inside, GCC left
      // the loop (and its exp) scalar.
      auto grads = [&](auto with_softcap, auto with_dropout) {
#pragma omp simd
        for (int j = 0; j < kBlockN; ++j) {
          const bool visible = sr[j] != -static_cast<T>(INFINITY);
          const T pr = E::exp(std::min(sr[j] - lse, T(0)));
          T kept = T(1);
          if constexpr (decltype(with_dropout)::value) kept = kr[j] * rp;
          T ds = pr * (dsr[j] * kept - delta);
          if constexpr (decltype(with_softcap)::value) ds *= semantics::softcap_grad<T>(cr[j], softcap);
          dsr[j] = visible ? ds : T(0);
          sr[j] = visible ? pr * kept : T(0);
        }
      };
      using Yes = std::true_type;
      using No = std::false_type;
      if (cr)
        dropout ? grads(Yes{}, Yes{}) : grads(Yes{}, No{});
      else
        dropout ? grads(No{}, Yes{}) : grads(No{}, No{});
    }
  }

  // One tile's products into the gradients, after probs_and_grads: dV[n][dvp] += P^T dO and
  // dK[n][dp] += dX^T Q (when dk), and dQ[rows][dp] += dX K (when dq). With bf16 products dK
  // and dV are kept transposed ([d][kBlockN], [d_v][kBlockN]: store_kv reads them so).
  void tile_products(BackwardTile<E>& t, const RowBlock<E>& rb, int rows, int n, T* dk, T* dv,
                     T* dq) const {
    if constexpr (std::is_same_v<T, float>) {
      if (bf16_) {  // P and dX rounded to bf16 (docs/semantics.md, CPU backend)
        bf16x::pack_probs(rows, t.s.data(), t.ds.data(), kBlockN, t.pt.data(), t.dst.data(), t.ds16.data());
        if (dk) {  // transposed: dV^T[d_v][keys] += dO^T P, dK^T[d][keys] += Q^T dX
          const int pairs = (rows + 1) / 2;
          bf16x::dot_block(t.dv, pairs, rb.dot.data(), kBlockM / 2, t.pt.data(), dv, kBlockN, true);
          bf16x::dot_block(t.d, pairs, rb.qt.data(), kBlockM / 2, t.dst.data(), dk, kBlockN, true);
        }
        if (dq)
          bf16x::pv_block_words(rows, (n + 1) / 2, t.ds16.data(), kBlockN / 2, t.k_pairs.data(), t.dp,
                                t.dp, dq, t.dp);
        return;
      }
    }
    if (dk) {
      transpose<T>(t.s.data(), kBlockN, rows, n, t.tr.data(), kBlockM);
      gemm<T>(n, rows, t.dvp, t.tr.data(), kBlockM, rb.dout.data(), t.dvp, dv, t.dvp, true);
      transpose<T>(t.ds.data(), kBlockN, rows, n, t.tr.data(), kBlockM);
      gemm<T>(n, rows, t.dp, t.tr.data(), kBlockM, rb.q.data(), t.dp, dk, t.dp, true);
    }
    if (dq) gemm<T>(rows, n, t.dp, t.ds.data(), kBlockN, t.k.data(), t.dp, dq, t.dp, true);
  }

  // Whether the tile of query rows i0 .. i0 + rows against keys j0 .. j0 + n has a visible
  // key (without block sparsity).
  bool tile_visible(int i0, int rows, int s_q, int s_k, std::int64_t j0, int n) const {
    const semantics::KeyRange keys = semantics::visible_keys_of_rows(i0, i0 + rows, s_q, s_k, p_.mask);
    return !keys.empty() && keys.end > j0 && keys.begin < j0 + n;
  }

  // dk and dv rows of key block j0 (`stored` of them), from the accumulators; the first n
  // are keys of the sequence, the rest (past seqused_k) are 0.
  void store_kv(const BackwardTile<E>& t, int b, int g, std::int64_t j0, int stored, int n,
                const T* dk, const T* dv) const {
    S* dk_out = static_cast<S*>(p_.dk);
    S* dv_out = static_cast<S*>(p_.dv);
    const T scale = static_cast<T>(p_.scale);
    if (bf16_) {
      // Transposed accumulators. Their columns past n are not 0 where a NaN q / dO row met
      // the zero P and dS of those keys (0 * NaN in the block product), so they are not read.
      for (int j = 0; j < stored; ++j) {
        S* kr = dk_out + p_.dk_offset(b, j0 + j, g);
        S* vr = dv_out + p_.dv_offset(b, j0 + j, g);
        const bool key = j < n;
        for (int c = 0; c < t.d; ++c) kr[c] = E::store(key ? dk[std::size_t(c) * kBlockN + j] * scale : T(0));
        for (int c = 0; c < t.dv; ++c) vr[c] = E::store(key ? dv[std::size_t(c) * kBlockN + j] : T(0));
      }
      return;
    }
    for (int j = 0; j < stored; ++j) {
      store_row<E>(dk_out + p_.dk_offset(b, j0 + j, g), dk + std::size_t(j) * t.dp, t.d, scale);
      store_row<E>(dv_out + p_.dv_offset(b, j0 + j, g), dv + std::size_t(j) * t.dvp, t.dv, T(1));
    }
  }

  // dq rows i0 .. i0 + rows of (b, h), from the accumulator.
  void store_q(const BackwardTile<E>& t, int b, int h, int i0, int rows, const T* dq) const {
    S* dq_out = static_cast<S*>(p_.dq) + p_.dq_offset(b) + std::int64_t(h) * p_.dq_head_stride;
    const T scale = static_cast<T>(p_.scale);
    for (int r = 0; r < rows; ++r)
      store_row<E>(dq_out + std::int64_t(i0 + r) * p_.dq_row_stride, dq + std::size_t(r) * t.dp, t.d,
                   scale);
  }

  // Pass 1 task: dK and dV of key block kb of (b, g).
  void key_block(BackwardTile<E>& t, int b, int g, int kb) const {
    const std::int64_t j0 = std::int64_t(kb) * kBlockN;
    const int stored = static_cast<int>(std::min<std::int64_t>(kBlockN, stored_keys(b) - j0));
    if (stored <= 0) return;
    const int s_q = p_.seq_len_q(b), s_k = p_.seq_len_k(b);
    const int n = static_cast<int>(std::max<std::int64_t>(0, std::min<std::int64_t>(kBlockN, s_k - j0)));
    T* dk = t.acc_a.data();  // [kBlockN][dp]
    T* dv = t.acc_b.data();  // [kBlockN][dvp]
    std::fill(dk, dk + std::size_t(kBlockN) * t.dp, T(0));
    std::fill(dv, dv + std::size_t(kBlockN) * t.dvp, T(0));
    const bool sparse = p_.block_kinds != nullptr;
    bool any_visited = !sparse;
    if (sparse && n > 0) {
      // The keys any query row of the group visits: the others are not read.
      std::fill(t.any.begin(), t.any.end(), std::uint8_t(0));
      for (int hr = 0; hr < p_.h_ratio; ++hr) {
        if (!block_sparse_keys(p_, b, g * p_.h_ratio + hr, 0, s_q, j0, n, t.used.data())) continue;
        any_visited = true;
        for (int j = 0; j < kBlockN; ++j) t.any[j] |= t.used[j];
      }
    }
    if (n > 0 && any_visited) {
      load_kv(t, b, g, j0, n, sparse ? t.any.data() : nullptr, false);
      for (int hr = 0; hr < p_.h_ratio; ++hr) {
        const int h = g * p_.h_ratio + hr;
        for (int i0 = 0; i0 < s_q; i0 += kBlockM) {
          const int rows = std::min(kBlockM, s_q - i0);
          if (sparse ? !block_sparse_keys(p_, b, h, i0, i0 + rows, j0, n, nullptr)
                     : !tile_visible(i0, rows, s_q, s_k, j0, n))
            continue;
          load_rows(t.rows, t, b, h, i0, rows);
          probs_and_grads(t, t.rows, b, h, i0, rows, s_q, s_k, j0, n);
          tile_products(t, t.rows, rows, n, dk, dv, nullptr);
        }
      }
    }
    store_kv(t, b, g, j0, stored, n, dk, dv);
  }

  // Pass 2 task: dQ of query block qb of (b, h).
  void query_block(BackwardTile<E>& t, int b, int h, int qb) const {
    const int s_q = p_.seq_len_q(b), s_k = p_.seq_len_k(b);
    const int i0 = qb * kBlockM;
    if (i0 >= s_q) return;
    const int rows = std::min(kBlockM, s_q - i0);
    T* dq = t.acc_a.data();  // [kBlockM][dp]
    std::fill(dq, dq + std::size_t(rows) * t.dp, T(0));
    const bool sparse = p_.block_kinds != nullptr;
    const semantics::KeyRange keys =
        sparse ? semantics::KeyRange{0, s_k}
               : semantics::visible_keys_of_rows(i0, i0 + rows, s_q, s_k, p_.mask);
    if (!keys.empty()) {
      load_rows(t.rows, t, b, h, i0, rows);
      const int g = h / p_.h_ratio;
      for (std::int64_t j0 = keys.begin / kBlockN * kBlockN; j0 < keys.end; j0 += kBlockN) {
        const int n = static_cast<int>(std::min<std::int64_t>(kBlockN, s_k - j0));
        if (sparse && !block_sparse_keys(p_, b, h, i0, i0 + rows, j0, n, t.used.data())) continue;
        load_kv(t, b, g, j0, n, sparse ? t.used.data() : nullptr);
        probs_and_grads(t, t.rows, b, h, i0, rows, s_q, s_k, j0, n);
        tile_products(t, t.rows, rows, n, nullptr, nullptr, dq);
      }
    }
    store_q(t, b, h, i0, rows, dq);
  }

  // Key-group task (the one-pass schedule, without block sparsity): every gradient of the
  // KV head g of sequence b. The row blocks of its query heads are loaded once; then for
  // each key block in order, for each query head hr and query block in order, the tile's P
  // and dS are computed once and feed all three products. dK and dV of a key block are
  // summed over (hr, query block) in the order of pass 1, and dQ of a query block over the
  // key blocks in the order of pass 2, with the same kernels on the same operands: the
  // gradients are bit-identical to the two-pass schedule's.
  void key_group(BackwardTile<E>& t, int b, int g) const {
    const int s_q = p_.seq_len_q(b), s_k = p_.seq_len_k(b);
    const int qblocks = (s_q + kBlockM - 1) / kBlockM;
    const std::size_t blocks = std::size_t(p_.h_ratio) * qblocks;
    while (t.group_rows.size() < blocks)
      t.group_rows.emplace_back(t.d, t.dv, t.dp, t.dvp, t.qpairs, t.vpairs, bf16_);
    const std::size_t dq_block = std::size_t(kBlockM) * t.dp;
    t.group_dq.assign(blocks * dq_block, T(0));
    for (int hr = 0; hr < p_.h_ratio; ++hr)
      for (int qb = 0; qb < qblocks; ++qb) {
        const int i0 = qb * kBlockM;
        load_rows(t.group_rows[std::size_t(hr) * qblocks + qb], t, b, g * p_.h_ratio + hr, i0,
                  std::min(kBlockM, s_q - i0));
      }
    T* dk = t.acc_a.data();  // [kBlockN][dp]
    T* dv = t.acc_b.data();  // [kBlockN][dvp]
    const std::int64_t stored_total = stored_keys(b);
    for (std::int64_t j0 = 0; j0 < stored_total; j0 += kBlockN) {
      const int stored = static_cast<int>(std::min<std::int64_t>(kBlockN, stored_total - j0));
      const int n = static_cast<int>(std::max<std::int64_t>(0, std::min<std::int64_t>(kBlockN, s_k - j0)));
      std::fill(dk, dk + std::size_t(kBlockN) * t.dp, T(0));
      std::fill(dv, dv + std::size_t(kBlockN) * t.dvp, T(0));
      if (n > 0) {
        bool loaded = false;
        for (int hr = 0; hr < p_.h_ratio; ++hr) {
          const int h = g * p_.h_ratio + hr;
          for (int qb = 0; qb < qblocks; ++qb) {
            const int i0 = qb * kBlockM;
            const int rows = std::min(kBlockM, s_q - i0);
            if (!tile_visible(i0, rows, s_q, s_k, j0, n)) continue;
            if (!loaded) load_kv(t, b, g, j0, n);
            loaded = true;
            const std::size_t blk = std::size_t(hr) * qblocks + qb;
            const RowBlock<E>& rb = t.group_rows[blk];
            probs_and_grads(t, rb, b, h, i0, rows, s_q, s_k, j0, n);
            tile_products(t, rb, rows, n, dk, dv, &t.group_dq[blk * dq_block]);
          }
        }
      }
      store_kv(t, b, g, j0, stored, n, dk, dv);
    }
    for (int hr = 0; hr < p_.h_ratio; ++hr)
      for (int qb = 0; qb < qblocks; ++qb) {
        const int i0 = qb * kBlockM;
        store_q(t, b, g * p_.h_ratio + hr, i0, std::min(kBlockM, s_q - i0),
                &t.group_dq[(std::size_t(hr) * qblocks + qb) * dq_block]);
      }
  }

  // Pass 3 (with a sink gradient), parallel over query heads: d sink_h = -sum over the
  // rows i of every sequence of exp(sink_h - lse_i) * D_i, summed in a fixed order (fp64).
  void sink_grad(BackwardTile<E>& t, int h) const {
    const T sink = static_cast<T>(p_.sink_logit(h));
    double acc = 0;
    for (int b = 0; b < p_.batch; ++b) {
      const int s_q = p_.seq_len_q(b);
      for (int i0 = 0; i0 < s_q; i0 += kBlockM) {
        const int rows = std::min(kBlockM, s_q - i0);
        load_rows(t.rows, t, b, h, i0, rows);
        for (int r = 0; r < rows; ++r)
          acc -= double(semantics::sink_prob<T>(sink, t.rows.lse[r])) * double(t.rows.delta[r]);
      }
    }
    p_.dsink[h] = static_cast<float>(acc);
  }

  // seqused_q: the dq rows past seq_len_q(b) are 0 (those rows are not computed).
  void zero_unused_dq_rows() const {
    if (!p_.seqused_q) return;
    const std::vector<T> zeros(std::size_t(p_.d), T(0));
    for (int b = 0; b < p_.batch; ++b) {
      S* dq_out = static_cast<S*>(p_.dq) + p_.dq_offset(b);
      for (int i = p_.seq_len_q(b); i < p_.seq_rows_q(b); ++i)
        for (int h = 0; h < p_.h_q; ++h)
          store_row<E>(dq_out + std::int64_t(i) * p_.dq_row_stride + std::int64_t(h) * p_.dq_head_stride,
                       zeros.data(), p_.d, T(1));
    }
  }

  void run() const {
    zero_unused_dq_rows();
    // Workers (cpu/pool.hpp): the caller starts on the tasks at once and returns when they
    // are done, without waiting for helpers that wake after the last task was claimed.
    const int threads = team_size(p_.num_threads);
    if (p_.dsink) {
      TaskQueue sink_queue(p_.h_q);
      auto sink_body = [&](TaskQueue& queue) {
        BackwardTile<E> t(p_.d, p_.d_v, bf16_);
        for (std::int64_t h; (h = queue.next()) >= 0;) sink_grad(t, static_cast<int>(h));
      };
      run_workers(sink_queue, threads, sink_body);
    }
    if (schedule(threads) == BwdSchedule::kKeyGroups) {
      TaskQueue queue(std::int64_t(p_.batch) * p_.h_k);
      auto body = [&](TaskQueue& q) {
        BackwardTile<E> t(p_.d, p_.d_v, bf16_);
        for (std::int64_t task; (task = q.next()) >= 0;)
          key_group(t, static_cast<int>(task / p_.h_k), static_cast<int>(task % p_.h_k));
      };
      run_workers(queue, threads, body);
      return;
    }
    const std::int64_t key_tasks =
        std::int64_t(p_.batch) * p_.h_k * ((p_.seqlen_k + kBlockN - 1) / kBlockN);
    const int qblocks = (p_.seqlen_q + kBlockM - 1) / kBlockM;
    const std::int64_t query_tasks = std::int64_t(p_.batch) * p_.h_q * qblocks;
    if (key_tasks == 0 && query_tasks == 0) return;
    const int kblocks = (p_.seqlen_k + kBlockN - 1) / kBlockN;
    // Passes 1 and 2 write disjoint outputs (dk, dv against dq) and read only the inputs,
    // so one queue holds both: the key tasks first, then the query tasks.
    TaskQueue queue(key_tasks + query_tasks);
    auto body = [&](TaskQueue& q) {
      BackwardTile<E> t(p_.d, p_.d_v, bf16_);
      for (std::int64_t task; (task = q.next()) >= 0;) {
        if (task < key_tasks) {
          const int kb = static_cast<int>(task % kblocks);
          const int g = static_cast<int>(task / kblocks % p_.h_k);
          const int b = static_cast<int>(task / kblocks / p_.h_k);
          key_block(t, b, g, kb);
        } else {
          const std::int64_t qt = task - key_tasks;
          const int qb = static_cast<int>(qt % qblocks);
          const int h = static_cast<int>(qt / qblocks % p_.h_q);
          const int b = static_cast<int>(qt / qblocks / p_.h_q);
          query_block(t, b, h, qb);
        }
      }
    };
    run_workers(queue, threads, body);
  }

  // cpu/schedule.hpp: key groups without block sparsity when there are at least two per
  // thread (or one thread) and their row blocks fit kKeyGroupBytes.
  BwdSchedule schedule(int threads) const {
    if (p_.block_kinds != nullptr) return BwdSchedule::kTwoPasses;
    if (g_schedule_override) return *g_schedule_override;
    const std::int64_t groups = std::int64_t(p_.batch) * p_.h_k;
    if (threads > 1 && groups < 2 * std::int64_t(threads)) return BwdSchedule::kTwoPasses;
    const int dp = padded_dim<T>(p_.d), dvp = padded_dim<T>(p_.d_v);
    const std::size_t per_block = RowBlock<E>::bytes(p_.d, p_.d_v, dp, dvp, (p_.d + 1) / 2, (p_.d_v + 1) / 2, bf16_) +
                                  std::size_t(kBlockM) * dp * sizeof(T);
    const std::size_t blocks = std::size_t(p_.h_ratio) * ((std::size_t(p_.seqlen_q) + kBlockM - 1) / kBlockM);
    return blocks * per_block <= kKeyGroupBytes ? BwdSchedule::kKeyGroups : BwdSchedule::kTwoPasses;
  }

 private:
  const BwdParams& p_;
  const bool bf16_;  // bf16_products(p_)
};

}  // namespace

void backward(const BwdParams& p) {
  dispatch_dtype(p.dtype, [&](auto e) { Backward<decltype(e)>(p).run(); });
}

std::size_t backward_workspace_size(const BwdParams&) { return 0; }

void set_backward_schedule_override(std::optional<BwdSchedule> schedule) { g_schedule_override = schedule; }

}  // namespace flashattn::detail::cpu
