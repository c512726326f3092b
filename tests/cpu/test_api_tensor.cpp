// Tensor view helpers, error formatting and the host fp16/bf16 conversions.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "flashattn/attention.hpp"
#include "flashattn/half.hpp"

namespace fa = flashattn;
using ::testing::HasSubstr;

namespace {

TEST(ApiTensor, DtypeSizesAndNames) {
  EXPECT_EQ(fa::dtype_size(fa::DType::kFloat16), 2u);
  EXPECT_EQ(fa::dtype_size(fa::DType::kBFloat16), 2u);
  EXPECT_EQ(fa::dtype_size(fa::DType::kFloat32), 4u);
  EXPECT_EQ(fa::dtype_size(fa::DType::kFloat64), 8u);
  EXPECT_EQ(fa::dtype_size(fa::DType::kFloat8E4M3), 1u);
  EXPECT_EQ(fa::dtype_size(fa::DType::kInt32), 4u);
  EXPECT_STREQ(fa::dtype_name(fa::DType::kFloat16), "float16");
  EXPECT_STREQ(fa::dtype_name(fa::DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(fa::dtype_name(fa::DType::kFloat32), "float32");
  EXPECT_STREQ(fa::dtype_name(fa::DType::kFloat64), "float64");
  EXPECT_STREQ(fa::dtype_name(fa::DType::kFloat8E4M3), "float8_e4m3");
  EXPECT_STREQ(fa::dtype_name(fa::DType::kInt32), "int32");
}

TEST(ApiTensor, DeviceToString) {
  EXPECT_EQ(fa::to_string(fa::Device::cpu()), "cpu");
  EXPECT_EQ(fa::to_string(fa::Device::cuda(3)), "cuda:3");
  EXPECT_TRUE(fa::Device::cuda(1) == fa::Device::cuda(1));
  EXPECT_FALSE(fa::Device::cuda(0) == fa::Device::cuda(1));
  EXPECT_FALSE(fa::Device::cpu() == fa::Device::cuda(0));
}

TEST(ApiTensor, ContiguousStridesAndNumel) {
  float buf[1];
  const fa::Tensor t = fa::Tensor::contiguous(buf, fa::DType::kFloat32, {2, 3, 5, 7});
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.rank, 4);
  EXPECT_EQ(t.numel(), 2 * 3 * 5 * 7);
  EXPECT_EQ(t.stride[0], 3 * 5 * 7);
  EXPECT_EQ(t.stride[1], 5 * 7);
  EXPECT_EQ(t.stride[2], 7);
  EXPECT_EQ(t.stride[3], 1);
  EXPECT_EQ(t.data, buf);
  EXPECT_EQ(fa::shape_string(t), "[2, 3, 5, 7]");

  const fa::Tensor v = fa::Tensor::contiguous(buf, fa::DType::kInt32, {9}, fa::Device::cuda(1));
  EXPECT_EQ(v.rank, 1);
  EXPECT_EQ(v.stride[0], 1);
  EXPECT_EQ(v.numel(), 9);
  EXPECT_TRUE(v.device == fa::Device::cuda(1));
  EXPECT_EQ(fa::shape_string(v), "[9]");

  const fa::Tensor empty = fa::Tensor::contiguous(nullptr, fa::DType::kFloat16, {4, 0, 2});
  EXPECT_EQ(empty.numel(), 0);
}

// Sizes of up to 2^31 - 1 each (what the checks allow) overflow int64 in four dimensions:
// numel saturates instead of wrapping (signed overflow, undefined behaviour).
TEST(ApiTensor, NumelSaturatesOnOverflow) {
  constexpr std::int64_t kBig = (std::int64_t(1) << 31) - 1;
  fa::Tensor t;
  t.rank = 4;
  for (int i = 0; i < 4; ++i) t.shape[i] = kBig;
  EXPECT_EQ(t.numel(), std::numeric_limits<std::int64_t>::max());
  t.shape[3] = 0;
  EXPECT_EQ(t.numel(), 0);
  t.shape[3] = 2;
  t.shape[0] = 1;
  EXPECT_EQ(t.numel(), kBig * kBig * 2);
}

TEST(ApiTensor, UndefinedTensor) {
  const fa::Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(fa::shape_string(t), "[]");
}

TEST(ApiTensor, StridedKeepsStrides) {
  float buf[1];
  const fa::Tensor t =
      fa::Tensor::strided(buf, fa::DType::kFloat32, {2, 16, 4, 64}, {3 * 16 * 4 * 64, 3 * 4 * 64, 64, 1});
  EXPECT_EQ(t.rank, 4);
  EXPECT_EQ(t.stride[0], 3 * 16 * 4 * 64);
  EXPECT_EQ(t.stride[1], 3 * 4 * 64);
  EXPECT_EQ(t.stride[2], 64);
  EXPECT_EQ(t.stride[3], 1);
  EXPECT_EQ(t.shape[1], 16);
}

TEST(ApiTensor, BadRanksAreRejected) {
  float buf[1];
  EXPECT_THROW(fa::Tensor::contiguous(buf, fa::DType::kFloat32, {}), fa::InvalidArgument);
  EXPECT_THROW(fa::Tensor::contiguous(buf, fa::DType::kFloat32, {1, 2, 3, 4, 5}),
               fa::InvalidArgument);
  EXPECT_THROW(fa::Tensor::strided(buf, fa::DType::kFloat32, {1, 2, 3, 4, 5}, {1, 1, 1, 1, 1}),
               fa::InvalidArgument);
  try {
    fa::Tensor::strided(buf, fa::DType::kFloat32, {2, 3}, {3});
    FAIL() << "mismatched stride count accepted";
  } catch (const fa::InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'stride'"));
    EXPECT_THAT(e.what(), HasSubstr("expected 2 strides"));
    EXPECT_THAT(e.what(), HasSubstr("got 1"));
  }
}

TEST(ApiTensor, InvalidArgumentMessageFormat) {
  const fa::InvalidArgument e("forward", "k", "shape[3] == 64 (head dim of q)", "32");
  EXPECT_STREQ(e.what(),
               "flashattn::forward: argument 'k': expected shape[3] == 64 (head dim of q), got 32");
  EXPECT_EQ(e.function(), "forward");
  EXPECT_EQ(e.argument(), "k");
  EXPECT_EQ(e.expected(), "shape[3] == 64 (head dim of q)");
  EXPECT_EQ(e.actual(), "32");
  const fa::Unsupported u("backward", "q", "d in [1, 256]", "d = 300");
  const fa::InvalidArgument& base = u;
  EXPECT_STREQ(base.what(), "flashattn::backward: argument 'q': expected d in [1, 256], got d = 300");
}

TEST(ApiTensor, VersionAndCudaAvailability) {
  EXPECT_STREQ(fa::version(), "0.1.0");
#if !defined(FLASHATTN_WITH_CUDA)
  EXPECT_FALSE(fa::cuda_available());
#endif
}

// Round trips of every 16-bit pattern: float(x) converts back to x exactly
// (NaNs stay NaN), for both formats.
TEST(ApiHalf, Fp16RoundTripsEveryPattern) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = fa::fp16_to_float(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fa::fp16_to_float(fa::float_to_fp16(f)))) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(fa::float_to_fp16(f), h) << std::hex << bits;
  }
}

