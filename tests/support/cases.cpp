#include "support/cases.hpp"

#include "flashattn/semantics.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <numeric>
#include <stdexcept>

namespace flashattn::test {

std::vector<int> offsets(const std::vector<int>& lengths) {
  std::vector<int> cu{0};
  for (int len : lengths) cu.push_back(cu.back() + len);
  return cu;
}

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Rows [row0, row0 + rows) of a [*, heads, d] tensor as doubles.
std::vector<double> rows_of(const HostTensor& t, std::int64_t row0, std::int64_t rows) {
  const std::int64_t width = t.size(t.rank() - 2) * t.size(t.rank() - 1);
  std::vector<double> v(sz(rows * width));
  for (std::int64_t e = 0; e < rows * width; ++e) v[sz(e)] = t.get(row0 * width + e);
  return v;
}

HostTensor alibi_host_tensor(const std::vector<float>& slopes, int batch, int h_q, bool per_batch) {
  if (slopes.empty()) return {};
  if (per_batch) return float_tensor(slopes, {batch, h_q});
  return float_tensor(slopes, {h_q});
}

}  // namespace

std::vector<float> random_alibi(Rng& rng, int batch, int h_q, bool per_batch) {
  std::vector<float> s(sz(std::int64_t(per_batch ? batch : 1) * h_q));
  for (float& x : s) x = static_cast<float>(uniform_real(rng, 0.01, 1.0));
  return s;
}

std::vector<float> random_sink(Rng& rng, int h_q, double lo, double hi) {
  std::vector<float> s(sz(h_q));
  for (float& x : s) x = static_cast<float>(uniform_real(rng, lo, hi));
  return s;
}

void SinkInputs::set(std::vector<float> values) {
  logits = std::move(values);
  const int h = static_cast<int>(logits.size());
  tensor = float_tensor(logits, {h});
  grad = HostTensor(DType::kFloat32, {h});
  grad.fill_nan();
}

void SinkInputs::apply(Options& o) const {
  if (logits.empty()) return;
  o.learnable_sink = tensor.view();
  if (want_grad) o.learnable_sink_grad = grad.view();
}

void SinkInputs::poison_grad() {
  if (!logits.empty()) grad.fill_nan();
}

std::vector<double> SinkInputs::grad_values() const {
  if (logits.empty() || !want_grad) return {};
  return grad.to_double();
}

// ------------------------------------------------------------------ dense

DenseCase DenseCase::random(Rng& rng, const Shape& shape, DType dtype, double stddev) {
  DenseCase c;
  c.shape = shape;
  c.dtype = dtype;
  const std::int64_t b = shape.batch, sq = shape.s_q, sk = shape.s_k, hq = shape.h_q, hk = shape.h_k,
                     d = shape.d, dv = shape.dv();
  c.q = random_normal(dtype, {b, sq, hq, d}, rng, stddev);
  c.k = random_normal(dtype, {b, sk, hk, d}, rng, stddev);
  c.v = random_normal(dtype, {b, sk, hk, dv}, rng);
  c.dout = random_normal(dtype, {b, sq, hq, dv}, rng);
  c.out = HostTensor(dtype, {b, sq, hq, dv});
  c.lse = HostTensor(DType::kFloat32, {b, hq, sq});
  c.dq = HostTensor(dtype, {b, sq, hq, d});
  c.dk = HostTensor(dtype, {b, sk, hk, d});
  c.dv = HostTensor(dtype, {b, sk, hk, dv});
  return c;
}

void DenseCase::set_qv(Rng& rng) {
  qv = random_normal(dtype, {shape.batch, shape.s_q, shape.h_q, shape.dv()}, rng);
}

void DenseCase::set_alibi(std::vector<float> slopes, bool per_batch) {
  alibi = std::move(slopes);
  alibi_per_batch = per_batch;
  alibi_tensor = alibi_host_tensor(alibi, shape.batch, shape.h_q, per_batch);
}

void DenseCase::want_probs() {
  probs = HostTensor(DType::kFloat32, {shape.batch, shape.h_q, shape.s_q, shape.s_k});
}

Options DenseCase::call_options() const {
  Options o = opts;
  sink.apply(o);
  if (!qv.empty()) o.qv = qv.view();
  if (!alibi.empty()) o.alibi_slopes = alibi_tensor.view();
  if (!probs.shape().empty()) o.return_probs = probs.view();
  return o;
}

