// The host-side work estimate the CUDA families choose tiles by (collective/work_estimate.hpp).
#include <gtest/gtest.h>

#include "cuda/collective/work_estimate.hpp"

namespace fa = flashattn;
using flashattn::detail::cuda::mean_visible_keys;

TEST(WorkEstimate, MeanVisibleKeysFollowsTheMask) {
  const auto none = fa::semantics::Mask::make(false, -1, -1);
  const auto causal = fa::semantics::Mask::make(true, -1, -1);
  EXPECT_DOUBLE_EQ(mean_visible_keys(4096, 4096, none), 4096.0);
  EXPECT_DOUBLE_EQ(mean_visible_keys(1, 777, none), 777.0);
  // Square causal: row i sees i + 1 keys, mean (s + 1) / 2 (sampled at row centres: s / 2).
  EXPECT_NEAR(mean_visible_keys(8192, 8192, causal), 4096.0, 1.0);
  // Bottom-right aligned: 300 queries over 90 keys see at most 90 keys each, the first 210 none.
  EXPECT_NEAR(mean_visible_keys(300, 90, causal), 45.5 * 90.0 / 300.0, 1.0);
  // A sliding window of 100 keys on each side, far from the edges: 201 keys.
  const auto window = fa::semantics::Mask::make(false, 100, 100);
  EXPECT_NEAR(mean_visible_keys(100000, 100000, window), 201.0, 1.0);
  EXPECT_EQ(mean_visible_keys(0, 10, none), 0.0);
  EXPECT_EQ(mean_visible_keys(10, 0, causal), 0.0);
}
