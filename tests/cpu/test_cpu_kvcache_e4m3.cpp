// The e4m3 format of the fp8 KV cache (semantics.hpp): the decode of every byte against
// an independent formula, encode(decode(x)) == x, and the encoder against a brute-force
// nearest-value search (ties to the even mantissa, saturation at +-448, NaN -> 0x7F)
// over random and boundary inputs.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "flashattn/semantics.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

namespace sem = flashattn::semantics;

// e4m3fn by definition: (-1)^s * 2^(e - 7) * (1 + m / 8), e = 0: 2^-6 * m / 8.
double e4m3_formula(int byte) {
  const int s = byte >> 7, e = (byte >> 3) & 15, m = byte & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

// Nearest finite e4m3 to x by search: ties go to the even byte (mantissa LSB 0);
// beyond +-448 saturate; NaN -> 0x7F.
std::uint8_t e4m3_nearest(float x) {
  if (std::isnan(x)) return 0x7F;
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::fabs(x) >= 448.0f) return static_cast<std::uint8_t>(sign | 0x7E);  // saturate
  int best = -1;
  double best_err = 0;
  for (int b = sign; b < sign + 0x7F; ++b) {  // the finite values of x's sign
    const double err = std::fabs(double(x) - e4m3_formula(b));
    if (best < 0 || err < best_err || (err == best_err && (b & 1) == 0)) {
      best = b;
      best_err = err;
    }
  }
  return static_cast<std::uint8_t>(best);
}

TEST(E4M3, DecodeEveryByte) {
  for (int b = 0; b < 256; ++b) {
    const double want = e4m3_formula(b);
    const float got = sem::e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "byte " << b;
    } else {
      EXPECT_EQ(double(got), want) << "byte " << b;
      EXPECT_EQ(std::signbit(got), (b & 0x80) != 0) << "byte " << b;
    }
  }
  EXPECT_EQ(sem::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(sem::e4m3_to_float(0x01), 0.001953125f);
}

TEST(E4M3, EncodeRoundTripsEveryValue) {
  for (int b = 0; b < 256; ++b) {
    const float v = sem::e4m3_to_float(static_cast<std::uint8_t>(b));
    const std::uint8_t want = std::isnan(v) ? 0x7F : static_cast<std::uint8_t>(b);
    EXPECT_EQ(int(sem::float_to_e4m3(v)), int(want)) << "byte " << b;
  }
}

TEST(E4M3, EncodeSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(int(sem::float_to_e4m3(inf)), 0x7E);
  EXPECT_EQ(int(sem::float_to_e4m3(-inf)), 0xFE);
  EXPECT_EQ(int(sem::float_to_e4m3(1e30f)), 0x7E);
  EXPECT_EQ(int(sem::float_to_e4m3(-449.0f)), 0xFE);
  EXPECT_EQ(int(sem::float_to_e4m3(464.0f)), 0x7E);  // would round to 480: saturates
  EXPECT_EQ(int(sem::float_to_e4m3(std::numeric_limits<float>::quiet_NaN())), 0x7F);
  EXPECT_EQ(int(sem::float_to_e4m3(-std::numeric_limits<float>::quiet_NaN())), 0x7F);
  EXPECT_EQ(int(sem::float_to_e4m3(0.0f)), 0x00);
  EXPECT_EQ(int(sem::float_to_e4m3(-0.0f)), 0x80);
  EXPECT_EQ(int(sem::float_to_e4m3(std::ldexp(1.0f, -10))), 0x00);  // half the smallest: tie to 0
  EXPECT_EQ(int(sem::float_to_e4m3(std::ldexp(3.0f, -10))), 0x02);  // 1.5 quanta: tie to even 2
  EXPECT_EQ(int(sem::float_to_e4m3(std::ldexp(1.0f, -140))), 0x00);  // fp32 subnormal
  EXPECT_EQ(int(sem::float_to_e4m3(1.0625f)), 0x38);                 // tie between 1 and 1.125
  EXPECT_EQ(int(sem::float_to_e4m3(1.1875f)), 0x3A);                 // tie between 1.125 and 1.25
}

TEST(E4M3, EncodeMatchesNearestSearch) {
  FA_SEEDED_RNG(rng);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int checked = 0;
  for (int trial = 0; trial < 40000; ++trial) {
    float x;
    switch (trial % 4) {
      case 0: x = normal(rng) * std::ldexp(1.0f, uniform_int(rng, -12, 10)); break;
      case 1: {  // exact midpoints and their neighbours between adjacent e4m3 values
        const int b = uniform_int(rng, 0, 0x7D);
        const float lo = sem::e4m3_to_float(static_cast<std::uint8_t>(b));
        const float hi = sem::e4m3_to_float(static_cast<std::uint8_t>(b + 1));
        x = 0.5f * (lo + hi);
        const int nudge = uniform_int(rng, -1, 1);
        if (nudge) x = std::nextafter(x, nudge > 0 ? hi : lo);
        if (coin(rng)) x = -x;
        break;
      }
      case 2: {  // arbitrary bit patterns (covers NaN payloads, huge, tiny)
        const std::uint32_t u = bits(rng);
        x = sem::e4m3_bits_to_float(u);
        break;
      }
      default: x = static_cast<float>(uniform_real(rng, -480.0, 480.0)); break;
    }
    ASSERT_EQ(int(sem::float_to_e4m3(x)), int(e4m3_nearest(x))) << "x = " << x;
    ++checked;
  }
  EXPECT_EQ(checked, 40000);
}

TEST(E4M3, QuantizeDividesByTheScale) {
  FA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 1000; ++trial) {
    const float x = static_cast<float>(uniform_real(rng, -50, 50));
    const float s = static_cast<float>(uniform_real(rng, 0.01, 2.0));
    EXPECT_EQ(int(sem::quantize_e4m3(x, s)), int(sem::float_to_e4m3(x / s)));
  }
}

TEST(TreeMask, BitsSelectDrafts) {
  const std::uint32_t row[2] = {0x80000005u, 0x2u};  // drafts 0, 2, 31, 33
  for (int t = 0; t < 64; ++t) {
    const bool want = t == 0 || t == 2 || t == 31 || t == 33;
    EXPECT_EQ(sem::tree_draft_visible(row, t), want) << "draft " << t;
  }
  // s_q = 40 drafts at the end of s_k = 100 keys: keys < 60 are not restricted.
  for (int j = 0; j < 100; ++j) {
    const int t = j - 60;
    const bool want = t < 0 || t == 0 || t == 2 || t == 31 || t == 33;
    EXPECT_EQ(sem::tree_key_visible(row, j, 40, 100), want) << "key " << j;
  }
}

}  // namespace
}  // namespace flashattn::test
