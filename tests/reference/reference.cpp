#include "reference/reference.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>

#include "support/host_tensor.hpp"

namespace flashattn::test {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Rounds to the storage dtype in the naive variant; the identity in the exact oracle.
struct Rounder {
  bool exact;
  DType dtype;
  template <typename Acc>
  Acc operator()(Acc x) const {
    return exact ? x : static_cast<Acc>(round_to(dtype, static_cast<double>(x)));
  }
};

// The rescale of kept probabilities: exact 1/(1-p), or the fp32 value the parameters carry.
double keep_scale(const RefProblem& p, bool exact) {
  if (!(p.dropout_p > 0.0)) return 1.0;
  return exact ? 1.0 / (1.0 - p.dropout_p) : static_cast<float>(1.0 / (1.0 - p.dropout_p));
}

// The raw dot products q_i . k_j (accumulated in Acc) for one (sequence, head, row);
// the score of a visible key, -inf for an invisible one.
template <typename Acc>
void row_scores(const RefProblem& p, int b, int h, std::int64_t i, bool round_dot, const Rounder& R,
                std::vector<Acc>& dot, std::vector<Acc>& score) {
  const RefSeq& s = p.seqs[sz(b)];
  const int g = h / (p.h_q / p.h_k);
  const Acc scale = static_cast<Acc>(p.scale), cap = static_cast<Acc>(p.softcap);
  const Acc slope = static_cast<Acc>(p.slope(b, h));
  dot.assign(sz(s.s_k), Acc(0));
  score.assign(sz(s.s_k), static_cast<Acc>(kNegInf));
  const double* qi = &s.q[sz((i * p.h_q + h) * p.d)];
  const int dv = p.dv();
  const double* qvi = s.qv.empty() ? nullptr : &s.qv[sz((i * p.h_q + h) * dv)];
  for (std::int64_t j = 0; j < s.s_k; ++j) {
    if (!s.element_mask.empty()) {
      if (s.element_mask.size() != sz(std::int64_t(p.h_q) * s.s_q * s.s_k))
        throw std::invalid_argument("reference: element mask size");
      if (!s.element_mask[sz((std::int64_t(h) * s.s_q + i) * s.s_k + j)]) continue;
    } else if (!semantics::key_visible(i, j, s.s_q, s.s_k, p.mask)) {
      continue;
    }
    if (!tree_allows(s, i, j)) continue;
    const double* kj = &s.k[sz((j * p.h_k + g) * p.d)];
    Acc acc = 0;
    for (int c = 0; c < p.d; ++c) acc += static_cast<Acc>(qi[c]) * static_cast<Acc>(kj[c]);
    if (qvi) {  // MLA: one dot product over [q | qv] . [k | v]
      const double* vj = &s.v[sz((j * p.h_k + g) * dv)];
      for (int c = 0; c < dv; ++c) acc += static_cast<Acc>(qvi[c]) * static_cast<Acc>(vj[c]);
    }
    if (round_dot) acc = R(acc);
    dot[sz(j)] = acc;
    score[sz(j)] = semantics::score<Acc>(acc, scale, cap, slope, i, j, s.s_q, s.s_k);
  }
}

}  // namespace

double e4m3_reference(std::uint8_t byte) {
  const int e = (byte >> 3) & 15, m = byte & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (byte & 0x80) ? -mag : mag;
}

bool tree_allows(const RefSeq& s, std::int64_t i, std::int64_t j) {
  if (s.tree.empty()) return true;
  const std::int64_t words = (s.s_q + 31) / 32;
  if (s.tree.size() != sz(s.s_q * words)) throw std::invalid_argument("reference: tree mask size");
  const std::int64_t t = j - (s.s_k - s.s_q);  // draft index
  if (t < 0) return true;
  return ((s.tree[sz(i * words + t / 32)] >> (t % 32)) & 1u) != 0;
}

