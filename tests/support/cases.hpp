// Host-side test problems in the layouts of the public API: a dense batch, a varlen
// pack and a KV cache (dense or paged). Each case holds its inputs and output buffers
// as HostTensors, builds the matching RefProblem for the oracle, and extracts a
// backend's results in the oracle's concatenated order (reference.hpp). CPU tests call
// run_*(); GPU tests copy the same host tensors to the device, copy the results back
// into the output HostTensors and reuse the extraction and comparisons.
#pragma once

#include <vector>

#include "flashattn/attention.hpp"
#include "reference/reference.hpp"
#include "support/host_tensor.hpp"
#include "support/random.hpp"

namespace flashattn::test {

// cu_seqlens of sequences with these lengths: 0, then the running sums.
std::vector<int> offsets(const std::vector<int>& lengths);

// Random ALiBi slopes in (0, 1], [h_q] or [batch * h_q].
std::vector<float> random_alibi(Rng& rng, int batch, int h_q, bool per_batch);

// Random learnable sink logits [h_q] in [lo, hi] (gpt-oss's trained sinks sit around 0..3).
std::vector<float> random_sink(Rng& rng, int h_q, double lo = -2.0, double hi = 3.0);

// A learnable sink for a case: the host logits, their fp32 [h_q] tensor and, for the
// backward, the fp32 [h_q] gradient output (learnable_sink_grad).
struct SinkInputs {
  std::vector<float> logits;  // empty = no sink
  HostTensor tensor, grad;
  bool want_grad = true;
  void set(std::vector<float> values);
  void apply(Options& o) const;  // learnable_sink (and learnable_sink_grad) when set
  void poison_grad();
  std::vector<double> grad_values() const;  // empty without a sink or a gradient
  std::vector<double> as_double() const { return {logits.begin(), logits.end()}; }
};

// ------------------------------------------------------------------ dense
struct DenseCase {
  Shape shape;
  DType dtype = DType::kFloat32;
  HostTensor q, k, v, dout;   // inputs
  HostTensor out, lse;        // forward outputs
  HostTensor probs;           // fp32 [b, h_q, s_q, s_k] when want_probs()
  HostTensor dq, dk, dv;      // backward outputs
  std::vector<float> alibi;   // host slopes; empty = off
  bool alibi_per_batch = false;
  HostTensor alibi_tensor;
  SinkInputs sink;            // learnable sink (and its gradient), filled in by call_options()
  HostTensor qv;              // MLA's qv [b, s_q, h_q, d_v] (forward only) after set_qv
  Options opts;               // alibi_slopes / return_probs / qv are filled in by call_options()

  static DenseCase random(Rng& rng, const Shape& shape, DType dtype, double stddev = 1.0);
  void set_qv(Rng& rng);  // a random qv
  void set_alibi(std::vector<float> slopes, bool per_batch);
  void want_probs();
  Options call_options() const;

  RefProblem problem() const;  // with dout
  void poison_forward();
  void poison_backward();
  void run_forward();
  void run_backward();  // uses out and lse as they are (normally from run_forward)
};

// ------------------------------------------------------------------ varlen
struct VarlenCase {
  int h_q = 1, h_k = 1, d = 1;
  int d_v = 0;                   // head dim of v, out, dout, dv (make sets it; 0 = d)
  DType dtype = DType::kFloat32;
  std::vector<int> cu_q, cu_k;   // [batch + 1]
  std::vector<int> seqused_k;    // empty or [batch]
  std::vector<int> seqused_q;    // empty or [batch]: queries computed per sequence
  int total_q = 0, total_k = 0;  // rows of the packed tensors (>= cu.back(): padding allowed)
  HostTensor q, k, v, dout, out, lse, probs, dq, dk, dv;
  HostTensor cu_q_t, cu_k_t, seqused_t, seqused_q_t;
  std::vector<float> alibi;
  bool alibi_per_batch = false;
  HostTensor alibi_tensor;
  SinkInputs sink;
  HostTensor qv;  // MLA's qv [total_q, h_q, d_v] (forward only) after set_qv
  Options opts;