RefProblem DenseCase::problem() const {
  RefProblem p;
  p.h_q = shape.h_q;
  p.h_k = shape.h_k;
  p.d = shape.d;
  p.d_v = shape.dv();
  p.set_options(opts, alibi, alibi_per_batch);
  // With qv the default scale is 1/sqrt(d + d_v) (FlashAttention-3).
  if (!qv.empty()) p.scale = RefProblem::resolve_scale(opts.softmax_scale, shape.d + shape.dv());
  p.sink = sink.as_double();
  for (int b = 0; b < shape.batch; ++b) {
    RefSeq s;
    s.s_q = shape.s_q;
    s.s_k = shape.s_k;
    s.q = rows_of(q, std::int64_t(b) * shape.s_q, shape.s_q);
    if (!qv.empty()) s.qv = rows_of(qv, std::int64_t(b) * shape.s_q, shape.s_q);
    s.dout = rows_of(dout, std::int64_t(b) * shape.s_q, shape.s_q);
    s.k = rows_of(k, std::int64_t(b) * shape.s_k, shape.s_k);
    s.v = rows_of(v, std::int64_t(b) * shape.s_k, shape.s_k);
    p.seqs.push_back(std::move(s));
  }
  return p;
}

void DenseCase::poison_forward() {
  out.fill_nan();
  lse.fill_nan();
  if (!probs.shape().empty()) probs.fill_nan();
}

void DenseCase::poison_backward() {
  sink.poison_grad();
  dq.fill_nan();
  dk.fill_nan();
  dv.fill_nan();
}

void DenseCase::run_forward() { forward(q.view(), k.view(), v.view(), out.view(), lse.view(), call_options()); }

void DenseCase::run_backward() {
  backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(), dq.view(), dk.view(),
           dv.view(), call_options());
}

// ------------------------------------------------------------------ varlen

int VarlenCase::max_q() const {
  int m = 0;
  for (int b = 0; b < batch(); ++b) m = std::max(m, len_q(b));
  return m;
}

int VarlenCase::max_k() const {
  int m = 0;
  for (int b = 0; b < batch(); ++b) m = std::max(m, len_k(b));
  return m;
}

VarlenCase VarlenCase::make(Rng& rng, std::vector<int> cu_q, std::vector<int> cu_k, int h_q, int h_k, int d,
                            DType dtype, int pad_q, int pad_k, int d_v) {
  if (d_v <= 0) d_v = d;
  if (cu_q.size() != cu_k.size() || cu_q.empty()) throw std::invalid_argument("VarlenCase: cu sizes");
  VarlenCase c;
  c.h_q = h_q;
  c.h_k = h_k;
  c.d = d;
  c.d_v = d_v;
  c.dtype = dtype;
  c.cu_q = std::move(cu_q);
  c.cu_k = std::move(cu_k);
  c.total_q = c.cu_q.back() + pad_q;
  c.total_k = c.cu_k.back() + pad_k;
  c.q = random_normal(dtype, {c.total_q, h_q, d}, rng);
  c.k = random_normal(dtype, {c.total_k, h_k, d}, rng);
  c.v = random_normal(dtype, {c.total_k, h_k, d_v}, rng);
  c.dout = random_normal(dtype, {c.total_q, h_q, d_v}, rng);
  c.out = HostTensor(dtype, {c.total_q, h_q, d_v});
  c.lse = HostTensor(DType::kFloat32, {h_q, c.total_q});
  c.dq = HostTensor(dtype, {c.total_q, h_q, d});
  c.dk = HostTensor(dtype, {c.total_k, h_k, d});
  c.dv = HostTensor(dtype, {c.total_k, h_k, d_v});
  c.cu_q_t = int_tensor(c.cu_q);
  c.cu_k_t = int_tensor(c.cu_k);
  return c;
}

void VarlenCase::set_qv(Rng& rng) { qv = random_normal(dtype, {total_q, h_q, d_v}, rng); }

void VarlenCase::set_seqused_k(std::vector<int> used) {
  seqused_k = std::move(used);
  seqused_t = int_tensor(seqused_k);
}

void VarlenCase::poison_unused_q_rows() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::int64_t width = std::int64_t(h_q) * d;
  for (int b = 0; b < batch(); ++b)
    for (int i = used_q(b); i < len_q(b); ++i)
      for (std::int64_t e = 0; e < width; ++e) {
        q.set((cu_q[b] + i) * width + e, nan);
        dout.set((cu_q[b] + i) * width + e, nan);
      }
}

void VarlenCase::set_seqused_q(std::vector<int> used) {
  seqused_q = std::move(used);
  seqused_q_t = int_tensor(seqused_q);
}

void VarlenCase::set_alibi(std::vector<float> slopes, bool per_batch) {
  alibi = std::move(slopes);
  alibi_per_batch = per_batch;
  alibi_tensor = alibi_host_tensor(alibi, batch(), h_q, per_batch);
}

