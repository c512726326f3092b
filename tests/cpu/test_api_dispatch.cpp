// The parameters argument checking builds reach the CPU backend intact: strided views,
// padded lse, GQA, the KV-cache append (dense with cache_batch_idx, and paged) and
// varlen packing give the same numbers as a naive fp64 attention computed here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"

namespace fa = flashattn;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kTol = 1e-12;

// Element (i0, i1, i2, i3) of an fp64 tensor view.
double& at(const fa::Tensor& t, std::int64_t i0, std::int64_t i1, std::int64_t i2,
           std::int64_t i3 = 0) {
  const std::int64_t idx[4] = {i0, i1, i2, i3};
  std::int64_t off = 0;
  for (int d = 0; d < t.rank; ++d) off += idx[d] * t.stride[d];
  return static_cast<double*>(t.data)[off];
}

// Causal-or-full softmax attention of one (query row, head), keys [0, s_k), over
// key/value accessors; writes d outputs and returns lse.
template <typename Q, typename K, typename V>
double naive_row(Q q, K k, V v, std::int64_t i, std::int64_t s_q, std::int64_t s_k, int d,
                 bool causal, double scale, std::vector<double>& out) {
  std::vector<double> s(static_cast<std::size_t>(s_k));
  double m = -INFINITY;
  for (std::int64_t j = 0; j < s_k; ++j) {
    const bool visible = !causal || j <= i + s_k - s_q;
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += q(c) * k(j, c);
    s[j] = visible ? dot * scale : -INFINITY;
    m = std::max(m, s[j]);
  }
  out.assign(d, 0.0);
  if (m == -INFINITY) return -INFINITY;
  double sum = 0;
  for (std::int64_t j = 0; j < s_k; ++j) sum += std::exp(s[j] - m);
  for (std::int64_t j = 0; j < s_k; ++j) {
    const double p = std::exp(s[j] - m) / sum;
    for (int c = 0; c < d; ++c) out[c] += p * v(j, c);
  }
  return m + std::log(sum);
}

// lse is fp32; a row that sees no key has lse -inf.
void expect_lse(float actual, double expected) {
  if (expected == -INFINITY) {
    EXPECT_EQ(actual, -INFINITY);
  } else {
    EXPECT_NEAR(actual, expected, 1e-5 * std::max(1.0, std::fabs(expected)));
  }
}

class ApiDispatch : public ::testing::Test {
 protected:
  ApiDispatch() : seed_(std::random_device{}()), rng_(seed_) {}
  void SetUp() override { RecordProperty("seed", std::to_string(seed_)); }

  std::vector<double>& buffer(std::size_t n, double fill) {
    buffers_.emplace_back(n, fill);
    return buffers_.back();
  }
  std::vector<double>& random_buffer(std::size_t n) {
    std::vector<double>& b = buffer(n, 0.0);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    for (double& x : b) x = dist(rng_);
    return b;
  }
  std::vector<std::int32_t>& ints(std::vector<std::int32_t> v) {
    int_buffers_.push_back(std::move(v));
    return int_buffers_.back();
  }

  unsigned seed_;
  std::mt19937 rng_;
  std::vector<std::vector<double>> buffers_;
  std::vector<std::vector<std::int32_t>> int_buffers_;
};

