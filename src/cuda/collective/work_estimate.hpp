// Host-side estimates of a call's work that the families' configuration tables choose
// tiles by.
#pragma once

#include <algorithm>

#include "flashattn/semantics.hpp"

namespace flashattn::detail::cuda {

// Keys a query row sees on average, from the shapes and the mask alone (varlen: the
// maximum lengths). Row i sees [i + s_k - s_q - left, i + s_k - s_q + right] within
// [0, s_k): piecewise linear in i, so 64 sampled rows estimate it closely. An estimate for
// the tile choice, not a bound.
inline double mean_visible_keys(int seqlen_q, int seqlen_k, semantics::Mask mask) {
  const double s_q = seqlen_q, s_k = seqlen_k;
  if (s_q <= 0 || s_k <= 0) return 0.0;
  constexpr int kSamples = 64;
  double sum = 0.0;
  for (int t = 0; t < kSamples; ++t) {
    const double diag = (t + 0.5) * s_q / kSamples + s_k - s_q;
    const double lo = mask.left >= 0 ? std::max(0.0, diag - mask.left) : 0.0;
    const double hi = mask.right >= 0 ? std::min(s_k, diag + mask.right + 1) : s_k;
    sum += std::max(0.0, hi - lo);
  }
  return sum / kSamples;
}

}  // namespace flashattn::detail::cuda