namespace {

template <typename Acc>
std::vector<RefOutput> forward_impl(const RefProblem& p, DType dtype, bool exact) {
  const Rounder R{exact, dtype};
  const Acc rp = static_cast<Acc>(keep_scale(p, exact));
  std::vector<RefOutput> result(p.seqs.size());
  std::vector<Acc> dot, score, prob;
  for (int b = 0; b < static_cast<int>(p.seqs.size()); ++b) {
    const RefSeq& s = p.seqs[sz(b)];
    RefOutput& r = result[sz(b)];
    const int dv = p.dv();
    r.out.assign(sz(std::int64_t(s.s_q) * p.h_q * dv), 0.0);
    r.lse.assign(sz(std::int64_t(p.h_q) * s.s_q), kNegInf);
    r.probs.assign(sz(std::int64_t(p.h_q) * s.s_q * s.s_k), 0.0);
    if (exact) r.out_mag.assign(r.out.size(), 0.0);
    for (int h = 0; h < p.h_q; ++h) {
      const int g = h / (p.h_q / p.h_k);
      for (std::int64_t i = 0; i < s.s_q; ++i) {
        row_scores<Acc>(p, b, h, i, /*round_dot=*/!exact, R, dot, score);
        // The sink is one more term of the max and the denominator, with no value.
        const Acc sink = static_cast<Acc>(p.sink_logit(h));
        Acc m = sink;
        for (Acc x : score) m = x > m ? x : m;
        if (m == static_cast<Acc>(kNegInf)) continue;  // no visible key: out 0, lse -inf
        Acc sum = sink == static_cast<Acc>(kNegInf) ? Acc(0) : std::exp(sink - m);
        for (Acc x : score) sum += x == static_cast<Acc>(kNegInf) ? Acc(0) : std::exp(x - m);
        const Acc lse = m + std::log(sum);
        r.lse[sz(h * std::int64_t(s.s_q) + i)] = exact ? double(lse) : double(static_cast<float>(lse));
        prob.assign(sz(s.s_k), Acc(0));
        for (std::int64_t j = 0; j < s.s_k; ++j) {
          if (score[sz(j)] == static_cast<Acc>(kNegInf)) continue;
          const Acc pij = exact ? std::exp(score[sz(j)] - lse) : std::exp(score[sz(j)] - m) / sum;
          const Acc kept = p.keep(b, h, i, j) ? pij : Acc(0);
          r.probs[sz((h * std::int64_t(s.s_q) + i) * s.s_k + j)] = double(kept);
          prob[sz(j)] = R(kept);
        }
        double* o = &r.out[sz((i * p.h_q + h) * dv)];
        for (int c = 0; c < dv; ++c) {
          Acc acc = 0;
          double mag = 0;
          for (std::int64_t j = 0; j < s.s_k; ++j) {
            if (prob[sz(j)] == Acc(0)) continue;
            const double vj = s.v[sz((j * p.h_k + g) * dv + c)];
            acc += prob[sz(j)] * static_cast<Acc>(vj);
            mag += double(prob[sz(j)]) * std::fabs(vj);
          }
          o[c] = double(R(static_cast<Acc>(acc * rp)));
          if (exact) r.out_mag[sz((i * p.h_q + h) * dv + c)] = mag * double(rp);
        }
      }
    }
  }
  return result;
}

template <typename Acc>
std::vector<RefGrads> backward_impl(const RefProblem& p, DType dtype, bool exact,
                                    const std::vector<RefOutput>* forward) {
  const Rounder R{exact, dtype};
  const Acc rp = static_cast<Acc>(keep_scale(p, exact));
  const Acc scale = static_cast<Acc>(p.scale), cap = static_cast<Acc>(p.softcap);
  std::vector<RefGrads> result(p.seqs.size());
  std::vector<Acc> dot, score, prob, dp;
  std::vector<double> dp_abs;  // oracle only: sum of |terms| of each dP
  for (int b = 0; b < static_cast<int>(p.seqs.size()); ++b) {
    const RefSeq& s = p.seqs[sz(b)];
    const int dv_dim = p.dv();
    if (!s.qv.empty()) throw std::invalid_argument("reference backward: qv has no backward");
    if (s.dout.size() != sz(std::int64_t(s.s_q) * p.h_q * dv_dim))
      throw std::invalid_argument("reference backward: dout missing");
    RefGrads& gr = result[sz(b)];
    std::vector<Acc> dq(s.q.size(), Acc(0)), dk(s.k.size(), Acc(0)), dv(s.v.size(), Acc(0));
    std::vector<double> dq_mag(exact ? s.q.size() : 0, 0.0), dk_mag(exact ? s.k.size() : 0, 0.0),
        dv_mag(exact ? s.v.size() : 0, 0.0);
    std::vector<Acc> dsink(p.sink.empty() ? 0 : sz(p.h_q), Acc(0));
    std::vector<double> dsink_mag(exact ? dsink.size() : 0, 0.0);
    for (int h = 0; h < p.h_q; ++h) {
      const int g = h / (p.h_q / p.h_k);
      for (std::int64_t i = 0; i < s.s_q; ++i) {
        row_scores<Acc>(p, b, h, i, /*round_dot=*/false, R, dot, score);
        const Acc sink = static_cast<Acc>(p.sink_logit(h));
        Acc lse;
        if (exact) {
          Acc m = sink;
          for (Acc x : score) m = x > m ? x : m;
          if (m == static_cast<Acc>(kNegInf)) continue;
          Acc sum = sink == static_cast<Acc>(kNegInf) ? Acc(0) : std::exp(sink - m);
          for (Acc x : score) sum += x == static_cast<Acc>(kNegInf) ? Acc(0) : std::exp(x - m);
          lse = m + std::log(sum);
        } else {
          lse = static_cast<Acc>((*forward)[sz(b)].lse[sz(h * std::int64_t(s.s_q) + i)]);
          if (lse == static_cast<Acc>(kNegInf)) continue;
        }
        const double* doi = &s.dout[sz((i * p.h_q + h) * dv_dim)];
        prob.assign(sz(s.s_k), Acc(0));
        dp.assign(sz(s.s_k), Acc(0));
        dp_abs.assign(sz(s.s_k), 0.0);
        for (std::int64_t j = 0; j < s.s_k; ++j) {
          if (score[sz(j)] == static_cast<Acc>(kNegInf)) continue;
          prob[sz(j)] = std::exp(score[sz(j)] - lse);
          if (!p.keep(b, h, i, j)) continue;
          const Acc pk = exact ? prob[sz(j)] * rp : R(prob[sz(j)]);  // naive: rp applied below
          Acc dpj = 0;
          double dpj_abs = 0;
          for (int c = 0; c < dv_dim; ++c) {
            const std::size_t kv = sz((j * p.h_k + g) * dv_dim + c);
            dv[kv] += pk * static_cast<Acc>(doi[c]);
            dpj += static_cast<Acc>(doi[c]) * static_cast<Acc>(s.v[kv]);
            if (exact) {
              dv_mag[kv] += std::fabs(double(pk) * doi[c]);
              dpj_abs += std::fabs(doi[c] * s.v[kv]);
            }
          }
          dp[sz(j)] = dpj * rp;
          if (exact) dp_abs[sz(j)] = dpj_abs * double(rp);
        }
        // D_i = sum_j P_ij dP_ij; the naive variant uses rowsum(dO * O) as a backend does.
        Acc delta = 0;
        double delta_abs = 0;
        if (exact) {
          for (std::int64_t j = 0; j < s.s_k; ++j) {
            delta += prob[sz(j)] * dp[sz(j)];
            delta_abs += double(prob[sz(j)]) * dp_abs[sz(j)];
          }
        } else {
          const double* oi = &(*forward)[sz(b)].out[sz((i * p.h_q + h) * dv_dim)];
          for (int c = 0; c < dv_dim; ++c) delta += static_cast<Acc>(doi[c]) * static_cast<Acc>(oi[c]);
        }
        // The sink's score gets dS = P_sink * (dP_sink - D) with dP_sink = 0 (no value).
        if (!p.sink.empty() && sink != static_cast<Acc>(kNegInf)) {
          const Acc p_sink = std::exp(sink - lse);
          dsink[sz(h)] -= p_sink * delta;
          if (exact) dsink_mag[sz(h)] += double(p_sink) * delta_abs;
        }
        const double* qi = &s.q[sz((i * p.h_q + h) * p.d)];
        Acc* dqi = &dq[sz((i * p.h_q + h) * p.d)];
        for (std::int64_t j = 0; j < s.s_k; ++j) {
          if (score[sz(j)] == static_cast<Acc>(kNegInf)) continue;
          // d score / d dot: scale, times 1 - tanh^2 under the softcap.
          Acc dscore = scale;
          if (cap > Acc(0)) {
            const Acc t = std::tanh(dot[sz(j)] * scale / cap);
            dscore = scale * (Acc(1) - t * t);
          }
          const Acc ds = R(static_cast<Acc>(prob[sz(j)] * (dp[sz(j)] - delta) * dscore));
          if (exact) {
            const double ds_mag = double(prob[sz(j)]) * (dp_abs[sz(j)] + delta_abs) * std::fabs(double(dscore));
            for (int c = 0; c < p.d; ++c) {
              const std::size_t kv = sz((j * p.h_k + g) * p.d + c);
              dq_mag[sz((i * p.h_q + h) * p.d + c)] += ds_mag * std::fabs(s.k[kv]);
              dk_mag[kv] += ds_mag * std::fabs(qi[c]);
            }
          }
          if (ds == Acc(0)) continue;
          for (int c = 0; c < p.d; ++c) {
            const std::size_t kv = sz((j * p.h_k + g) * p.d + c);
            dqi[c] += ds * static_cast<Acc>(s.k[kv]);
            dk[kv] += ds * static_cast<Acc>(qi[c]);
          }
        }
      }
    }
    auto finish = [&](const std::vector<Acc>& acc, Acc factor) {
      std::vector<double> out(acc.size());
      for (std::size_t e = 0; e < acc.size(); ++e) out[e] = double(R(static_cast<Acc>(acc[e] * factor)));
      return out;
    };
    gr.dq = finish(dq, Acc(1));
    gr.dk = finish(dk, Acc(1));
    gr.dv = finish(dv, exact ? Acc(1) : rp);
    gr.dq_mag = std::move(dq_mag);
    gr.dk_mag = std::move(dk_mag);
    gr.dv_mag = std::move(dv_mag);
    gr.dsink.assign(dsink.begin(), dsink.end());  // fp32 output: the backends round once, at the end
    gr.dsink_mag = std::move(dsink_mag);
  }
  return result;
}

}  // namespace

