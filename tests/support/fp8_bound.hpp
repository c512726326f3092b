// The error bound of an fp8 (e4m3) forward that rounds the probabilities to e4m3 before the
// P V product, as FlashAttention-3's sm90 fp8 kernel (and this library's) does, derived from
// the data of each call: a bound that a correct kernel meets and a wrong one can fail, not a
// loosened tolerance.
//
// The kernel (the contract with src/cuda): for each row it keeps a running reference max
// m_ref, never above the row's largest visible score and at most 8 below it in log2 units
// (so each unnormalized probability p'_j = exp(s_j - m_ref) lies in [0, 256]); it rounds
// p'_j to e4m3 with round-to-nearest for the P V product, sums the fp32 p'_j (unrounded) for
// the row's denominator l', and rounds out = sum_j e4m3(p'_j) v_j / l' once to bf16 / fp16.
// e4m3 keeps 3 mantissa bits and has subnormals of spacing 2^-9, so
//   |e4m3(x) - x| <= 2^-4 x + 2^-10   for x in [0, 448],
// and with p_j = exp(s_j - M) (M the row max over the visible scores and the sink), l =
// sum_j p_j (+ the sink's term), both from the fp64 oracle over the DEQUANTIZED inputs, and
// v_j the dequantized values (p'_j / l' = p_j / l and 1/l' <= 1/l since m_ref <= M):
//   |out - ref| <= sum_j (2^-4 p_j + 2^-10) |v_j| / l            (P rounded to e4m3)
//                = 2^-4 sum_j P_j |v_j| + 2^-10 max(P) sum_{j visible} |v_j|
// (P_j = p_j / l the oracle's probabilities; 1/l = max(P) over the keys and the sink), plus
// the rounding of out to its dtype, u |out| (u = 2^-8 bf16, 2^-11 fp16), plus the arithmetic
// terms below.
//
// The arithmetic terms ("the fp32 term for the scores", and its P V counterpart). The
// products of e4m3 values are exact; their sums run on the fp8 tensor cores, whose
// accumulation Hopper does with about 14 significant bits at each k-step of 32 products
// (DeepSeek-V3 report, section 3.3.2: "limited to retaining around 14 bits"), not the 24 of
// fp32. We take kFp8MmaAccumEps = 2^-13 of the sum of |products| per k-step. For the score
// s_j = scale q . k_j (then softcap, whose derivative is <= 1, and ALiBi, added in fp32):
// |s'_j - s_j| <= delta_j with
//   delta_j = (eps_qk + 2^-20) scale sum_c |q_c k_jc| + 2^-20 (|s_j| + |M|),
//   eps_qk = (ceil(d / 32) + 1) 2^-13
// (one step of margin for the fp32 scaling by the descales and the softmax scale; the
// 2^-20 terms cover a few fp32 roundings of the score, the bias, the max subtraction and
// exp2, ~2^-22 each). Scores off by at most delta = max_j delta_j move every p_j / l by a
// factor within e^(+-2 delta), so the out terms above grow by e^(2 delta) and the
// fp32-exact result moves by at most (e^(2 delta) - 1) sum_j P_j |v_j|. The P V sum over
// the n visible keys adds (ceil(n / 32) + 8) 2^-13 of its sum of |terms| (8 steps of
// margin: the partial key tiles at a mask's edges, whose masked keys still take
// accumulation steps), and the fp32 row sum and division (n + 8) 2^-24 of it. lse =
// m_ref + log(l') is off by at most
//   delta + (n + 8) 2^-24 + 2^-21 (|lse| + |M| + 1)
// (the row sum in fp32, the log2 / ln 2 conversions). With plain fp32 accumulation the
// arithmetic terms would be ~2^-16 of the main one; with 14-bit accumulation, for N(0, 1)
// inputs at the default scale, the score term is about 0.15 (d = 128) to 0.4 (d = 256) of
// it and the P V term about 0.07 at a thousand keys.
//
// Rows that see no key (ref lse -inf) must give out exactly 0 and lse -inf; a row that sees
// only a sink gives out 0 (bound 0) and lse = the sink. Dropout must be off (the fp8 kernel
// has none).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "flashattn/tensor.hpp"
#include "reference/reference.hpp"
#include "support/cases.hpp"
#include "support/random.hpp"

namespace flashattn::test {

inline constexpr double kFp8MmaAccumEps = 1.0 / 8192.0;  // 2^-13 per k-step of 32 products
inline constexpr int kFp8MmaK = 32;
inline constexpr int kFp8MmaQKExtraSteps = 1;  // margin steps of Q K^T (over d)
inline constexpr int kFp8MmaPVExtraSteps = 8;  // margin steps of P V (over the keys)

struct Fp8PBound {
  std::vector<double> out;  // per element, concat_out order
  std::vector<double> lse;  // per row, concat_lse order (0 where the oracle's lse is -inf)
};

// The bound above for each output element and lse of problem p (its q, k, v the dequantized
// values), from the fp64 oracle's outputs `ref` (reference_forward(p): probs, out, out_mag
// and lse), for an out of dtype out_dtype (bfloat16 or float16).
Fp8PBound fp8_p_quantized_bound(const RefProblem& p, const std::vector<RefOutput>& ref,
                                DType out_dtype);

// got against ref element by element: |got - ref| <= bound, non-finite ref values matched
// exactly, no NaN in got. The failure message gives the worst element (index, got, ref,
// bound), the number over the bound and the measured fraction max |got - ref| / bound;
// *max_fraction (when given) receives that fraction also on success.
::testing::AssertionResult within_fp8_bound(const std::string& what, const std::vector<double>& got,
                                            const std::vector<double>& ref,
                                            const std::vector<double>& bound,
                                            double* max_fraction = nullptr);

// fp8 inputs of a case with random descales per (sequence, KV head): before quantize_fp8
// (cases.hpp: descale amax / 448, the case's q, k, v overwritten with the dequantized
// values) each (sequence, KV head) of q, k and v is scaled by its own random factor (q, k
// 2^U(-1, 1), v 2^U(-2, 2); q's by the KV head of its group), so a descale read for the
// wrong sequence or head shows. `omit` 'q', 'k' or 'v' re-quantizes that tensor with descale
// 1 and leaves its descale undefined (Fp8Inputs::apply then leaves the option unset: 1);
// 0 omits none.
Fp8Inputs quantize_fp8_random_descales(DenseCase& c, Rng& rng, char omit = 0);
Fp8Inputs quantize_fp8_random_descales(VarlenCase& c, Rng& rng, char omit = 0);

}  // namespace flashattn::test