TEST(ApiHalf, Bf16RoundTripsEveryPattern) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = fa::bf16_to_float(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fa::bf16_to_float(fa::float_to_bf16(f)))) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(fa::float_to_bf16(f), h) << std::hex << bits;
  }
}

TEST(ApiHalf, Fp16KnownValues) {
  EXPECT_EQ(fa::float_to_fp16(1.0f), 0x3c00u);
  EXPECT_EQ(fa::float_to_fp16(-2.0f), 0xc000u);
  EXPECT_EQ(fa::float_to_fp16(65504.0f), 0x7bffu);
  EXPECT_EQ(fa::float_to_fp16(65520.0f), 0x7c00u);  // rounds up to inf
  EXPECT_EQ(fa::float_to_fp16(std::numeric_limits<float>::infinity()), 0x7c00u);
  EXPECT_EQ(fa::float_to_fp16(5.9604644775390625e-8f), 0x0001u);  // smallest subnormal
  EXPECT_EQ(fa::float_to_fp16(2.98023223876953125e-8f), 0x0000u);  // half of it: ties to even
  EXPECT_EQ(fa::float_to_fp16(-0.0f), 0x8000u);
  EXPECT_FLOAT_EQ(fa::fp16_to_float(0x3555u), 0.333251953125f);
}

TEST(ApiHalf, Bf16KnownValues) {
  EXPECT_EQ(fa::float_to_bf16(1.0f), 0x3f80u);
  EXPECT_EQ(fa::float_to_bf16(-1.0f), 0xbf80u);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(fa::float_to_bf16(1.00390625f), 0x3f80u);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(fa::float_to_bf16(1.01171875f), 0x3f82u);
}

// Random floats round to the nearest representable value: no neighbour of the
// result (the next pattern up or down, when it is a number) is closer.
template <typename ToFloat>
void expect_nearest(float x, std::uint16_t h, ToFloat to_float) {
  const float r = to_float(h);
  for (const std::uint16_t n : {static_cast<std::uint16_t>(h + 1), static_cast<std::uint16_t>(h - 1)}) {
    const float neighbour = to_float(n);
    if (std::isnan(neighbour)) continue;
    ASSERT_LE(std::fabs(r - x), std::fabs(neighbour - x)) << "x = " << x << ", result " << r;
  }
}

TEST(ApiHalf, RandomRoundingIsNearest) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-60000.0f, 60000.0f);
  for (int n = 0; n < 100000; ++n) {
    const float x = dist(rng) * (n % 2 ? 1.0f : 1e-4f);
    expect_nearest(x, fa::float_to_fp16(x), fa::fp16_to_float);
    expect_nearest(x, fa::float_to_bf16(x), fa::bf16_to_float);
    if (testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
