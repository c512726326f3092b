// The test oracle: naive attention that materialises S and P for every
// (sequence, query head), in fp64, plus a "naive in the same precision" variant that
// sets the error budget of the tolerance rule (support/compare.hpp).
//
// A RefProblem is a list of independent sequences (a dense batch, the sequences of a
// varlen pack, or the gathered keys of a KV cache); sequence b carries its own q, k, v
// and, for the backward, dout. The visibility rule, the score order and the dropout
// keep decision come from flashattn/semantics.hpp, so the oracle drops exactly the
// elements the backends drop.
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/semantics.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::test {

struct RefSeq {
  int s_q = 0, s_k = 0;
  std::vector<double> q;     // [s_q, h_q, d]
  std::vector<double> k;     // [s_k, h_k, d]; an fp8 cache gives its dequantized values
  std::vector<double> v;     // [s_k, h_k, d_v]
  std::vector<double> dout;  // [s_q, h_q, d_v]; backward only
  // MLA (FlashAttention-3's qv) [s_q, h_q, d_v], or empty: the raw score of (i, j) is then
  // q_i . k_j + qv_i . v_j. Forward only.
  std::vector<double> qv;
  // Draft-tree mask [s_q][ceil(s_q / 32)] words (semantics::tree_key_visible), or empty.
  std::vector<std::uint32_t> tree;
  // Element visibility [h_q][s_q][s_k] (1 = visible) that replaces the plain mask (the
  // block-sparse tests derive it from the block lists), or empty.
  std::vector<std::uint8_t> element_mask;
};

// The oracle's own e4m3 decode (the OCP definition, independent of semantics.hpp):
// (-1)^s 2^(e-7) (1 + m/8), subnormals 2^-6 m/8, NaN for S.1111.111.
double e4m3_reference(std::uint8_t byte);
// The value of an fp8 cache element: e4m3 * scale, exact in fp64.
inline double dequantize_e4m3(std::uint8_t byte, float scale) {
  return e4m3_reference(byte) * static_cast<double>(scale);
}
// Whether query i of `s` sees key j under its tree mask (true without one).
bool tree_allows(const RefSeq& s, std::int64_t i, std::int64_t j);

struct RefProblem {
  int h_q = 1, h_k = 1, d = 1;
  int d_v = 0;  // head dim of v, out, dout (0 = d)
  int dv() const { return d_v > 0 ? d_v : d; }
  double scale = 1.0;
  double softcap = 0.0;
  semantics::Mask mask;
  std::vector<double> alibi;  // empty (off), [h_q] or [batch * h_q]
  bool alibi_per_batch = false;
  double dropout_p = 0.0;
  // Exactly as the backends build it from Options (seed, offset, threshold).
  semantics::DropoutRng rng;
  std::vector<RefSeq> seqs;
  // Learnable sink logits [h_q] (one extra term in each row's softmax denominator,
  // contributing no value), or empty.
  std::vector<double> sink;

  double slope(int b, int h) const;
  double sink_logit(int h) const;  // -inf without a sink
  bool keep(int b, int h, std::int64_t i, std::int64_t j) const;
  // The scale a call with these options uses (unset -> 1/sqrt(d), as a float).
  static double resolve_scale(std::optional<float> softmax_scale, int d);
  // Copies scale, softcap, mask and dropout from Options; alibi slopes come from the
  // host copy `alibi` ([h_q] when per_batch is false, else [batch * h_q]).
  void set_options(const Options& opts, const std::vector<float>& alibi_host, bool per_batch);
};

struct RefOutput {
  std::vector<double> out;    // [s_q, h_q, d_v]
  std::vector<double> lse;    // [h_q, s_q]; -inf for rows that see no key
  std::vector<double> probs;  // [h_q, s_q, s_k]: P * keep (no 1/(1-p)); 0 where masked
  // Oracle only: sum_j P_ij Z_ij |v_j|, the magnitude of the terms each output sums
  // (the rounding floor of the tolerance rule, as RefGrads::dq_mag for the backward).
  std::vector<double> out_mag;  // [s_q, h_q, d_v]
};

struct RefGrads {
  std::vector<double> dq;  // [s_q, h_q, d]
  std::vector<double> dk;  // [s_k, h_k, d], summed over the query heads of a group
  std::vector<double> dv;  // [s_k, h_k, d_v]
  // Oracle only: the same sums taken over the absolute values of their terms
  // (|dS| bounded by P (|dP| + |D|), each of dP and D itself a sum of |terms|). Rounding in any order of summation is a few ulp of
  // these, which sets the rounding floor of the tolerance rule where cancellation makes
  // the gradient itself tiny (e.g. a row that sees one key has dS = 0 exactly).
  std::vector<double> dq_mag, dk_mag, dv_mag;
  // With a sink: this sequence's share of d loss / d sink [h_q], -sum_i P_sink_i D_i
  // (concat_dsink sums the sequences), and (oracle) its sum of |terms|.
  std::vector<double> dsink, dsink_mag;
};

// fp64 oracle.
std::vector<RefOutput> reference_forward(const RefProblem& p);
// Explicit P, dP, dS formulas (with dropout, softcap, ALiBi), fp64, using the exact lse.
std::vector<RefGrads> reference_backward(const RefProblem& p);

// Naive attention in the precision of `dtype`: inputs are taken as they are (already
// rounded to dtype), S = QK^T accumulated in fp32 and rounded to dtype, softmax in
// fp32 with P rounded to dtype, PV accumulated in fp32, the output rounded to dtype,
// lse in fp32. fp32 runs entirely in fp32; fp64 in fp64 (lse still rounded to fp32,
// as the API stores it). The dropout rescale uses the fp32 1/(1-p) of the parameters.
std::vector<RefOutput> naive_forward(const RefProblem& p, DType dtype);
// The naive backward in the same precision, given the forward outputs being
// differentiated (out in dtype, lse in fp32 — the values a backend's backward reads):
// P = exp(S - lse) in fp32, P*keep and dS rounded to dtype for the matmuls that use
// them, fp32 accumulation, gradients rounded to dtype.
std::vector<RefGrads> naive_backward(const RefProblem& p, DType dtype,
                                     const std::vector<RefOutput>& forward);

// Concatenations over sequences, in the order a dense or packed tensor stores them
// (out/q/dq [rows, h_q, d], k-side [rows, h_k, d]; lse and probs per sequence).
std::vector<double> concat_out(const std::vector<RefOutput>& r);
std::vector<double> concat_lse(const std::vector<RefOutput>& r);    // dense [b, h_q, s_q]
std::vector<double> concat_probs(const std::vector<RefOutput>& r);  // dense [b, h_q, s_q, s_k]
std::vector<double> concat_dq(const std::vector<RefGrads>& g);
std::vector<double> concat_dk(const std::vector<RefGrads>& g);
std::vector<double> concat_dv(const std::vector<RefGrads>& g);
// d loss / d sink [h_q]: the sequences' shares summed (empty without a sink).
std::vector<double> concat_dsink(const std::vector<RefGrads>& g);

}  // namespace flashattn::test
