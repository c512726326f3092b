#include "support/fp8_bound.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include "flashattn/semantics.hpp"

namespace flashattn::test {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// The accumulation error of a dot product of n terms, relative to its sum of |terms|:
// kFp8MmaAccumEps per k-step of kFp8MmaK products, `extra` steps of margin.
double mma_eps(std::int64_t n, int extra) {
  return double((n + kFp8MmaK - 1) / kFp8MmaK + extra) * kFp8MmaAccumEps;
}

}  // namespace

Fp8PBound fp8_p_quantized_bound(const RefProblem& p, const std::vector<RefOutput>& ref,
                                DType out_dtype) {
  if (p.dropout_p != 0.0) throw std::invalid_argument("fp8_p_quantized_bound: dropout is not in the bound");
  if (ref.size() != p.seqs.size()) throw std::invalid_argument("fp8_p_quantized_bound: ref of another problem");
  if (out_dtype != DType::kBFloat16 && out_dtype != DType::kFloat16) {
    throw std::invalid_argument("fp8_p_quantized_bound: out is bfloat16 or float16");
  }
  const bool bf16 = out_dtype == DType::kBFloat16;
  const double u_out = bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  // Half the smallest subnormal of out's dtype: an output below it rounds to 0.
  const double out_floor = bf16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
  const double f32 = std::ldexp(1.0, -24), few_f32 = std::ldexp(1.0, -20);
  const int d = p.d, dv = p.dv(), ratio = p.h_q / p.h_k;
  const double eps_qk = mma_eps(d, kFp8MmaQKExtraSteps);
  const double inf = std::numeric_limits<double>::infinity();

  Fp8PBound bound;
  std::vector<double> abs_v;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const RefSeq& s = p.seqs[b];
    const RefOutput& r = ref[b];
    if (r.out_mag.size() != r.out.size() || r.probs.size() != sz(std::int64_t(p.h_q) * s.s_q * s.s_k)) {
      throw std::invalid_argument("fp8_p_quantized_bound: ref must be reference_forward's (probs, out_mag)");
    }
    const std::size_t out_base = bound.out.size();
    bound.out.resize(out_base + r.out.size(), 0.0);
    for (int h = 0; h < p.h_q; ++h) {
      const int g = h / ratio;
      const double sink = p.sink_logit(h);
      for (std::int64_t i = 0; i < s.s_q; ++i) {
        const double lse = r.lse[sz(h * std::int64_t(s.s_q) + i)];
        if (!std::isfinite(lse)) {  // no visible key: exact 0 and -inf
          bound.lse.push_back(0.0);
          continue;
        }
        const double* P = &r.probs[sz((h * std::int64_t(s.s_q) + i) * s.s_k)];
        const double* qi = &s.q[sz((i * p.h_q + h) * d)];
        double p_max = sink == -inf ? 0.0 : std::exp(sink - lse);
        std::int64_t visible = 0;
        for (std::int64_t j = 0; j < s.s_k; ++j) {
          if (P[j] > 0) {
            p_max = std::max(p_max, P[j]);
            ++visible;
          }
        }
        const double row_max = lse + std::log(p_max);  // M: max over the visible scores and the sink
        double delta = 0;
        abs_v.assign(sz(dv), 0.0);
        for (std::int64_t j = 0; j < s.s_k; ++j) {
          if (!(P[j] > 0)) continue;
          const double score = lse + std::log(P[j]);
          const double* kj = &s.k[sz((j * p.h_k + g) * d)];
          double terms = 0;  // sum_c |q_c k_jc|
          for (int c = 0; c < d; ++c) terms += std::fabs(qi[c] * kj[c]);
          const double dj = (eps_qk + few_f32) * p.scale * terms +
                            few_f32 * (std::fabs(score) + std::fabs(row_max));
          delta = std::max(delta, dj);
          const double* vj = &s.v[sz((j * p.h_k + g) * dv)];
          for (int c = 0; c < dv; ++c) abs_v[sz(c)] += std::fabs(vj[c]);
        }
        const double grow = std::exp(2 * delta), moved = std::expm1(2 * delta);
        const double sums = mma_eps(visible, kFp8MmaPVExtraSteps) + double(visible + 8) * f32;
        for (int c = 0; c < dv; ++c) {
          const std::size_t at = sz((i * p.h_q + h) * dv + c);
          const double mag = r.out_mag[at];                        // sum_j P_j |v_j|
          const double quant = std::ldexp(mag, -4) + std::ldexp(p_max * abs_v[sz(c)], -10);
          const double pre = grow * quant + moved * mag + sums * grow * (mag + quant);
          bound.out[out_base + at] = pre + u_out * (std::fabs(r.out[at]) + pre) + out_floor;
        }
        bound.lse.push_back(delta + double(visible + 8) * f32 +
                            std::ldexp(std::fabs(lse) + std::fabs(row_max) + 1.0, -21));
      }
    }
  }
  // concat_lse is per sequence [h_q, s_q]: the order of the loops above.
  return bound;
}

