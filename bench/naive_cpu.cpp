// The naive CPU computation for the main job: S = scale * Q K^T for every (batch, head)
// materialised at once, a row softmax in place (S becomes P), then O = P V.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "flashattn/half.hpp"
#include "naive.hpp"

namespace bench {
namespace {
float load(const void* p, flashattn::DType dt, std::size_t i) {
  switch (dt) {
    case flashattn::DType::kFloat32: return static_cast<const float*>(p)[i];
    case flashattn::DType::kBFloat16: return flashattn::bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
    default: return flashattn::fp16_to_float(static_cast<const std::uint16_t*>(p)[i]);
  }
}
void store(void* p, flashattn::DType dt, std::size_t i, float x) {
  switch (dt) {
    case flashattn::DType::kFloat32: static_cast<float*>(p)[i] = x; break;
    case flashattn::DType::kBFloat16: static_cast<std::uint16_t*>(p)[i] = flashattn::float_to_bf16(x); break;
    default: static_cast<std::uint16_t*>(p)[i] = flashattn::float_to_fp16(x); break;
  }
}
}  // namespace

std::size_t naive_attention_cpu(const void* q, const void* k, const void* v, void* out,
                                flashattn::DType dt, int batch, int seqlen, int heads,
                                int head_dim, bool causal) {
  const std::size_t s = seqlen, d = head_dim, h = heads;
  const float scale = 1.0f / std::sqrt(float(d));
  // S/P for all heads: [batch * heads, s, s] fp32, as an unfused framework would hold it.
  std::vector<float> p(std::size_t(batch) * h * s * s);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < batch; ++b)
    for (int hh = 0; hh < heads; ++hh) {
      std::vector<float> qf(s * d), kf(s * d), vf(s * d), o(d);
      for (std::size_t i = 0; i < s; ++i)
        for (std::size_t x = 0; x < d; ++x) {
          const std::size_t src = ((b * s + i) * h + hh) * d + x;
          qf[i * d + x] = load(q, dt, src);
          kf[i * d + x] = load(k, dt, src);
          vf[i * d + x] = load(v, dt, src);
        }
      float* ps = &p[(std::size_t(b) * h + hh) * s * s];
      for (std::size_t i = 0; i < s; ++i) {
        float* row = ps + i * s;
        const std::size_t kend = causal ? i + 1 : s;
        float m = -INFINITY;
        for (std::size_t j = 0; j < kend; ++j) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (std::size_t x = 0; x < d; ++x) dot += qf[i * d + x] * kf[j * d + x];
          row[j] = dot * scale;
          m = std::max(m, row[j]);
        }
        float sum = 0.0f;
        for (std::size_t j = 0; j < kend; ++j) sum += (row[j] = std::exp(row[j] - m));
        std::fill(o.begin(), o.end(), 0.0f);
        for (std::size_t j = 0; j < kend; ++j) {
          const float pj = row[j] / sum;
#pragma omp simd
          for (std::size_t x = 0; x < d; ++x) o[x] += pj * vf[j * d + x];
        }
        for (std::size_t x = 0; x < d; ++x) store(out, dt, ((b * s + i) * h + hh) * d + x, o[x]);
      }
    }
  return p.size() * sizeof(float);
}

}  // namespace bench