TEST_F(ApiDispatch, StridedDenseForwardMatchesNaive) {
  buffers_.reserve(8);
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const std::int64_t b = 2, s_q = 5, s_k = 9, h_q = 6, h_k = 2, d = 12;
  // q, k, v: slices of one packed [b, s, h_q + 2 h_k, d] tensor (s = max(s_q, s_k)).
  const std::int64_t s = s_k, heads = h_q + 2 * h_k;
  std::vector<double>& qkv = random_buffer(b * s * heads * d);
  const std::int64_t bs = s * heads * d, rs = heads * d;
  const fa::DType f64 = fa::DType::kFloat64;
  const fa::Tensor q = fa::Tensor::strided(qkv.data(), f64, {b, s_q, h_q, d}, {bs, rs, d, 1});
  const fa::Tensor k = fa::Tensor::strided(qkv.data() + h_q * d, f64, {b, s_k, h_k, d}, {bs, rs, d, 1});
  const fa::Tensor v =
      fa::Tensor::strided(qkv.data() + (h_q + h_k) * d, f64, {b, s_k, h_k, d}, {bs, rs, d, 1});
  // out with a padded head stride, lse with padded rows; padding must stay NaN.
  const std::int64_t o_hs = d + 4, l_hs = s_q + 3;
  std::vector<double>& out_buf = buffer(b * s_q * h_q * o_hs, kNaN);
  const fa::Tensor out = fa::Tensor::strided(out_buf.data(), f64, {b, s_q, h_q, d},
                                             {s_q * h_q * o_hs, h_q * o_hs, o_hs, 1});
  std::vector<float> lse_buf(b * h_q * l_hs, std::numeric_limits<float>::quiet_NaN());
  const fa::Tensor lse = fa::Tensor::strided(lse_buf.data(), fa::DType::kFloat32, {b, h_q, s_q},
                                             {h_q * l_hs, l_hs, 1});
  fa::Options opts;
  opts.causal = true;
  opts.softmax_scale = 0.3f;
  fa::forward(q, k, v, out, lse, opts);

  std::vector<double> ref;
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t h = 0; h < h_q; ++h) {
      const std::int64_t g = h / (h_q / h_k);
      for (std::int64_t i = 0; i < s_q; ++i) {
        const double l = naive_row([&](int c) { return at(q, bi, i, h, c); },
                                   [&](std::int64_t j, int c) { return at(k, bi, j, g, c); },
                                   [&](std::int64_t j, int c) { return at(v, bi, j, g, c); }, i,
                                   s_q, s_k, int(d), true, double(0.3f), ref);
        for (int c = 0; c < d; ++c) ASSERT_NEAR(at(out, bi, i, h, c), ref[c], kTol) << bi << h << i << c;
        expect_lse(lse_buf[bi * h_q * l_hs + h * l_hs + i], l);
        for (std::int64_t pad = d; pad < o_hs; ++pad) {
          ASSERT_TRUE(std::isnan(out_buf[((bi * s_q + i) * h_q + h) * o_hs + pad]));
        }
      }
      for (std::int64_t pad = s_q; pad < l_hs; ++pad) {
        ASSERT_TRUE(std::isnan(lse_buf[bi * h_q * l_hs + h * l_hs + pad]));
      }
    }
  }
}

