#include "support/random.hpp"

#include <cstdlib>

namespace flashattn::test {

std::uint64_t test_seed() {
  if (const char* env = std::getenv("FLASHATTN_TEST_SEED"); env && *env)
    return std::strtoull(env, nullptr, 0);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

void fill_normal(HostTensor& t, Rng& rng, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, dist(rng));
}

void fill_uniform(HostTensor& t, Rng& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, dist(rng));
}

HostTensor random_normal(DType dtype, std::vector<std::int64_t> shape, Rng& rng, double stddev) {
  HostTensor t(dtype, std::move(shape));
  fill_normal(t, rng, stddev);
  return t;
}

int uniform_int(Rng& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

double uniform_real(Rng& rng, double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(rng);
}

bool coin(Rng& rng, double p_true) { return std::bernoulli_distribution(p_true)(rng); }

std::string Shape::str() const {
  return "b=" + std::to_string(batch) + " s_q=" + std::to_string(s_q) + " s_k=" + std::to_string(s_k) +
         " h_q=" + std::to_string(h_q) + " h_k=" + std::to_string(h_k) + " d=" + std::to_string(d) +
         (d_v > 0 ? " d_v=" + std::to_string(d_v) : std::string());
}

Shape random_shape(Rng& rng, const ShapeLimits& limits) {
  Shape s;
  s.batch = uniform_int(rng, 1, limits.max_batch);
  auto length = [&] {
    switch (uniform_int(rng, 0, 3)) {
      case 0: return 1;
      case 1: return uniform_int(rng, 1, 16);
      default: return uniform_int(rng, 1, limits.max_seqlen);
    }
  };
  s.s_q = length();
  s.s_k = coin(rng, 0.25) ? s.s_q : length();
  std::vector<int> ratios;
  for (int r = 1; r <= limits.max_heads; r *= 2) ratios.push_back(r);
  const int ratio = ratios[static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(ratios.size()) - 1))];
  s.h_k = uniform_int(rng, 1, std::max(1, limits.max_heads / ratio));
  s.h_q = s.h_k * ratio;
  s.d = limits.head_dims[static_cast<std::size_t>(
      uniform_int(rng, 0, static_cast<int>(limits.head_dims.size()) - 1))];
  return s;
}

std::vector<int> random_cu_seqlens(Rng& rng, int batch, int max_len, bool allow_empty) {
  std::vector<int> cu(static_cast<std::size_t>(batch) + 1, 0);
  for (int b = 0; b < batch; ++b) {
    int len = uniform_int(rng, allow_empty ? 0 : 1, max_len);
    if (allow_empty && coin(rng, 0.2)) len = 0;
    cu[static_cast<std::size_t>(b) + 1] = cu[static_cast<std::size_t>(b)] + len;
  }
  return cu;
}

}  // namespace flashattn::test