  int batch() const { return static_cast<int>(cu_q.size()) - 1; }
  void set_qv(Rng& rng);
  int len_q(int b) const { return cu_q[b + 1] - cu_q[b]; }
  int len_k(int b) const { return cu_k[b + 1] - cu_k[b]; }
  int used_k(int b) const { return seqused_k.empty() ? len_k(b) : seqused_k[b]; }
  int used_q(int b) const { return seqused_q.empty() ? len_q(b) : seqused_q[b]; }
  int max_q() const;
  int max_k() const;

  // pad_q / pad_k extra rows after the last sequence (never read, never compared);
  // d_v: head dim of v (0 = d).
  static VarlenCase make(Rng& rng, std::vector<int> cu_q, std::vector<int> cu_k, int h_q, int h_k,
                         int d, DType dtype, int pad_q = 0, int pad_k = 0, int d_v = 0);
  void set_seqused_k(std::vector<int> used);
  void set_seqused_q(std::vector<int> used);
  // q and dout rows past seqused_q become NaN: a backend that reads them shows it.
  void poison_unused_q_rows();
  void set_alibi(std::vector<float> slopes, bool per_batch);
  void want_probs();
  Options call_options() const;
  VarlenArgs args() const;

  RefProblem problem() const;
  void poison_forward();
  void poison_backward();
  void run_forward();
  void run_backward();