// The KV-cache call appends k_new / v_new at cache_seqlens[i] and attends to
// cache_seqlens[i] + s_new keys; the dense cache (through cache_batch_idx) and the
// paged cache (through a shuffled block table) give the naive result.
TEST_F(ApiDispatch, KVCacheAppendAndAttend) {
  buffers_.reserve(16);
  int_buffers_.reserve(8);
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const std::int64_t b = 2, s_q = 3, h_q = 4, h_k = 2, d = 8, s_new = 3, s_cache = 16;
  const std::int64_t block_size = 4, max_blocks = 4, num_blocks = 9;
  const std::vector<std::int32_t> seqlens = {5, 11};
  const fa::DType f64 = fa::DType::kFloat64;
  const fa::Tensor q = fa::Tensor::contiguous(random_buffer(b * s_q * h_q * d).data(), f64, {b, s_q, h_q, d});
  const fa::Tensor k_new = fa::Tensor::contiguous(random_buffer(b * s_new * h_k * d).data(), f64, {b, s_new, h_k, d});
  const fa::Tensor v_new = fa::Tensor::contiguous(random_buffer(b * s_new * h_k * d).data(), f64, {b, s_new, h_k, d});

  // Dense cache of 3 rows; sequence 0 lives in row 2, sequence 1 in row 0.
  const std::vector<std::int32_t> rows = {2, 0};
  fa::KVCacheArgs dense;
  dense.q = q;
  dense.k_cache = fa::Tensor::contiguous(random_buffer(3 * s_cache * h_k * d).data(), f64, {3, s_cache, h_k, d});
  dense.v_cache = fa::Tensor::contiguous(random_buffer(3 * s_cache * h_k * d).data(), f64, {3, s_cache, h_k, d});
  dense.cache_seqlens = fa::Tensor::contiguous(ints(seqlens).data(), fa::DType::kInt32, {b});
  dense.cache_batch_idx = fa::Tensor::contiguous(ints(rows).data(), fa::DType::kInt32, {b});
  dense.k_new = k_new;
  dense.v_new = v_new;

  // Paged copy of the same keys: key t of sequence i in block table[i][t / 4], row t % 4.
  const std::vector<std::int32_t> table = {7, 3, -1, -1, 0, 8, 5, 1};
  fa::KVCacheArgs paged = dense;
  paged.cache_batch_idx = fa::Tensor{};
  paged.k_cache = fa::Tensor::contiguous(buffer(num_blocks * block_size * h_k * d, kNaN).data(), f64, {num_blocks, block_size, h_k, d});
  paged.v_cache = fa::Tensor::contiguous(buffer(num_blocks * block_size * h_k * d, kNaN).data(), f64, {num_blocks, block_size, h_k, d});
  paged.block_table = fa::Tensor::contiguous(ints(table).data(), fa::DType::kInt32, {b, max_blocks});
  auto paged_at = [&](const fa::Tensor& cache, std::int64_t i, std::int64_t t, std::int64_t g, std::int64_t c) -> double& {
    return at(cache, table[i * max_blocks + t / block_size], t % block_size, g, c);
  };
  for (std::int64_t i = 0; i < b; ++i) {
    for (std::int64_t t = 0; t < seqlens[i]; ++t) {
      for (std::int64_t g = 0; g < h_k; ++g) {
        for (std::int64_t c = 0; c < d; ++c) {
          paged_at(paged.k_cache, i, t, g, c) = at(dense.k_cache, rows[i], t, g, c);
          paged_at(paged.v_cache, i, t, g, c) = at(dense.v_cache, rows[i], t, g, c);
        }
      }
    }
  }

  fa::Options opts;
  opts.causal = true;
  for (const fa::KVCacheArgs* args : {&dense, &paged}) {
    for (int splits : {1, 0, 3}) {
      SCOPED_TRACE(std::string(args == &dense ? "dense" : "paged") + " cache, num_splits " + std::to_string(splits));
      fa::KVCacheArgs a = *args;
      a.num_splits = splits;
      const fa::Tensor out = fa::Tensor::contiguous(buffer(b * s_q * h_q * d, kNaN).data(), f64, {b, s_q, h_q, d});
      std::vector<float> lse_buf(b * h_q * s_q, std::numeric_limits<float>::quiet_NaN());
      const fa::Tensor lse = fa::Tensor::contiguous(lse_buf.data(), fa::DType::kFloat32, {b, h_q, s_q});
      fa::kvcache_forward(a, out, lse, opts);

      const bool is_paged = args == &paged;
      auto key = [&](const fa::Tensor& cache, std::int64_t i, std::int64_t t, std::int64_t g, std::int64_t c) {
        return is_paged ? paged_at(cache, i, t, g, c) : at(cache, rows[i], t, g, c);
      };
      std::vector<double> ref;
      for (std::int64_t i = 0; i < b; ++i) {
        const std::int64_t s_k = seqlens[i] + s_new;
        // The append landed in the cache.
        for (std::int64_t r = 0; r < s_new; ++r) {
          for (std::int64_t g = 0; g < h_k; ++g) {
            for (std::int64_t c = 0; c < d; ++c) {
              ASSERT_EQ(key(a.k_cache, i, seqlens[i] + r, g, c), at(k_new, i, r, g, c));
              ASSERT_EQ(key(a.v_cache, i, seqlens[i] + r, g, c), at(v_new, i, r, g, c));
            }
          }
        }
        for (std::int64_t h = 0; h < h_q; ++h) {
          const std::int64_t g = h / (h_q / h_k);
          for (std::int64_t r = 0; r < s_q; ++r) {
            const double l = naive_row([&](int c) { return at(q, i, r, h, c); },
                                       [&](std::int64_t j, int c) { return key(a.k_cache, i, j, g, c); },
                                       [&](std::int64_t j, int c) { return key(a.v_cache, i, j, g, c); },
                                       r, s_q, s_k, int(d), true, double(1.0f / std::sqrt(float(d))), ref);
            for (int c = 0; c < d; ++c) ASSERT_NEAR(at(out, i, r, h, c), ref[c], kTol);
            expect_lse(lse_buf[(i * h_q + h) * s_q + r], l);
          }
        }
      }
    }
  }
}

