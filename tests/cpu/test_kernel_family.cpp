// The CUDA kernel-family choice without a GPU: choose_kernel_family is a pure function of
// (compute capability, opt-in shared memory, request, sm90 built), the environment parse
// a pure function of the variables' values, and the Options fields are validated for
// every backend.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/kernel_family.hpp"
#include "flashattn/attention.hpp"

namespace fa = flashattn;
using fa::KernelFamily;
using fa::detail::choose_kernel_family;
using fa::detail::KernelRequest;
using fa::detail::parse_kernel_env;

namespace {

constexpr int kH200Smem = 227 * 1024;
constexpr int kA100Smem = 163 * 1024;
constexpr int k99K = 99 * 1024;

TEST(KernelFamily, AutoTakesSm90OnlyOnHopperWhenBuilt) {
  EXPECT_EQ(choose_kernel_family("forward", 90, kH200Smem, {}, true).family, KernelFamily::kSm90);
  EXPECT_EQ(choose_kernel_family("forward", 90, kH200Smem, {}, false).family, KernelFamily::kSm80);
  for (int cc : {80, 86, 87, 89, 100, 103, 120}) {
    EXPECT_EQ(choose_kernel_family("forward", cc, kA100Smem, {}, true).family, KernelFamily::kSm80)
        << "cc " << cc;
  }
}

TEST(KernelFamily, ForcedSm80RunsEverywhereFromAmpere) {
  const KernelRequest sm80{KernelFamily::kSm80, 0};
  for (int cc : {80, 86, 89, 90, 100, 120}) {
    EXPECT_EQ(choose_kernel_family("forward", cc, kH200Smem, sm80, true).family, KernelFamily::kSm80);
  }
}

TEST(KernelFamily, ForcedSm90ElsewhereNamesTheCapability) {
  const KernelRequest sm90{KernelFamily::kSm90, 0};
  EXPECT_EQ(choose_kernel_family("forward", 90, kH200Smem, sm90, true).family, KernelFamily::kSm90);
  // Not built: still sm90 here; the family's own check falls back to sm80.
  EXPECT_EQ(choose_kernel_family("forward", 90, kH200Smem, sm90, false).family, KernelFamily::kSm90);
  for (int cc : {80, 86, 100, 120}) {
    try {
      choose_kernel_family("forward", cc, kH200Smem, sm90, true);
      ADD_FAILURE() << "cc " << cc << " accepted sm90";
    } catch (const fa::Unsupported& e) {
      EXPECT_EQ(e.argument(), "opts.kernel_family");
      EXPECT_NE(e.actual().find(fa::detail::compute_capability_string(cc)), std::string::npos) << e.what();
    }
  }
}

TEST(KernelFamily, BelowAmpereIsUnsupportedNamingTheCapability) {
  for (int cc : {0, 61, 70, 75}) {
    try {
      choose_kernel_family("forward", cc, 64 * 1024, {}, true);
      ADD_FAILURE() << "cc " << cc << " accepted";
    } catch (const fa::Unsupported& e) {
      EXPECT_EQ(e.actual(), fa::detail::compute_capability_string(cc));
    }
  }
  EXPECT_EQ(fa::detail::compute_capability_string(75), "compute capability 7.5");
}

TEST(KernelFamily, SmemCapLowersTheDeviceLimitOnly) {
  EXPECT_EQ(choose_kernel_family("forward", 90, kH200Smem, {}, true).smem_limit, kH200Smem);
  EXPECT_EQ(choose_kernel_family("forward", 90, kH200Smem, {KernelFamily::kSm80, k99K}, true).smem_limit, k99K);
  EXPECT_EQ(choose_kernel_family("forward", 86, k99K, {KernelFamily::kAuto, kA100Smem}, true).smem_limit, k99K);
}

TEST(KernelEnv, ParsesFamilyAndCap) {
  auto env = parse_kernel_env(nullptr, nullptr);
  EXPECT_TRUE(env.family.ok && env.smem_cap.ok);
  EXPECT_EQ(env.request.family, KernelFamily::kAuto);
  EXPECT_EQ(env.request.smem_cap, 0);
  env = parse_kernel_env("", "");
  EXPECT_TRUE(env.family.ok && env.smem_cap.ok);
  EXPECT_EQ(parse_kernel_env("sm80", nullptr).request.family, KernelFamily::kSm80);
  EXPECT_EQ(parse_kernel_env("sm90", nullptr).request.family, KernelFamily::kSm90);
  EXPECT_EQ(parse_kernel_env("auto", nullptr).request.family, KernelFamily::kAuto);
  EXPECT_EQ(parse_kernel_env(nullptr, "101376").request.smem_cap, 101376);
  EXPECT_EQ(parse_kernel_env(nullptr, "0").request.smem_cap, 0);
}

TEST(KernelEnv, RejectsMalformedValuesNamingTheVariable) {
  for (const char* v : {"SM80", "sm_80", "hopper", " sm80"}) {
    const auto env = parse_kernel_env(v, nullptr);
    EXPECT_FALSE(env.family.ok) << v;
    EXPECT_NE(env.family.name.find("FLASHATTN_KERNEL_FAMILY"), std::string::npos);
    EXPECT_EQ(env.family.actual, std::string("'") + v + "'");
  }
  for (const char* v : {"-1", "1000", "101375", "99k", "abc", "1e6", "+101376", "99999999999999"}) {
    const auto env = parse_kernel_env(nullptr, v);
    EXPECT_FALSE(env.smem_cap.ok) << v;
    EXPECT_NE(env.smem_cap.name.find("FLASHATTN_SMEM_CAP"), std::string::npos);
  }
}

// Options fields are checked on every backend: a CPU call with a bad value fails.
TEST(KernelOptions, InvalidValuesAreInvalidArguments) {
  std::vector<float> buf(2 * 3 * 2 * 8, 0.5f);
  const auto t = fa::Tensor::contiguous(buf.data(), fa::DType::kFloat32, {2, 3, 2, 8});
  std::vector<float> out(buf.size()), lse(2 * 2 * 3);
  const auto o = fa::Tensor::contiguous(out.data(), fa::DType::kFloat32, {2, 3, 2, 8});
  const auto l = fa::Tensor::contiguous(lse.data(), fa::DType::kFloat32, {2, 2, 3});
  fa::Options opts;
  opts.smem_cap = 4096;
  try {
    fa::forward(t, t, t, o, l, opts);
    ADD_FAILURE() << "smem_cap 4096 accepted";
  } catch (const fa::InvalidArgument& e) {
    EXPECT_EQ(e.argument(), "opts.smem_cap");
    EXPECT_EQ(e.actual(), "4096");
  }
  opts = {};
  opts.kernel_family = static_cast<KernelFamily>(7);
  EXPECT_THROW(fa::forward(t, t, t, o, l, opts), fa::InvalidArgument);
  // Valid values are accepted on the CPU (they only steer CUDA calls).
  opts = {};
  opts.kernel_family = KernelFamily::kSm80;
  opts.smem_cap = 101376;
  EXPECT_NO_THROW(fa::forward(t, t, t, o, l, opts));
}

}  // namespace