void VarlenCase::want_probs() { probs = HostTensor(DType::kFloat32, {h_q, total_q, max_k()}); }

Options VarlenCase::call_options() const {
  Options o = opts;
  sink.apply(o);
  if (!qv.empty()) o.qv = qv.view();
  if (!alibi.empty()) o.alibi_slopes = alibi_tensor.view();
  if (!probs.shape().empty()) o.return_probs = probs.view();
  return o;
}

VarlenArgs VarlenCase::args() const {
  VarlenArgs a;
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.cu_seqlens_q = cu_q_t.view();
  a.cu_seqlens_k = cu_k_t.view();
  if (!seqused_k.empty()) a.seqused_k = seqused_t.view();
  if (!seqused_q.empty()) a.seqused_q = seqused_q_t.view();
  a.max_seqlen_q = max_q();
  a.max_seqlen_k = max_k();
  return a;
}

RefProblem VarlenCase::problem() const {
  RefProblem p;
  p.h_q = h_q;
  p.h_k = h_k;
  p.d = d;
  p.d_v = d_v;
  p.set_options(opts, alibi, alibi_per_batch);
  if (!qv.empty()) p.scale = RefProblem::resolve_scale(opts.softmax_scale, d + d_v);
  p.sink = sink.as_double();
  for (int b = 0; b < batch(); ++b) {
    RefSeq s;
    s.s_q = used_q(b);
    s.s_k = used_k(b);
    s.q = rows_of(q, cu_q[b], s.s_q);
    if (!qv.empty()) s.qv = rows_of(qv, cu_q[b], s.s_q);
    s.dout = rows_of(dout, cu_q[b], s.s_q);
    s.k = rows_of(k, cu_k[b], s.s_k);
    s.v = rows_of(v, cu_k[b], s.s_k);
    p.seqs.push_back(std::move(s));
  }
  return p;
}

void VarlenCase::poison_forward() {
  out.fill_nan();
  lse.fill_nan();
  if (!probs.shape().empty()) probs.fill_nan();
}

void VarlenCase::poison_backward() {
  sink.poison_grad();
  dq.fill_nan();
  dk.fill_nan();
  dv.fill_nan();
}

void VarlenCase::run_forward() { varlen_forward(args(), out.view(), lse.view(), call_options()); }

void VarlenCase::run_backward() {
  varlen_backward(args(), dout.view(), out.view(), lse.view(), dq.view(), dk.view(), dv.view(),
                  call_options());
}

namespace {
// Rows cu_q[b] .. cu_q[b] + used_q(b) of every sequence, concatenated.
std::vector<double> used_q_rows(const VarlenCase& c, const HostTensor& t) {
  if (c.seqused_q.empty()) return rows_of(t, 0, c.cu_q.back());
  std::vector<double> r;
  for (int b = 0; b < c.batch(); ++b) {
    const std::vector<double> part = rows_of(t, c.cu_q[b], c.used_q(b));
    r.insert(r.end(), part.begin(), part.end());
  }
  return r;
}
}  // namespace

std::vector<double> VarlenCase::out_concat() const { return used_q_rows(*this, out); }
std::vector<double> VarlenCase::dq_concat() const { return used_q_rows(*this, dq); }

std::vector<double> VarlenCase::q_unused_rows(const HostTensor& t) const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b) {
    const std::vector<double> part = rows_of(t, cu_q[b] + used_q(b), len_q(b) - used_q(b));
    r.insert(r.end(), part.begin(), part.end());
  }
  return r;
}

std::vector<double> VarlenCase::lse_unused_rows() const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b)
    for (int h = 0; h < h_q; ++h)
      for (int i = used_q(b); i < len_q(b); ++i) r.push_back(lse.at({h, cu_q[b] + i}));
  return r;
}

std::vector<double> VarlenCase::lse_concat() const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b)
    for (int h = 0; h < h_q; ++h)
      for (int i = 0; i < used_q(b); ++i) r.push_back(lse.at({h, cu_q[b] + i}));
  return r;
}

std::vector<double> VarlenCase::probs_concat() const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b)
    for (int h = 0; h < h_q; ++h)
      for (int i = 0; i < used_q(b); ++i)
        for (int j = 0; j < used_k(b); ++j) r.push_back(probs.at({h, cu_q[b] + i, j}));
  return r;
}

std::vector<double> VarlenCase::dk_concat() const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b) {
    const std::vector<double> part = rows_of(dk, cu_k[b], used_k(b));
    r.insert(r.end(), part.begin(), part.end());
  }
  return r;
}

