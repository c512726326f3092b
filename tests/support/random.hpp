// Random inputs for the tests. Every test draws a fresh seed (std::random_device)
// unless FLASHATTN_TEST_SEED is set, and records it with SCOPED_TRACE so that a
// failure prints the seed that reproduces it:
//   FLASHATTN_TEST_SEED=<seed> ./flashattn_tests --gtest_filter=<test>
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/host_tensor.hpp"

namespace flashattn::test {

using Rng = std::mt19937_64;

// FLASHATTN_TEST_SEED when set, else a fresh std::random_device draw.
std::uint64_t test_seed();

// Declares `Rng name` seeded by test_seed() and traces the seed for failure messages.
#define FA_SEEDED_RNG(name)                                                              \
  const std::uint64_t name##_seed = ::flashattn::test::test_seed();                      \
  SCOPED_TRACE("seed " + std::to_string(name##_seed) +                                    \
               " (rerun with FLASHATTN_TEST_SEED=" + std::to_string(name##_seed) + ")"); \
  ::flashattn::test::Rng name(name##_seed)

// Normal(0, stddev) values, rounded to the tensor's dtype.
void fill_normal(HostTensor& t, Rng& rng, double stddev = 1.0);
void fill_uniform(HostTensor& t, Rng& rng, double lo, double hi);
HostTensor random_normal(DType dtype, std::vector<std::int64_t> shape, Rng& rng, double stddev = 1.0);

int uniform_int(Rng& rng, int lo, int hi);  // inclusive
double uniform_real(Rng& rng, double lo, double hi);
bool coin(Rng& rng, double p_true = 0.5);

// A random dense-attention shape within limits, including the awkward cases
// (length 1, s_q != s_k, odd head dims, every GQA ratio).
struct Shape {
  int batch = 1, s_q = 1, s_k = 1, h_q = 1, h_k = 1, d = 1;
  int d_v = 0;  // head dim of v (0 = d)
  int dv() const { return d_v > 0 ? d_v : d; }
  std::string str() const;
};
struct ShapeLimits {
  int max_batch = 3;
  int max_seqlen = 80;
  int max_heads = 8;
  std::vector<int> head_dims = {1, 3, 8, 17, 32, 64, 80};
};
Shape random_shape(Rng& rng, const ShapeLimits& limits = {});

// Random cu_seqlens of `batch` sequences with lengths in [0, max_len], zero-length ones
// included when allow_empty; returns batch + 1 offsets starting at 0.
std::vector<int> random_cu_seqlens(Rng& rng, int batch, int max_len, bool allow_empty);

}  // namespace flashattn::test