::testing::AssertionResult within_fp8_bound(const std::string& what, const std::vector<double>& got,
                                            const std::vector<double>& ref,
                                            const std::vector<double>& bound, double* max_fraction) {
  if (got.size() != ref.size() || bound.size() != ref.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, " << ref.size()
                                         << " references, " << bound.size() << " bounds";
  }
  double worst = 0;
  std::size_t worst_at = 0, over = 0, nan = 0, nonfinite = 0, first_bad = ref.size();
  for (std::size_t x = 0; x < ref.size(); ++x) {
    if (std::isnan(got[x])) {
      ++nan;
      if (first_bad == ref.size()) first_bad = x;
      continue;
    }
    if (!std::isfinite(ref[x]) || !std::isfinite(got[x])) {
      if (got[x] != ref[x]) {
        ++nonfinite;
        if (first_bad == ref.size()) first_bad = x;
      }
      continue;
    }
    const double err = std::fabs(got[x] - ref[x]);
    const double frac = err == 0 ? 0.0 : bound[x] > 0 ? err / bound[x] : std::numeric_limits<double>::infinity();
    if (frac > 1) ++over;
    if (frac > worst) {
      worst = frac;
      worst_at = x;
    }
  }
  if (max_fraction) *max_fraction = worst;
  char line[512];
  std::snprintf(line, sizeof line,
                "%s: max |got - ref| / bound = %.4g at element %zu (got %.9g, ref %.9g, bound %.4g); "
                "%zu of %zu elements over the bound, %zu NaN, %zu non-finite mismatches",
                what.c_str(), worst, worst_at, ref.empty() ? 0.0 : got[worst_at],
                ref.empty() ? 0.0 : ref[worst_at], ref.empty() ? 0.0 : bound[worst_at], over, ref.size(),
                nan, nonfinite);
  if (over == 0 && nan == 0 && nonfinite == 0) return ::testing::AssertionSuccess() << line;
  ::testing::AssertionResult failure = ::testing::AssertionFailure() << line;
  if (first_bad < ref.size()) {
    failure << "; first NaN / non-finite mismatch at element " << first_bad << ": got " << got[first_bad]
            << ", ref " << ref[first_bad];
  }
  return failure;
}

namespace {

// x [rows, h, d] (rows flattened); row r belongs to sequence seq_of_row[r] (-1: padding).
void scale_groups(HostTensor& x, const std::vector<int>& seq_of_row, int h, int ratio,
                  const std::vector<double>& factor, int h_k) {
  const std::int64_t rows = static_cast<std::int64_t>(seq_of_row.size());
  const std::int64_t d = x.numel() / (rows * h);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (seq_of_row[sz(r)] < 0) continue;
    for (int hh = 0; hh < h; ++hh) {
      const double f = factor[sz(std::int64_t(seq_of_row[sz(r)]) * h_k + hh / ratio)];
      for (std::int64_t c = 0; c < d; ++c) {
        const std::int64_t at = (r * h + hh) * d + c;
        x.set(at, x.get(at) * f);
      }
    }
  }
}

std::vector<double> random_factors(Rng& rng, int batch, int h_k, double log2_span) {
  std::vector<double> f(sz(std::int64_t(batch) * h_k));
  for (double& x : f) x = std::exp2(uniform_real(rng, -log2_span, log2_span));
  return f;
}

// The bytes of x under descale 1; x becomes their values.
void requantize_unit(HostTensor& x, HostTensor& bytes, HostTensor& descale) {
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    bytes.as<std::uint8_t>()[i] = semantics::quantize_e4m3(static_cast<float>(x.get(i)), 1.0f);
    x.set(i, dequantize_e4m3(bytes.as<std::uint8_t>()[i], 1.0f));
  }
  descale = HostTensor();
}

template <class Case>
Fp8Inputs quantize_random(Case& c, Rng& rng, char omit, const std::vector<int>& rows_q,
                          const std::vector<int>& rows_k, int batch, int h_q, int h_k) {
  scale_groups(c.q, rows_q, h_q, h_q / h_k, random_factors(rng, batch, h_k, 1.0), h_k);
  scale_groups(c.k, rows_k, h_k, 1, random_factors(rng, batch, h_k, 1.0), h_k);
  scale_groups(c.v, rows_k, h_k, 1, random_factors(rng, batch, h_k, 2.0), h_k);
  Fp8Inputs f = quantize_fp8(c);
  if (omit == 'q') requantize_unit(c.q, f.q, f.q_descale);
  if (omit == 'k') requantize_unit(c.k, f.k, f.k_descale);
  if (omit == 'v') requantize_unit(c.v, f.v, f.v_descale);
  return f;
}

}  // namespace

Fp8Inputs quantize_fp8_random_descales(DenseCase& c, Rng& rng, char omit) {
  const Shape& s = c.shape;
  std::vector<int> rows_q, rows_k;
  for (int b = 0; b < s.batch; ++b) {
    rows_q.insert(rows_q.end(), sz(s.s_q), b);
    rows_k.insert(rows_k.end(), sz(s.s_k), b);
  }
  return quantize_random(c, rng, omit, rows_q, rows_k, s.batch, s.h_q, s.h_k);
}

Fp8Inputs quantize_fp8_random_descales(VarlenCase& c, Rng& rng, char omit) {
  std::vector<int> rows_q(sz(c.total_q), -1), rows_k(sz(c.total_k), -1);
  for (int b = 0; b < c.batch(); ++b) {
    for (int i = c.cu_q[sz(b)]; i < c.cu_q[sz(b + 1)]; ++i) rows_q[sz(i)] = b;
    for (int j = c.cu_k[sz(b)]; j < c.cu_k[sz(b + 1)]; ++j) rows_k[sz(j)] = b;
  }
  return quantize_random(c, rng, omit, rows_q, rows_k, c.batch(), c.h_q, c.h_k);
}

}  // namespace flashattn::test