std::vector<double> VarlenCase::dv_concat() const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b) {
    const std::vector<double> part = rows_of(dv, cu_k[b], used_k(b));
    r.insert(r.end(), part.begin(), part.end());
  }
  return r;
}

std::vector<double> VarlenCase::dkv_unused_rows() const {
  std::vector<double> r;
  for (int b = 0; b < batch(); ++b) {
    const int unused = len_k(b) - used_k(b);
    for (const HostTensor* t : {&dk, &dv}) {
      const std::vector<double> part = rows_of(*t, cu_k[b] + used_k(b), unused);
      r.insert(r.end(), part.begin(), part.end());
    }
  }
  return r;
}

// ------------------------------------------------------------------ KV cache

KVCacheCase KVCacheCase::make(Rng& rng, const KVCacheConfig& cfg) {
  KVCacheCase c;
  c.cfg = cfg;
  const int B = cfg.batch;
  c.cache_lens = cfg.cache_lens;
  if (c.cache_lens.empty())
    for (int b = 0; b < B; ++b) c.cache_lens.push_back(uniform_int(rng, 0, cfg.max_cache_len));
  if (static_cast<int>(c.cache_lens.size()) != B) throw std::invalid_argument("KVCacheCase: cache_lens size");
  int max_sk = 1;
  for (int b = 0; b < B; ++b) max_sk = std::max(max_sk, c.s_k(b));
  if (cfg.leftpad) {
    c.leftpad = cfg.leftpads;
    if (c.leftpad.empty())
      for (int b = 0; b < B; ++b) c.leftpad.push_back(uniform_int(rng, 0, c.cache_lens[sz(b)]));
    if (static_cast<int>(c.leftpad.size()) != B) throw std::invalid_argument("KVCacheCase: leftpads size");
    c.leftpad_t = int_tensor(c.leftpad);
  }

  std::int64_t rows_per = 0, slots = 0;
  if (cfg.block_size > 0) {
    const int bs = cfg.block_size;
    std::vector<int> need(sz(B));
    for (int b = 0; b < B; ++b) need[sz(b)] = (c.s_k(b) + bs - 1) / bs;
    c.max_blocks = std::max(1, *std::max_element(need.begin(), need.end()));
    int shared = 0;
    if (cfg.share_blocks && B >= 2)
      shared = std::min({std::min(c.cache_lens[0], c.cache_lens[1]) / bs, need[0], need[1]});
    const int used = std::accumulate(need.begin(), need.end(), 0) - shared;
    c.num_blocks = used + std::max(1, cfg.extra_blocks);
    std::vector<int> ids(sz(c.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int spare = ids.back();  // never assigned: stays NaN
    c.block_table.assign(sz(std::int64_t(B) * c.max_blocks), spare);
    int next = 0;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < need[sz(b)]; ++t)
        c.block_table[sz(std::int64_t(b) * c.max_blocks + t)] =
            (b == 1 && t < shared) ? c.block_table[sz(t)] : ids[sz(next++)];
    c.block_table_t = int_tensor(c.block_table, {B, c.max_blocks});
    rows_per = bs;
    slots = c.num_blocks;
  } else {
    const int rows = cfg.cache_rows > 0 ? cfg.cache_rows : B;
    if (rows < B) throw std::invalid_argument("KVCacheCase: cache_rows < batch");
    const int s_cache = cfg.s_cache > 0 ? cfg.s_cache : max_sk;
    if (s_cache < max_sk) throw std::invalid_argument("KVCacheCase: s_cache too small");
    if (cfg.use_batch_idx) {
      std::vector<int> perm(sz(rows));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      c.batch_idx.assign(perm.begin(), perm.begin() + B);
      c.batch_idx_t = int_tensor(c.batch_idx);
    }
    rows_per = s_cache;
    slots = rows;
  }
  const std::int64_t hk = cfg.h_k, d = cfg.d, dv = cfg.dv();
  if (cfg.fp8 && cfg.fp8_q) throw std::invalid_argument("KVCacheCase: fp8 and fp8_q");
  const DType cache_dtype = cfg.fp8 || cfg.fp8_q ? DType::kFloat8E4M3 : cfg.dtype;
  c.k_cache = HostTensor(cache_dtype, {slots, rows_per, hk, d});
  c.v_cache = HostTensor(cache_dtype, {slots, rows_per, hk, dv});
  c.k_cache.fill_nan();
  c.v_cache.fill_nan();
  if (cfg.fp8) {
    // Scales of the slots some sequence uses are drawn; the others stay NaN.
    std::set<int> used_slots;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < c.s_k(b); ++j) used_slots.insert(c.locate(b, j).first);
    const std::int64_t scale_rows = cfg.per_block_scales ? slots : 1;
    std::vector<float> ks(sz(scale_rows * hk)), vs(sz(scale_rows * hk));
    for (std::int64_t r = 0; r < scale_rows; ++r)
      for (std::int64_t g = 0; g < hk; ++g) {
        const bool used = !cfg.per_block_scales || used_slots.count(static_cast<int>(r)) > 0;
        const float nan = std::numeric_limits<float>::quiet_NaN();
        ks[sz(r * hk + g)] = used ? static_cast<float>(uniform_real(rng, cfg.scale_lo, cfg.scale_hi)) : nan;
        vs[sz(r * hk + g)] = used ? static_cast<float>(uniform_real(rng, cfg.scale_lo, cfg.scale_hi)) : nan;
      }
    if (cfg.per_block_scales) {
      c.k_scale = float_tensor(ks, {slots, hk});
      c.v_scale = float_tensor(vs, {slots, hk});
    } else {
      c.k_scale = float_tensor(ks, {hk});
      c.v_scale = float_tensor(vs, {hk});
    }
  }
  if (cfg.fp8_q) {
    auto draw = [&] {
      std::vector<float> v(sz(B * hk));
      for (float& x : v) x = static_cast<float>(uniform_real(rng, cfg.scale_lo, cfg.scale_hi));
      return float_tensor(v, {B, hk});
    };
    c.q_descale = draw();
    c.k_descale = draw();
    c.v_descale = draw();
  }
  // The fp8 scale of element (slot, g) written by sequence b.
  auto scale_of = [&](bool is_k, int b, int slot, int g) {
    if (cfg.fp8_q) return (is_k ? c.k_descale : c.v_descale).as<float>()[std::int64_t(b) * hk + g];
    return is_k ? c.k_scale_of(slot, g) : c.v_scale_of(slot, g);
  };
  // Stores x into cache element (slot, row, g, e) for sequence b: rounded to dtype, or
  // quantized by the slot's scale (fp8) or the sequence's descale (fp8_q).
  auto store = [&](HostTensor& cache, bool is_k, int b, int slot, int row, std::int64_t e, double x) {
    const std::int64_t width = is_k ? d : dv;
    const std::int64_t at = (std::int64_t(slot) * rows_per + row) * hk * width + e;
    if (!cfg.fp8 && !cfg.fp8_q) {
      cache.set(at, x);
      return;
    }
    const float scale = scale_of(is_k, b, slot, static_cast<int>(e / width));
    cache.as<std::uint8_t>()[at] = semantics::quantize_e4m3(static_cast<float>(x), scale);
  };
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int b = 0; b < B; ++b)
    for (int j = c.first_key(b); j < c.cache_lens[b]; ++j) {  // left padding stays NaN
      const auto [slot, row] = c.locate(b, j);
      for (std::int64_t e = 0; e < hk * std::max(d, dv); ++e) {
        if (e < hk * d) store(c.k_cache, true, b, slot, row, e, normal(rng));
        if (e < hk * dv) store(c.v_cache, false, b, slot, row, e, normal(rng));
      }
    }
  // fp8_q: x [b, rows, h, width] (fp64) to e4m3 bytes by the descale of (b, KV head);
  // x becomes the dequantized values.
  auto quantize = [&](HostTensor& x, const HostTensor& descale) {
    HostTensor bytes(DType::kFloat8E4M3, x.shape());
    const std::int64_t h = x.size(2), width = x.size(3), per_b = x.numel() / B;
    const std::int64_t ratio = h / hk;
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const std::int64_t b = i / per_b, g = (i / width) % h / ratio;
      const float scale = descale.as<float>()[b * hk + g];
      bytes.as<std::uint8_t>()[i] = semantics::quantize_e4m3(static_cast<float>(x.get(i)), scale);
      x.set(i, dequantize_e4m3(bytes.as<std::uint8_t>()[i], scale));
    }
    return bytes;
  };
  if (cfg.fp8_q) {
    if (cfg.qv) throw std::invalid_argument("KVCacheCase: fp8_q with qv");
    c.q_ref = random_normal(DType::kFloat64, {B, cfg.s_q, cfg.h_q, d}, rng);
    c.q = quantize(c.q_ref, c.q_descale);
  } else {
    c.q = random_normal(cfg.dtype, {B, cfg.s_q, cfg.h_q, d}, rng);
  }
  if (cfg.qv) c.qv = random_normal(cfg.dtype, {B, cfg.s_q, cfg.h_q, dv}, rng);
  c.out = HostTensor(cfg.dtype, {B, cfg.s_q, cfg.h_q, dv});
  c.lse = HostTensor(DType::kFloat32, {B, cfg.h_q, cfg.s_q});
  c.cache_lens_t = int_tensor(c.cache_lens);
  c.k_cache_expected = c.k_cache;
  c.v_cache_expected = c.v_cache;
  if (cfg.s_new > 0) {
    c.k_new = random_normal(cfg.fp8_q ? DType::kFloat64 : cfg.dtype, {B, cfg.s_new, hk, d}, rng);
    c.v_new = random_normal(cfg.fp8_q ? DType::kFloat64 : cfg.dtype, {B, cfg.s_new, hk, dv}, rng);
    if (cfg.fp8_q) {  // e4m3 k_new / v_new; the append copies their bytes
      c.k_new = quantize(c.k_new, c.k_descale);
      c.v_new = quantize(c.v_new, c.v_descale);
    }
    for (int b = 0; b < B; ++b)
      for (int r = 0; r < cfg.s_new; ++r) {
        const auto [slot, row] = c.locate(b, c.cache_lens[b] + r);
        const std::int64_t src = (std::int64_t(b) * cfg.s_new + r) * hk;
        auto put = [&](HostTensor& cache, const HostTensor& from, bool is_k, std::int64_t width) {
          for (std::int64_t e = 0; e < hk * width; ++e) {
            const std::int64_t at = (std::int64_t(slot) * rows_per + row) * hk * width + e;
            if (cfg.fp8_q)
              cache.as<std::uint8_t>()[at] = from.as<std::uint8_t>()[src * width + e];
            else
              store(cache, is_k, b, slot, row, e, from.get(src * width + e));
          }
        };
        put(c.k_cache_expected, c.k_new, true, d);
        put(c.v_cache_expected, c.v_new, false, dv);
      }
  }
  if (cfg.tree != KVCacheConfig::Tree::kNone) {
    const int W = c.tree_words_per_row(), S = cfg.s_q;
    c.tree_words.assign(sz(std::int64_t(B) * S * W), 0u);
    c.tree_parents.assign(sz(std::int64_t(B) * S), -1);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < S; ++i) {
        std::uint32_t* row = &c.tree_words[sz((std::int64_t(b) * S + i) * W)];
        int& parent = c.tree_parents[sz(std::int64_t(b) * S + i)];
        if (cfg.tree == KVCacheConfig::Tree::kLinear) {
          parent = i - 1;
        } else {
          parent = i == 0 ? -1 : uniform_int(rng, -1, i - 1);
        }
        if (parent >= 0) {  // the parent's ancestors, then itself
          const std::uint32_t* up = &c.tree_words[sz((std::int64_t(b) * S + parent) * W)];
          std::copy(up, up + W, row);
        }
        row[i / 32] |= 1u << (i % 32);
      }
    const int Wp = W + cfg.tree_row_pad;
    std::vector<int> padded(sz(std::int64_t(B) * S * Wp), -1);  // pad words: all bits set
    for (std::int64_t r = 0; r < std::int64_t(B) * S; ++r)
      std::memcpy(&padded[sz(r * Wp)], &c.tree_words[sz(r * W)], sz(W) * sizeof(int));
    if (S % 32 != 0) {  // bits of drafts t >= s_q in the last word are ignored: set them
      const std::uint32_t high = ~((1u << (S % 32)) - 1u);
      for (std::int64_t r = 0; r < std::int64_t(B) * S; ++r)
        padded[sz(r * Wp + W - 1)] = static_cast<int>(static_cast<std::uint32_t>(padded[sz(r * Wp + W - 1)]) | high);
    }
    c.tree_mask = int_tensor(padded, {B, S, Wp});
  }
  return c;
}

