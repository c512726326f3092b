#include "support/nonfinite.hpp"

#include <cmath>
#include <sstream>

#include <gtest/gtest.h>

namespace flashattn::test {

const char* expect_name(Expect e) {
  switch (e) {
    case Expect::kSame: return "the clean run's value";
    case Expect::kNan: return "NaN";
    case Expect::kNonFinite: return "non-finite";
    case Expect::kEmpty: return "the empty-row value";
    case Expect::kUnchecked: return "anything";
  }
  return "?";
}

namespace {

// (b, row, head, col) of flat element e; col -1 in the lse layout.
struct Where {
  std::int64_t b, i, h, c;
};
struct Layout {
  std::int64_t B = 1, S = 1, H = 1, D = 1;
  bool lse = false;
  Layout(const HostTensor& t, bool lse_layout) : lse(lse_layout) {
    const int r = t.rank();
    if (lse) {
      if (r == 3) B = t.size(0);
      H = t.size(r - 2);
      S = t.size(r - 1);
    } else {
      if (r == 4) B = t.size(0);
      S = t.size(r - 3);
      H = t.size(r - 2);
      D = t.size(r - 1);
    }
  }
  Where at(std::int64_t e) const {
    if (lse) return {e / (H * S), e % S, e / S % H, -1};
    return {e / (S * H * D), e / (H * D) % S, e / D % H, e % D};
  }
};

}  // namespace

std::int64_t expect_same_nan_pattern(const std::string& what, const HostTensor& got, const HostTensor& other,
                                     bool lse_layout, const ExpectRule& rule) {
  EXPECT_EQ(got.shape(), other.shape()) << what;
  if (got.shape() != other.shape()) return 1;
  const Layout lay(got, lse_layout);
  std::int64_t bad = 0;
  std::ostringstream first;
  for (std::int64_t e = 0; e < got.numel(); ++e) {
    const Where w = lay.at(e);
    if (rule(int(w.b), int(w.i), int(w.h), int(w.c)) == Expect::kUnchecked) continue;
    const double x = got.get(e), y = other.get(e);
    if (std::isnan(x) == std::isnan(y) && std::isfinite(x) == std::isfinite(y)) continue;
    if (bad < 8) {
      first << "\n  " << what << " (b " << w.b << ", row " << w.i << ", head " << w.h;
      if (w.c >= 0) first << ", col " << w.c;
      first << "): " << x << " here, " << y << " on the other backend";
    }
    ++bad;
  }
  if (bad > 0) ADD_FAILURE() << bad << " element(s) of " << what << " differ in NaN / inf pattern:" << first.str();
  return bad;
}

std::int64_t expect_pattern(const std::string& what, const HostTensor& got, const HostTensor& clean,
                            bool lse_layout, const ExpectRule& rule) {
  EXPECT_EQ(got.shape(), clean.shape()) << what;
  if (got.shape() != clean.shape()) return 1;
  const Layout lay(got, lse_layout);
  std::int64_t bad = 0;
  std::ostringstream first;
  for (std::int64_t e = 0; e < got.numel(); ++e) {
    const Where w = lay.at(e);
    const std::int64_t b = w.b, i = w.i, h = w.h, c = w.c;
    const Expect want = rule(static_cast<int>(b), static_cast<int>(i), static_cast<int>(h), static_cast<int>(c));
    const double x = got.get(e), y = clean.get(e);
    bool ok = true;
    switch (want) {
      case Expect::kSame: ok = !std::isnan(x) && x == y; break;
      case Expect::kNan: ok = std::isnan(x); break;
      case Expect::kNonFinite: ok = !std::isfinite(x); break;
      case Expect::kEmpty: ok = lse_layout ? x == -INFINITY : x == 0.0; break;
      case Expect::kUnchecked: break;
    }
    if (!ok) {
      if (bad < 8) {
        first << "\n  " << what << " (b " << b << ", row " << i << ", head " << h;
        if (c >= 0) first << ", col " << c;
        first << "): " << x << ", expected " << expect_name(want) << " (clean run " << y << ")";
      }
      ++bad;
    }
  }
  if (bad > 0) ADD_FAILURE() << bad << " element(s) of " << what << " break the non-finite rules:" << first.str();
  return bad;
}

}  // namespace flashattn::test