double RefProblem::slope(int b, int h) const {
  if (alibi.empty()) return 0.0;
  return alibi[sz(alibi_per_batch ? std::int64_t(b) * h_q + h : h)];
}

double RefProblem::sink_logit(int h) const { return sink.empty() ? kNegInf : sink[sz(h)]; }

bool RefProblem::keep(int b, int h, std::int64_t i, std::int64_t j) const {
  if (!(dropout_p > 0.0)) return true;
  const std::uint32_t bh = static_cast<std::uint32_t>(b) * static_cast<std::uint32_t>(h_q) +
                           static_cast<std::uint32_t>(h);
  return rng.keep(bh, i, j);
}

double RefProblem::resolve_scale(std::optional<float> softmax_scale, int d) {
  // The parameters carry the scale as fp32, computed as the API does.
  return softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(d)));
}

void RefProblem::set_options(const Options& opts, const std::vector<float>& alibi_host, bool per_batch) {
  scale = resolve_scale(opts.softmax_scale, d);
  softcap = opts.softcap;
  mask = semantics::Mask::make(opts.causal, opts.window_left, opts.window_right);
  alibi.assign(alibi_host.begin(), alibi_host.end());
  alibi_per_batch = per_batch;
  dropout_p = opts.dropout_p;
  rng.seed = opts.seed;
  rng.offset = opts.offset;
  rng.threshold = semantics::dropout_threshold(opts.dropout_p);
}