float KVCacheCase::k_scale_of(int slot, int g) const {
  return k_scale.as<float>()[cfg.per_block_scales ? std::int64_t(slot) * cfg.h_k + g : g];
}
float KVCacheCase::v_scale_of(int slot, int g) const {
  return v_scale.as<float>()[cfg.per_block_scales ? std::int64_t(slot) * cfg.h_k + g : g];
}

std::pair<int, int> KVCacheCase::locate(int b, int j) const {
  if (cfg.block_size > 0)
    return {block_table[sz(std::int64_t(b) * max_blocks + j / cfg.block_size)], j % cfg.block_size};
  return {batch_idx.empty() ? b : batch_idx[sz(b)], j};
}

void KVCacheCase::set_alibi(std::vector<float> slopes, bool per_batch) {
  alibi = std::move(slopes);
  alibi_per_batch = per_batch;
  alibi_tensor = alibi_host_tensor(alibi, cfg.batch, cfg.h_q, per_batch);
}

Options KVCacheCase::call_options() const {
  Options o = opts;
  sink.apply(o);
  if (cfg.qv) o.qv = qv.view();
  if (!alibi.empty()) o.alibi_slopes = alibi_tensor.view();
  if (cfg.fp8_q) {
    o.q_descale = q_descale.view();
    o.k_descale = k_descale.view();
    o.v_descale = v_descale.view();
  }
  return o;
}