// Varlen packing gives each sequence the dense result; empty sequences are fine.
TEST_F(ApiDispatch, VarlenMatchesPerSequenceNaive) {
  buffers_.reserve(8);
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const std::vector<std::int32_t> cu_q = {0, 3, 3, 10}, cu_k = {0, 6, 8, 13};
  const std::int64_t total_q = 10, total_k = 13, h_q = 2, h_k = 1, d = 5;
  const fa::DType f64 = fa::DType::kFloat64;
  fa::VarlenArgs a;
  a.q = fa::Tensor::contiguous(random_buffer(total_q * h_q * d).data(), f64, {total_q, h_q, d});
  a.k = fa::Tensor::contiguous(random_buffer(total_k * h_k * d).data(), f64, {total_k, h_k, d});
  a.v = fa::Tensor::contiguous(random_buffer(total_k * h_k * d).data(), f64, {total_k, h_k, d});
  a.cu_seqlens_q = fa::Tensor::contiguous(ints(cu_q).data(), fa::DType::kInt32, {4});
  a.cu_seqlens_k = fa::Tensor::contiguous(ints(cu_k).data(), fa::DType::kInt32, {4});
  a.max_seqlen_q = 7;
  a.max_seqlen_k = 6;
  const fa::Tensor out = fa::Tensor::contiguous(buffer(total_q * h_q * d, kNaN).data(), f64, {total_q, h_q, d});
  std::vector<float> lse_buf(h_q * total_q, std::numeric_limits<float>::quiet_NaN());
  const fa::Tensor lse = fa::Tensor::contiguous(lse_buf.data(), fa::DType::kFloat32, {h_q, total_q});
  fa::Options opts;
  opts.causal = true;
  fa::varlen_forward(a, out, lse, opts);

  std::vector<double> ref;
  for (std::size_t sq = 0; sq + 1 < cu_q.size(); ++sq) {
    const std::int64_t s_q = cu_q[sq + 1] - cu_q[sq], s_k = cu_k[sq + 1] - cu_k[sq];
    for (std::int64_t h = 0; h < h_q; ++h) {
      for (std::int64_t i = 0; i < s_q; ++i) {
        const std::int64_t row = cu_q[sq] + i;
        const double l = naive_row([&](int c) { return at(a.q, row, h, c); },
                                   [&](std::int64_t j, int c) { return at(a.k, cu_k[sq] + j, 0, c); },
                                   [&](std::int64_t j, int c) { return at(a.v, cu_k[sq] + j, 0, c); },
                                   i, s_q, s_k, int(d), true, double(1.0f / std::sqrt(float(d))), ref);
        for (int c = 0; c < d; ++c) ASSERT_NEAR(at(out, row, h, c), ref[c], kTol);
        expect_lse(lse_buf[h * total_q + row], l);
      }
    }
  }
}

}  // namespace