std::vector<RefOutput> reference_forward(const RefProblem& p) {
  return forward_impl<double>(p, DType::kFloat64, /*exact=*/true);
}

std::vector<RefGrads> reference_backward(const RefProblem& p) {
  return backward_impl<double>(p, DType::kFloat64, /*exact=*/true, nullptr);
}

std::vector<RefOutput> naive_forward(const RefProblem& p, DType dtype) {
  if (dtype == DType::kFloat64) return forward_impl<double>(p, dtype, /*exact=*/false);
  return forward_impl<float>(p, dtype, /*exact=*/false);
}

std::vector<RefGrads> naive_backward(const RefProblem& p, DType dtype, const std::vector<RefOutput>& forward) {
  if (forward.size() != p.seqs.size()) throw std::invalid_argument("naive_backward: forward size");
  if (dtype == DType::kFloat64) return backward_impl<double>(p, dtype, /*exact=*/false, &forward);
  return backward_impl<float>(p, dtype, /*exact=*/false, &forward);
}

namespace {
template <typename T, typename F>
std::vector<double> concat(const std::vector<T>& parts, F field) {
  std::vector<double> all;
  for (const T& part : parts) {
    const std::vector<double>& v = field(part);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}
}  // namespace

std::vector<double> concat_out(const std::vector<RefOutput>& r) {
  return concat(r, [](const RefOutput& o) -> const std::vector<double>& { return o.out; });
}
std::vector<double> concat_lse(const std::vector<RefOutput>& r) {
  return concat(r, [](const RefOutput& o) -> const std::vector<double>& { return o.lse; });
}
std::vector<double> concat_probs(const std::vector<RefOutput>& r) {
  return concat(r, [](const RefOutput& o) -> const std::vector<double>& { return o.probs; });
}
std::vector<double> concat_dq(const std::vector<RefGrads>& g) {
  return concat(g, [](const RefGrads& o) -> const std::vector<double>& { return o.dq; });
}
std::vector<double> concat_dk(const std::vector<RefGrads>& g) {
  return concat(g, [](const RefGrads& o) -> const std::vector<double>& { return o.dk; });
}
std::vector<double> concat_dv(const std::vector<RefGrads>& g) {
  return concat(g, [](const RefGrads& o) -> const std::vector<double>& { return o.dv; });
}

std::vector<double> concat_dsink(const std::vector<RefGrads>& g) {
  std::vector<double> sum;
  for (const RefGrads& part : g) {
    if (sum.empty()) sum.assign(part.dsink.size(), 0.0);
    for (std::size_t h = 0; h < part.dsink.size() && h < sum.size(); ++h) sum[h] += part.dsink[h];
  }
  return sum;
}

}  // namespace flashattn::test