KVCacheArgs KVCacheCase::args() const {
  KVCacheArgs a;
  a.q = q.view();
  a.k_cache = k_cache.view();
  a.v_cache = v_cache.view();
  a.cache_seqlens = cache_lens_t.view();
  if (cfg.block_size > 0) a.block_table = block_table_t.view();
  if (!batch_idx.empty()) a.cache_batch_idx = batch_idx_t.view();
  if (cfg.leftpad) a.cache_leftpad = leftpad_t.view();
  if (cfg.s_new > 0) {
    a.k_new = k_new.view();
    a.v_new = v_new.view();
  }
  if (cfg.fp8) {
    a.k_scale = k_scale.view();
    a.v_scale = v_scale.view();
  }
  if (cfg.tree != KVCacheConfig::Tree::kNone) {
    const std::int64_t W = tree_words_per_row(), Wp = tree_mask.size(2);
    a.tree_mask = Tensor::strided(const_cast<void*>(tree_mask.data()), DType::kInt32,
                                  {cfg.batch, cfg.s_q, W}, {cfg.s_q * Wp, Wp, 1});
  }
  a.num_splits = num_splits;
  return a;
}

RefProblem KVCacheCase::problem() const {
  RefProblem p;
  p.h_q = cfg.h_q;
  p.h_k = cfg.h_k;
  p.d = cfg.d;
  p.d_v = cfg.dv();
  p.set_options(opts, alibi, alibi_per_batch);
  // With qv the default scale is 1/sqrt(d + d_v) (FlashAttention-3).
  if (cfg.qv) p.scale = RefProblem::resolve_scale(opts.softmax_scale, cfg.d + cfg.dv());
  p.sink = sink.as_double();
  const std::int64_t rows_per = k_cache.size(1), width = std::int64_t(cfg.h_k) * cfg.d,
                     width_v = std::int64_t(cfg.h_k) * cfg.dv();
  for (int b = 0; b < cfg.batch; ++b) {
    RefSeq s;
    s.s_q = cfg.s_q;
    s.s_k = s_k(b) - first_key(b);  // key j is cache row first_key(b) + j
    s.q = rows_of(cfg.fp8_q ? q_ref : q, std::int64_t(b) * cfg.s_q, cfg.s_q);
    if (cfg.qv) s.qv = rows_of(qv, std::int64_t(b) * cfg.s_q, cfg.s_q);
    for (int j = first_key(b); j < s_k(b); ++j) {
      const auto [slot, row] = locate(b, j);
      const std::int64_t base = (std::int64_t(slot) * rows_per + row) * width;
      const std::int64_t base_v = (std::int64_t(slot) * rows_per + row) * width_v;
      for (std::int64_t e = 0; e < width; ++e) {
        if (cfg.fp8_q) {
          const int g = static_cast<int>(e / cfg.d);
          s.k.push_back(dequantize_e4m3(k_cache_expected.as<std::uint8_t>()[base + e],
                                        k_descale.as<float>()[std::int64_t(b) * cfg.h_k + g]));
        } else if (cfg.fp8) {
          const int g = static_cast<int>(e / cfg.d);
          s.k.push_back(dequantize_e4m3(k_cache_expected.as<std::uint8_t>()[base + e], k_scale_of(slot, g)));
        } else {
          s.k.push_back(k_cache_expected.get(base + e));
        }
      }
      for (std::int64_t e = 0; e < width_v; ++e) {
        if (cfg.fp8_q) {
          const int g = static_cast<int>(e / cfg.dv());
          s.v.push_back(dequantize_e4m3(v_cache_expected.as<std::uint8_t>()[base_v + e],
                                        v_descale.as<float>()[std::int64_t(b) * cfg.h_k + g]));
        } else if (cfg.fp8) {
          const int g = static_cast<int>(e / cfg.dv());
          s.v.push_back(dequantize_e4m3(v_cache_expected.as<std::uint8_t>()[base_v + e], v_scale_of(slot, g)));
        } else {
          s.v.push_back(v_cache_expected.get(base_v + e));
        }
      }
    }
    if (!tree_words.empty()) {
      const std::int64_t W = tree_words_per_row();
      s.tree.assign(tree_words.begin() + std::int64_t(b) * cfg.s_q * W,
                    tree_words.begin() + std::int64_t(b + 1) * cfg.s_q * W);
    }
    p.seqs.push_back(std::move(s));
  }
  return p;
}

