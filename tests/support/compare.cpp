#include "support/compare.hpp"

#include <cmath>
#include <cstring>
#include <sstream>

#include "support/host_tensor.hpp"

namespace flashattn::test {

ErrorStats error_stats(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats s;
  bool have_bad = false;
  for (std::size_t e = 0; e < got.size() && e < ref.size(); ++e) {
    const double g = got[e], r = ref[e];
    if (std::isnan(g)) {
      if (!have_bad) s.first_bad = e;
      have_bad = true;
      ++s.nan_count;
      continue;
    }
    if (!std::isfinite(r) || !std::isfinite(g)) {
      if (g != r) {
        if (!have_bad) s.first_bad = e;
        have_bad = true;
        ++s.nonfinite_mismatch;
      }
      continue;
    }
    s.max_abs_ref = std::max(s.max_abs_ref, std::fabs(r));
    const double err = std::fabs(g - r);
    if (err > s.max_abs_err) {
      s.max_abs_err = err;
      s.worst = e;
    }
  }
  return s;
}

::testing::AssertionResult close_to_reference(const std::string& what, const std::vector<double>& got,
                                              const std::vector<double>& ref,
                                              const std::vector<double>& naive, DType dtype,
                                              double floor_ulps, double floor_magnitude,
                                              double accum_terms) {
  if (got.size() != ref.size() || naive.size() != ref.size()) {
    return ::testing::AssertionFailure() << what << ": size mismatch (got " << got.size() << ", ref "
                                         << ref.size() << ", naive " << naive.size() << ")";
  }
  const ErrorStats g = error_stats(got, ref);
  const ErrorStats n = error_stats(naive, ref);
  const double accum_eps = dtype_epsilon(dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
  const double floor = (floor_ulps * dtype_epsilon(dtype) + std::sqrt(std::max(1.0, accum_terms)) * accum_eps) *
                       std::max(g.max_abs_ref, floor_magnitude);
  const double bound = 2.0 * n.max_abs_err + floor;
  std::ostringstream msg;
  msg.precision(6);
  if (g.nan_count || g.nonfinite_mismatch) {
    msg << what << ": " << g.nan_count << " NaN and " << g.nonfinite_mismatch
        << " non-finite mismatches of " << got.size() << "; first at [" << g.first_bad << "] got "
        << got[g.first_bad] << " ref " << ref[g.first_bad];
    return ::testing::AssertionFailure() << msg.str();
  }
  if (g.max_abs_err <= bound) return ::testing::AssertionSuccess();
  msg << what << " (" << dtype_name(dtype) << ", " << got.size() << " elements): max abs err "
      << g.max_abs_err << " at [" << g.worst << "] (got " << got[g.worst] << ", ref " << ref[g.worst]
      << ") exceeds bound " << bound << " = 2 x naive err " << n.max_abs_err << " + floor " << floor
      << " (max|ref| " << g.max_abs_ref << ", magnitude " << floor_magnitude << ", terms " << accum_terms << ")";
  return ::testing::AssertionFailure() << msg.str();
}

::testing::AssertionResult bitwise_equal(const std::string& what, const std::vector<double>& a,
                                         const std::vector<double>& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << what << ": size " << a.size() << " vs " << b.size();
  std::size_t diffs = 0, first = 0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    if (std::isnan(a[e]) || std::isnan(b[e]) || std::memcmp(&a[e], &b[e], sizeof(double)) != 0) {
      if (!diffs) first = e;
      ++diffs;
    }
  }
  if (!diffs) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << diffs << " of " << a.size()
                                       << " elements differ bitwise; first at [" << first << "]: "
                                       << a[first] << " vs " << b[first];
}

::testing::AssertionResult all_finite(const std::string& what, const std::vector<double>& v) {
  std::size_t bad = 0, first = 0;
  for (std::size_t e = 0; e < v.size(); ++e) {
    if (!std::isfinite(v[e])) {
      if (!bad) first = e;
      ++bad;
    }
  }
  if (!bad) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " non-finite of " << v.size()
                                       << "; first at [" << first << "] = " << v[first];
}

::testing::AssertionResult fully_written(const std::string& what, const std::vector<double>& v) {
  std::size_t bad = 0, first = 0;
  for (std::size_t e = 0; e < v.size(); ++e) {
    if (std::isnan(v[e])) {
      if (!bad) first = e;
      ++bad;
    }
  }
  if (!bad) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << v.size()
                                       << " elements still NaN (poison not overwritten); first at ["
                                       << first << "]";
}

}  // namespace flashattn::test
