// The tolerance rule of the suite. A backend's result `got` is compared with the fp64
// oracle `ref` on the same (dtype-rounded) inputs, and passes when
//   max |got - ref|  <=  2 * max |naive - ref|  +  floor
//   floor = (floor_ulps * eps(dtype) + sqrt(accum_terms) * eps(accum)) * M
// where `naive` is the naive computation in the same precision (reference.hpp), eps(t)
// the ulp at 1 of t, accum the accumulation type (fp64 for fp64, else fp32), accum_terms
// the length of the longest sum behind one result (its order is free), and M = max|ref|. Non-finite reference values (lse = -inf of an empty
// row) must be matched exactly; where cancellation makes the result much smaller than
// the terms it sums (gradients), the floor's magnitude is max(max|ref|, floor_magnitude)
// with floor_magnitude the largest sum of absolute terms; a NaN in `got` always fails. The failure message
// reports both errors, the bound and the worst element.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "flashattn/tensor.hpp"

namespace flashattn::test {

struct ErrorStats {
  double max_abs_err = 0;    // max |got - ref| over finite ref values
  std::size_t worst = 0;     // index of that element
  double max_abs_ref = 0;
  std::size_t nan_count = 0;
  std::size_t nonfinite_mismatch = 0;  // ref non-finite but got different (or vice versa)
  std::size_t first_bad = 0;
};
ErrorStats error_stats(const std::vector<double>& got, const std::vector<double>& ref);

inline constexpr double kDefaultFloorUlps = 4.0;

::testing::AssertionResult close_to_reference(const std::string& what, const std::vector<double>& got,
                                              const std::vector<double>& ref,
                                              const std::vector<double>& naive, DType dtype,
                                              double floor_ulps = kDefaultFloorUlps,
                                              double floor_magnitude = 0.0, double accum_terms = 1.0);

// Bit-for-bit equality (NaN == NaN of the same pattern is not needed: any NaN fails).
::testing::AssertionResult bitwise_equal(const std::string& what, const std::vector<double>& a,
                                         const std::vector<double>& b);

// Every element finite (no NaN, no inf).
::testing::AssertionResult all_finite(const std::string& what, const std::vector<double>& v);

// No NaN (lse may hold -inf): the check that a poisoned output was fully written.
::testing::AssertionResult fully_written(const std::string& what, const std::vector<double>& v);

}  // namespace flashattn::test