void KVCacheCase::poison_outputs() {
  out.fill_nan();
  lse.fill_nan();
}

void KVCacheCase::run() { kvcache_forward(args(), out.view(), lse.view(), call_options()); }

// ------------------------------------------------------------------ fp8 q, k, v

namespace {

// x holds [rows, h, d] (row-major, rows flattened over any leading dims); row r belongs
// to sequence seq_of_row[r] (-1: padding). Quantizes into e4m3 bytes with descales
// [batch, h_k] and overwrites x with the dequantized values.
void quantize_rows(HostTensor& x, const std::vector<int>& seq_of_row, int batch, int h, int h_k,
                   HostTensor& bytes, HostTensor& descale) {
  const std::int64_t rows = static_cast<std::int64_t>(seq_of_row.size());
  const std::int64_t d = x.numel() / (rows * h);
  const int ratio = h / h_k;
  bytes = HostTensor(DType::kFloat8E4M3, x.shape());
  descale = HostTensor(DType::kFloat32, {batch, h_k});
  std::vector<double> amax(std::size_t(batch) * h_k, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (seq_of_row[r] < 0) continue;
    for (int hh = 0; hh < h; ++hh)
      for (std::int64_t c = 0; c < d; ++c) {
        double& m = amax[std::size_t(seq_of_row[r]) * h_k + hh / ratio];
        m = std::max(m, std::abs(x.get((r * h + hh) * d + c)));
      }
  }
  for (std::size_t i = 0; i < amax.size(); ++i) {
    descale.set(static_cast<std::int64_t>(i), amax[i] > 0 ? amax[i] / 448.0 : 1.0);
  }
  auto* out = bytes.as<std::uint8_t>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (int hh = 0; hh < h; ++hh) {
      const int b = seq_of_row[r];
      const float scale =
          b < 0 ? 1.0f : descale.as<float>()[std::size_t(b) * h_k + hh / ratio];
      for (std::int64_t c = 0; c < d; ++c) {
        const std::int64_t at = (r * h + hh) * d + c;
        out[at] = semantics::quantize_e4m3(static_cast<float>(x.get(at)), scale);
        x.set(at, dequantize_e4m3(out[at], scale));
      }
    }
}

}  // namespace