  // Results in the oracle's order (only rows that belong to a sequence, and of those the
  // first used_q(b)).
  std::vector<double> out_concat() const;
  std::vector<double> lse_concat() const;
  std::vector<double> probs_concat() const;  // columns j < used_k(b)
  std::vector<double> dq_concat() const;
  std::vector<double> dk_concat() const;     // rows j < used_k(b) of each sequence
  std::vector<double> dv_concat() const;
  // dk/dv rows of each sequence at or beyond used_k(b) (their expected value is 0).
  std::vector<double> dkv_unused_rows() const;
  // out (or dq) rows of each sequence at or beyond used_q(b) (expected 0), and their lse
  // (expected -inf).
  std::vector<double> q_unused_rows(const HostTensor& t) const;
  std::vector<double> lse_unused_rows() const;
};

// ------------------------------------------------------------------ fp8 q, k, v
// fp8 (e4m3) q, k, v with FlashAttention-3's per-(sequence, KV head) descales, quantized
// from a case's fp32 / fp64 inputs: descale[b, g] = amax / 448 over the elements of
// sequence b in KV head g (for q: the query heads of g's group; 1 when all are 0), byte =
// semantics::quantize_e4m3(x, descale). The case's q, k, v are overwritten with the
// dequantized values e4m3 * descale, so its problem() is the oracle's problem for the fp8
// call. Padding rows of a varlen pack are quantized with descale 1.
struct Fp8Inputs {
  HostTensor q, k, v;                          // float8_e4m3, the case's shapes
  HostTensor q_descale, k_descale, v_descale;  // fp32 [b, h_k]
  void apply(Options& o) const;                // sets opts.q_descale, k_descale, v_descale
};
Fp8Inputs quantize_fp8(DenseCase& c);
Fp8Inputs quantize_fp8(VarlenCase& c);

// ------------------------------------------------------------------ KV cache
struct KVCacheConfig {
  int batch = 1, s_q = 1, s_new = 0, h_q = 1, h_k = 1, d = 8;
  int d_v = 0;      // head dim of v_cache / v_new / out (0 = d)
  bool qv = false;  // MLA: a random qv [b, s_q, h_q, d_v] joins the score (q.k + qv.v)
  int dv() const { return d_v > 0 ? d_v : d; }
  DType dtype = DType::kFloat32;
  int max_cache_len = 64;       // cache_seqlens drawn from [0, max_cache_len]
  std::vector<int> cache_lens;  // explicit cache_seqlens (overrides the draw)
  // Paged when block_size > 0: blocks are assigned in shuffled order; with share_blocks
  // sequence 1 reuses the full prefix blocks of sequence 0 (prefix sharing); extra_blocks
  // spare blocks (NaN) are added and unused block-table entries point at one of them.
  int block_size = 0;
  bool share_blocks = false;
  int extra_blocks = 2;
  // Dense: cache rows; with use_batch_idx the sequences use a random permutation of them.
  int cache_rows = 0;  // 0 = batch
  int s_cache = 0;     // 0 = the smallest that fits
  bool use_batch_idx = false;
  // fp8 cache: k_cache / v_cache float8_e4m3 holding e4m3(x / scale) of N(0, 1) values
  // (k_new / v_new stay `dtype`), scales drawn from [scale_lo, scale_hi], [h_k] or, with
  // per_block_scales, [k_cache.shape[0], h_k] (NaN for blocks / rows no sequence uses).
  bool fp8 = false;
  bool per_block_scales = false;
  double scale_lo = 0.01, scale_hi = 0.03;
  // fp8 q (FlashAttention-3): q, k_cache, v_cache, k_new, v_new all float8_e4m3 and
  // dequantized by Options::q_descale / k_descale / v_descale fp32 [batch, h_k], one per
  // (sequence, KV head), drawn from [scale_lo, scale_hi] (whatever block or cache row
  // holds a key: a block shared by two sequences dequantizes by each one's descale); out
  // is `dtype` (bfloat16 / float16). q holds e4m3(x / q_descale) of N(0, 1) values, the
  // cache and k_new / v_new e4m3(x / descale) of the sequence writing them; the append is
  // a byte copy. Exclusive with `fp8`.
  bool fp8_q = false;
  // Draft tree over the s_q queries (the last s_q keys): kLinear lets draft i see drafts
  // <= i; kRandom draws a parent for each draft (-1 or an earlier one) and lets it see
  // itself and its ancestors. tree_row_pad extra int32 words per mask row (stride test).
  enum class Tree { kNone, kLinear, kRandom };
  Tree tree = Tree::kNone;
  int tree_row_pad = 0;
  // Left-padded dense cache: cache_leftpad[b] drawn from [0, cache_seqlens[b]] (or the
  // explicit `leftpads`); the padding rows before it stay NaN.
  bool leftpad = false;
  std::vector<int> leftpads;
};

struct KVCacheCase {
  KVCacheConfig cfg;
  std::vector<int> cache_lens;  // cache_seqlens
  std::vector<int> block_table; // [batch, max_blocks] (paged)
  int max_blocks = 0, num_blocks = 0;
  std::vector<int> batch_idx;   // cache_batch_idx (dense, when used)
  std::vector<int> leftpad;     // cache_leftpad (when cfg.leftpad)
  HostTensor leftpad_t;
  HostTensor q, k_cache, v_cache, k_new, v_new, out, lse;
  HostTensor qv;  // when cfg.qv
  HostTensor cache_lens_t, block_table_t, batch_idx_t;
  HostTensor k_cache_expected, v_cache_expected;  // after the in-place append
  HostTensor k_scale, v_scale;                    // fp32, when cfg.fp8
  HostTensor q_descale, k_descale, v_descale;     // fp32 [batch, h_k], when cfg.fp8_q
  HostTensor q_ref;                               // fp64 dequantized q, when cfg.fp8_q
  std::vector<std::uint32_t> tree_words;          // [batch][s_q][ceil(s_q / 32)] when cfg.tree
  std::vector<int> tree_parents;                  // [batch][s_q], -1 = root (kRandom)
  HostTensor tree_mask;                           // int32 [batch, s_q, words + tree_row_pad]
  std::vector<float> alibi;
  bool alibi_per_batch = false;
  HostTensor alibi_tensor;
  SinkInputs sink;
  Options opts;
  int num_splits = 1;

  static KVCacheCase make(Rng& rng, const KVCacheConfig& cfg);
  int s_k(int b) const { return cache_lens[b] + cfg.s_new; }  // cache rows in use (end)
  int first_key(int b) const { return leftpad.empty() ? 0 : leftpad[static_cast<std::size_t>(b)]; }
  // Physical row of key j of sequence b: (block or cache row, row within it).
  std::pair<int, int> locate(int b, int j) const;
  int tree_words_per_row() const { return (cfg.s_q + 31) / 32; }
  // The dequantization scales of (cache slot, KV head) (fp8 only).
  float k_scale_of(int slot, int g) const;
  float v_scale_of(int slot, int g) const;
  void set_alibi(std::vector<float> slopes, bool per_batch);
  Options call_options() const;
  KVCacheArgs args() const;

  RefProblem problem() const;  // keys gathered from the expected (appended) cache
  void poison_outputs();
  void run();
};

}  // namespace flashattn::test
