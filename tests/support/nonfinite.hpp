// Checks of docs/semantics.md's rules for non-finite values (NaN, +-inf), shared by the
// CPU and GPU suites: a run with a NaN / inf planted in an input against the same run
// without it ("clean"), element by element, with a rule saying what each element must be.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "support/host_tensor.hpp"

namespace flashattn::test {

enum class Expect {
  kSame,       // exactly the clean run's value (and not NaN)
  kNan,        // NaN
  kNonFinite,  // NaN or +-inf
  kEmpty,      // the empty-row value: 0 for out / gradients, -inf for lse
  kUnchecked,  // not specified by the rules
};
const char* expect_name(Expect e);

// The rule at (sequence b, row, head, column); column -1 for an lse element.
using ExpectRule = std::function<Expect(int b, int row, int head, int col)>;

// `got` and `clean` are [B, S, H, D] (dense) or [T, H, D] (varlen: b = 0, rows packed);
// with lse_layout, [B, H, S] or [H, T]. Adds one gtest failure per mismatching element
// (the first 8 printed, then a count) and returns the number of mismatches.
std::int64_t expect_pattern(const std::string& what, const HostTensor& got, const HostTensor& clean,
                            bool lse_layout, const ExpectRule& rule);

// Another backend's run of the same inputs (the CPU backend's, for a GPU run): wherever the
// rule specifies the element (not kUnchecked), `got` is NaN exactly where `other` is, and
// finite exactly where `other` is. Returns the number of mismatches (gtest failures added).
std::int64_t expect_same_nan_pattern(const std::string& what, const HostTensor& got, const HostTensor& other,
                                     bool lse_layout, const ExpectRule& rule);

}  // namespace flashattn::test