void Fp8Inputs::apply(Options& o) const {
  o.q_descale = q_descale.view();
  o.k_descale = k_descale.view();
  o.v_descale = v_descale.view();
}

Fp8Inputs quantize_fp8(DenseCase& c) {
  Fp8Inputs f;
  const Shape& s = c.shape;
  std::vector<int> rows_q, rows_k;
  for (int b = 0; b < s.batch; ++b) {
    rows_q.insert(rows_q.end(), std::size_t(s.s_q), b);
    rows_k.insert(rows_k.end(), std::size_t(s.s_k), b);
  }
  quantize_rows(c.q, rows_q, s.batch, s.h_q, s.h_k, f.q, f.q_descale);
  quantize_rows(c.k, rows_k, s.batch, s.h_k, s.h_k, f.k, f.k_descale);
  quantize_rows(c.v, rows_k, s.batch, s.h_k, s.h_k, f.v, f.v_descale);
  return f;
}

Fp8Inputs quantize_fp8(VarlenCase& c) {
  Fp8Inputs f;
  std::vector<int> rows_q(std::size_t(c.total_q), -1), rows_k(std::size_t(c.total_k), -1);
  for (int b = 0; b < c.batch(); ++b) {
    for (int i = c.cu_q[b]; i < c.cu_q[b + 1]; ++i) rows_q[std::size_t(i)] = b;
    for (int j = c.cu_k[b]; j < c.cu_k[b + 1]; ++j) rows_k[std::size_t(j)] = b;
  }
  quantize_rows(c.q, rows_q, c.batch(), c.h_q, c.h_k, f.q, f.q_descale);
  quantize_rows(c.k, rows_k, c.batch(), c.h_k, c.h_k, f.k, f.k_descale);
  quantize_rows(c.v, rows_k, c.batch(), c.h_k, c.h_k, f.v, f.v_descale);
  return f;
}

}  // namespace flashattn::test
