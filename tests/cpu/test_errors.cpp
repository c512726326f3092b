// Argument checking: every malformed call is rejected before anything is written,
// with an error naming the argument, the expected value and the actual one.
//
// These tests exercise the rejection paths only; a call that passes the checks reaches
// the backend (ApiAccepts* tests make sure the valid baselines do).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "api/dispatch.hpp"
#include "core/backend.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/half.hpp"

namespace fa = flashattn;
using ::testing::HasSubstr;

namespace {

enum class Kind { kInvalid, kUnsupported };

// Owns the memory behind every tensor of a test; snapshots it all to prove that a
// rejected call wrote nothing.
class Pool {
 public:
  enum class Fill { kRandom, kNaN };

  explicit Pool(unsigned seed) : rng_(seed) {}

  fa::Tensor tensor(fa::DType dtype, std::initializer_list<std::int64_t> shape,
                    Fill fill = Fill::kRandom) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    std::vector<std::byte>& buf = buffer(static_cast<std::size_t>(n) * fa::dtype_size(dtype));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = fill == Fill::kNaN ? std::numeric_limits<float>::quiet_NaN() : dist(rng_);
      std::byte* at = buf.data() + i * static_cast<std::int64_t>(fa::dtype_size(dtype));
      store(dtype, x, at);
    }
    return fa::Tensor::contiguous(buf.data(), dtype, shape);
  }

  fa::Tensor int32(const std::vector<std::int32_t>& values) {
    std::vector<std::byte>& buf = buffer(values.size() * sizeof(std::int32_t));
    std::memcpy(buf.data(), values.data(), buf.size());
    return fa::Tensor::contiguous(buf.data(), fa::DType::kInt32,
                                  {static_cast<std::int64_t>(values.size())});
  }

  fa::Tensor int32_2d(std::int64_t rows, std::int64_t cols, const std::vector<std::int32_t>& values) {
    fa::Tensor t = int32(values);
    t.rank = 2;
    t.shape[0] = rows, t.shape[1] = cols;
    t.stride[0] = cols, t.stride[1] = 1;
    return t;
  }

  std::vector<std::vector<std::byte>> snapshot() const {
    std::vector<std::vector<std::byte>> copy;
    for (const auto& b : buffers_) copy.push_back(*b);
    return copy;
  }

 private:
  std::vector<std::byte>& buffer(std::size_t bytes) {
    // One spare element on each side, so tests can shift a pointer off alignment.
    buffers_.push_back(std::make_unique<std::vector<std::byte>>(bytes + 16));
    return *buffers_.back();
  }

  static void store(fa::DType dtype, float x, std::byte* at) {
    switch (dtype) {
      case fa::DType::kFloat16: {
        const std::uint16_t h = fa::float_to_fp16(x);
        std::memcpy(at, &h, 2);
        break;
      }
      case fa::DType::kBFloat16: {
        const std::uint16_t h = fa::float_to_bf16(x);
        std::memcpy(at, &h, 2);
        break;
      }
      case fa::DType::kFloat64: {
        const double d = x;
        std::memcpy(at, &d, 8);
        break;
      }
      case fa::DType::kFloat8E4M3:
        *at = std::byte{0x7f};  // the e4m3 NaN; random content is irrelevant for rejections
        break;
      case fa::DType::kInt32: {
        const std::int32_t v = 0;
        std::memcpy(at, &v, 4);
        break;
      }
      case fa::DType::kFloat32:
        std::memcpy(at, &x, 4);
        break;
    }
  }

  std::mt19937 rng_;
  std::vector<std::unique_ptr<std::vector<std::byte>>> buffers_;
};

template <typename Call>
std::string rejection_message(const Pool& pool, Kind kind, Call&& call) {
  const auto before = pool.snapshot();
  std::string message;
  try {
    call();
    ADD_FAILURE() << "the call was accepted";
  } catch (const fa::Unsupported& e) {
    message = e.what();
    if (kind != Kind::kUnsupported) ADD_FAILURE() << "Unsupported, expected InvalidArgument: " << message;
  } catch (const fa::InvalidArgument& e) {
    message = e.what();
    if (kind != Kind::kInvalid) ADD_FAILURE() << "InvalidArgument, expected Unsupported: " << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an argument error: " << e.what();
  }
  EXPECT_TRUE(pool.snapshot() == before) << "a rejected call wrote memory";
  return message;
}

// The call must be rejected with an error of `kind` whose message contains every part.
#define EXPECT_REJECTED(kind, call, ...)                                        \
  do {                                                                          \
    const std::string message_ = rejection_message(pool_, kind, [&] { call; }); \
    for (const char* part_ : {__VA_ARGS__}) EXPECT_THAT(message_, HasSubstr(part_)); \
  } while (0)

// A valid call gets past argument checking: it either runs or fails in the backend
// with something other than an argument error.
template <typename Call>
void expect_accepted(Call&& call) {
  try {
    call();
  } catch (const fa::InvalidArgument& e) {
    ADD_FAILURE() << "a valid call was rejected: " << e.what();
  } catch (const fa::Error&) {
    // The backend is not there yet (or failed for its own reasons): checking passed.
  }
}

class ErrorsTest : public ::testing::Test {
 protected:
  ErrorsTest() : seed_(std::random_device{}()), pool_(seed_) {}
  void SetUp() override { RecordProperty("seed", std::to_string(seed_)); }
  unsigned seed_;
  Pool pool_;
};

// ------------------------------------------------------------------ dense forward / backward

// b = 2, s_q = 5, s_k = 7, h_q = 4, h_k = 2, d = 8, fp32; outputs poisoned with NaN.
class ErrorsDense : public ErrorsTest {
 protected:
  static constexpr std::int64_t b = 2, s_q = 5, s_k = 7, h_q = 4, h_k = 2, d = 8;
  const fa::DType f32 = fa::DType::kFloat32;
  const Pool::Fill nan = Pool::Fill::kNaN;
  fa::Tensor q = pool_.tensor(f32, {b, s_q, h_q, d});
  fa::Tensor k = pool_.tensor(f32, {b, s_k, h_k, d});
  fa::Tensor v = pool_.tensor(f32, {b, s_k, h_k, d});
  fa::Tensor out = pool_.tensor(f32, {b, s_q, h_q, d}, nan);
  fa::Tensor lse = pool_.tensor(f32, {b, h_q, s_q}, nan);
  fa::Tensor dout = pool_.tensor(f32, {b, s_q, h_q, d});
  fa::Tensor lse_in = pool_.tensor(f32, {b, h_q, s_q});
  fa::Tensor dq = pool_.tensor(f32, {b, s_q, h_q, d}, nan);
  fa::Tensor dk = pool_.tensor(f32, {b, s_k, h_k, d}, nan);
  fa::Tensor dv = pool_.tensor(f32, {b, s_k, h_k, d}, nan);
  fa::Options opts;

  void fwd() { fa::forward(q, k, v, out, lse, opts); }
  void bwd(fa::Workspace ws = {}) {
    fa::backward(dout, q, k, v, out, lse_in, dq, dk, dv, opts, ws);
  }
};

TEST_F(ErrorsDense, ValidBaselinesAreAccepted) {
  expect_accepted([&] { fwd(); });
  expect_accepted([&] { bwd(); });
  EXPECT_NO_THROW(fa::backward_workspace_size(q, k, v, opts));
}

TEST_F(ErrorsDense, EmptyProblemsAreAccepted) {
  fa::Tensor q0 = pool_.tensor(f32, {0, s_q, h_q, d}), k0 = pool_.tensor(f32, {0, s_k, h_k, d});
  fa::Tensor o0 = pool_.tensor(f32, {0, s_q, h_q, d}, nan), l0 = pool_.tensor(f32, {0, h_q, s_q}, nan);
  expect_accepted([&] { fa::forward(q0, k0, k0, o0, l0, opts); });
  fa::Tensor qs = pool_.tensor(f32, {b, 0, h_q, d}), os = pool_.tensor(f32, {b, 0, h_q, d}, nan);
  fa::Tensor ls = pool_.tensor(f32, {b, h_q, 0}, nan);
  expect_accepted([&] { fa::forward(qs, k, v, os, ls, opts); });
  fa::Tensor ks = pool_.tensor(f32, {b, 0, h_k, d});
  expect_accepted([&] { fa::forward(q, ks, ks, out, lse, opts); });
}

TEST_F(ErrorsDense, QRank) {
  q.rank = 3;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "flashattn::forward: argument 'q': expected rank 4 [b, s_q, h_q, d], got rank 3 [2, 5, 4]");
}

TEST_F(ErrorsDense, QUndefined) {
  q = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'q': expected a defined tensor, got an undefined tensor (rank 0)");
}

TEST_F(ErrorsDense, KHeadDim) {
  k = pool_.tensor(f32, {b, s_k, h_k, 4});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "flashattn::forward: argument 'k': expected shape[3] == 8 (head dim of q), got 4");
}

TEST_F(ErrorsDense, KBatch) {
  k = pool_.tensor(f32, {3, s_k, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k'", "expected shape[0] == 2 (batch of q)", "got 3");
}

TEST_F(ErrorsDense, HeadsNotAMultiple) {
  k = pool_.tensor(f32, {b, s_k, 3, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k'", "expected shape[2] (h_k) >= 1 and dividing h_q = 4", "got 3");
}

TEST_F(ErrorsDense, ZeroQueryHeads) {
  q = pool_.tensor(f32, {b, s_q, 0, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'q'", "expected shape[2] (h_q) >= 1", "got 0");
}

TEST_F(ErrorsDense, VSeqlenDiffersFromK) {
  v = pool_.tensor(f32, {b, 6, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'v': expected shape [2, 7, 2, 8] (same as k but any head dim d_v), got [2, 6, 2, 8]");
}

TEST_F(ErrorsDense, OutShape) {
  out = pool_.tensor(f32, {b, s_q, h_q, 4}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'out': expected shape [2, 5, 4, 8] (same as q but the head dim d_v of v), got [2, 5, 4, 4]");
}

TEST_F(ErrorsDense, OutDtype) {
  out = pool_.tensor(fa::DType::kFloat16, {b, s_q, h_q, d}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected dtype float32 (same as q), got float16");
}

TEST_F(ErrorsDense, KDtype) {
  k = pool_.tensor(fa::DType::kFloat64, {b, s_k, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k': expected dtype float32 (same as q), got float64");
}

TEST_F(ErrorsDense, LseDtype) {
  lse = pool_.tensor(fa::DType::kFloat16, {b, h_q, s_q}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected dtype float32, got float16");
}

TEST_F(ErrorsDense, LseShape) {
  lse = pool_.tensor(f32, {b, s_q, h_q}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected shape [2, 4, 5] ([b, h_q, s_q]), got [2, 5, 4]");
}

TEST_F(ErrorsDense, LastDimNotContiguous) {
  q = fa::Tensor::strided(q.data, f32, {b, s_q, h_q, d / 2}, {s_q * h_q * d, h_q * d, d, 2});
  k = pool_.tensor(f32, {b, s_k, h_k, d / 2});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'q': expected stride[3] == 1 (contiguous last dimension), got 2");
}

TEST_F(ErrorsDense, NegativeStride) {
  k.stride[1] = -k.stride[1];
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k': expected non-negative strides, got stride[1] = -16");
}

TEST_F(ErrorsDense, NegativeSize) {
  v.shape[1] = -7;
  k.shape[1] = -7;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k': expected non-negative sizes, got shape [2, -7, 2, 8]");
}

TEST_F(ErrorsDense, MisalignedOnCpu) {
  v.data = static_cast<std::byte*>(v.data) + 2;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v': expected data aligned to 4 bytes (the size of float32), got address 0x");
}

TEST_F(ErrorsDense, NullData) {
  out.data = nullptr;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected non-null data for a tensor of shape [2, 5, 4, 8], got nullptr");
}

TEST_F(ErrorsDense, HeadDimUnsupportedOnCpu) {
  q = pool_.tensor(f32, {1, 2, 1, 600});
  k = pool_.tensor(f32, {1, 2, 1, 600});
  v = pool_.tensor(f32, {1, 2, 1, 600});
  out = pool_.tensor(f32, {1, 2, 1, 600}, nan);
  lse = fa::Tensor{};
  EXPECT_REJECTED(Kind::kUnsupported, fwd(), "argument 'q': expected head dim d in [1, 512] (CPU backend), got d = 600");
}

TEST_F(ErrorsDense, Fp8NeedsA16BitOut) {
  const fa::DType f8 = fa::DType::kFloat8E4M3;
  q = pool_.tensor(f8, {b, s_q, h_q, d});
  k = pool_.tensor(f8, {b, s_k, h_k, d});
  v = pool_.tensor(f8, {b, s_k, h_k, d});
  out = pool_.tensor(f8, {b, s_q, h_q, d}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out'", "bfloat16 or float16", "got float8_e4m3");
}

TEST_F(ErrorsDense, Fp8OutputsMustNotOverlapADescale) {
  // The CUDA fp8 kernel reads the descales while it writes out and lse: an output over a
  // descale is an InvalidArgument naming both (on every backend, as kvcache_forward's).
  const fa::DType f8 = fa::DType::kFloat8E4M3;
  q = pool_.tensor(f8, {b, s_q, h_q, d});
  k = pool_.tensor(f8, {b, s_k, h_k, d});
  v = pool_.tensor(f8, {b, s_k, h_k, d});
  out = pool_.tensor(fa::DType::kBFloat16, {b, s_q, h_q, d}, nan);
  expect_accepted([&] { fwd(); });
  opts.v_descale = fa::Tensor::contiguous(lse.data, f32, {b, h_k});  // lse's first 4 floats
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected memory disjoint from input 'opts.v_descale'");
}

TEST_F(ErrorsDense, IntegerInputs) {
  const fa::DType i32 = fa::DType::kInt32;
  q = pool_.tensor(i32, {b, s_q, h_q, d});
  k = pool_.tensor(i32, {b, s_k, h_k, d});
  v = pool_.tensor(i32, {b, s_k, h_k, d});
  out = pool_.tensor(i32, {b, s_q, h_q, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'q': expected a floating-point dtype, got int32");
}

TEST_F(ErrorsDense, MixedDevices) {
  k.device = fa::Device::cuda(0);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k': expected device cpu (same as q), got cuda:0");
}

TEST_F(ErrorsDense, CudaTensorsWithoutAGpu) {
  if (fa::cuda_available()) GTEST_SKIP() << "a GPU is visible: the CUDA path is tested in tests/cuda";
  for (fa::Tensor* t : {&q, &k, &v, &out, &lse}) t->device = fa::Device::cuda(0);
  EXPECT_REJECTED(Kind::kUnsupported, fwd(), "argument 'q'", "got ", "cuda:0");
  const std::string message = rejection_message(pool_, Kind::kUnsupported, [&] { fwd(); });
  if (!fa::detail::cuda::built()) {
    EXPECT_THAT(message, HasSubstr("a build without CUDA"));
  } else {
    EXPECT_THAT(message, HasSubstr("no CUDA device visible"));
  }
}

TEST_F(ErrorsDense, BackendOptionDisagreesWithDevice) {
  opts.backend = fa::Backend::kCUDA;
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'opts.backend': expected Backend::kAuto or Backend::kCPU (the tensors are on cpu), got Backend::kCUDA");
}

TEST_F(ErrorsDense, WindowLeft) {
  opts.window_left = -3;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.window_left': expected >= -1, got -3");
}

TEST_F(ErrorsDense, WindowRight) {
  opts.window_right = -2;
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "flashattn::backward: argument 'opts.window_right': expected >= -1, got -2");
}

TEST_F(ErrorsDense, DropoutOne) {
  opts.dropout_p = 1.0f;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.dropout_p': expected a value in [0, 1), got 1");
}

TEST_F(ErrorsDense, DropoutNegative) {
  opts.dropout_p = -0.25f;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.dropout_p'", "got -0.25");
}

TEST_F(ErrorsDense, DropoutNaN) {
  opts.dropout_p = std::numeric_limits<float>::quiet_NaN();
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.dropout_p'", "got nan");
}

TEST_F(ErrorsDense, SoftmaxScaleInfinite) {
  opts.softmax_scale = -std::numeric_limits<float>::infinity();
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.softmax_scale': expected a finite value (or unset for 1/sqrt(d)), got -inf");
}

// NaN is no longer the default's sentinel (an unset optional is): it must not silently
// mean 1/sqrt(d).
TEST_F(ErrorsDense, SoftmaxScaleNaN) {
  opts.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.softmax_scale': expected a finite value (or unset for 1/sqrt(d)), got nan");
}

TEST_F(ErrorsDense, SoftcapNegative) {
  opts.softcap = -1.5f;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.softcap': expected a finite value >= 0 (0 = off), got -1.5");
}

TEST_F(ErrorsDense, SoftcapInfinite) {
  opts.softcap = std::numeric_limits<float>::infinity();
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.softcap'", "got inf");
}

TEST_F(ErrorsDense, NumThreadsNegative) {
  opts.num_threads = -4;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.num_threads': expected >= 0", "got -4");
}

TEST_F(ErrorsDense, AlibiShape) {
  opts.alibi_slopes = pool_.tensor(f32, {h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.alibi_slopes': expected shape [4] or [2, 4] ([h_q] or [b, h_q]), got [2]");
}

TEST_F(ErrorsDense, AlibiDtype) {
  opts.alibi_slopes = pool_.tensor(fa::DType::kFloat64, {b, h_q});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.alibi_slopes': expected dtype float32, got float64");
}

TEST_F(ErrorsDense, ProbsShape) {
  opts.return_probs = pool_.tensor(f32, {b, h_q, s_q, s_k + 1}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.return_probs': expected shape [2, 4, 5, 7] ([b, h_q, s_q, s_k]), got [2, 4, 5, 8]");
}

TEST_F(ErrorsDense, ProbsDtype) {
  opts.return_probs = pool_.tensor(fa::DType::kFloat16, {b, h_q, s_q, s_k}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.return_probs': expected dtype float32, got float16");
}

TEST_F(ErrorsDense, OutAliasesQ) {
  out.data = q.data;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected memory disjoint from input 'q' (bytes [0x", "got bytes [0x");
}

TEST_F(ErrorsDense, LseOverlapsOut) {
  lse.data = static_cast<float*>(out.data) + 8;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected memory disjoint from output 'out'");
}

TEST_F(ErrorsDense, OutOverlapsAlibiSlopes) {
  opts.alibi_slopes = fa::Tensor::contiguous(static_cast<float*>(out.data) + 3, f32, {h_q});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected memory disjoint from input 'opts.alibi_slopes'");
}

TEST_F(ErrorsDense, OutputOverlapsItself) {
  lse.stride[1] = 0;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected distinct memory for every element (an output), got shape [2, 4, 5] with strides [20, 0, 1]");
}

TEST_F(ErrorsDense, OutputOverlapsItselfAcrossDims) {
  // Rows of 8 elements 4 apart: consecutive rows share half their elements.
  out.stride[2] = 4;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected distinct memory for every element");
}

TEST_F(ErrorsDense, InputsMayOverlapEachOther) {
  // q, k and v as slices of one packed [b, s, 3, h, d] tensor.
  fa::Tensor qkv = pool_.tensor(f32, {b, s_q, 3 * h_q, d});
  const std::int64_t st[4] = {s_q * 3 * h_q * d, 3 * h_q * d, d, 1};
  auto slice = [&](int i) {
    return fa::Tensor::strided(static_cast<float*>(qkv.data) + i * h_q * d, f32, {b, s_q, h_q, d},
                               {st[0], st[1], st[2], st[3]});
  };
  expect_accepted([&] { fa::forward(slice(0), slice(1), slice(2), out, lse, opts); });
}

TEST_F(ErrorsDense, BackwardNeedsLse) {
  lse_in = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "flashattn::backward: argument 'lse': expected a defined tensor, got an undefined tensor");
}

TEST_F(ErrorsDense, BackwardDoutShape) {
  dout = pool_.tensor(f32, {b, s_q + 1, h_q, d});
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "argument 'dout': expected shape [2, 5, 4, 8] (same as q but the head dim d_v of v), got [2, 6, 4, 8]");
}

TEST_F(ErrorsDense, BackwardDqDtype) {
  dq = pool_.tensor(fa::DType::kFloat64, {b, s_q, h_q, d}, nan);
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "argument 'dq': expected dtype float32 (same as q), got float64");
}

TEST_F(ErrorsDense, BackwardDkShape) {
  dk = pool_.tensor(f32, {b, s_k, h_q, d}, nan);
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "argument 'dk': expected shape [2, 7, 2, 8] (same as k), got [2, 7, 4, 8]");
}

TEST_F(ErrorsDense, BackwardDvOverlapsDk) {
  dv.data = static_cast<float*>(dk.data) + 3;  // within dk (and its spare bytes)
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "argument 'dv': expected memory disjoint from output 'dk'");
}

TEST_F(ErrorsDense, BackwardDqAliasesDout) {
  dq.data = dout.data;
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "argument 'dq': expected memory disjoint from input 'dout'");
}

TEST_F(ErrorsDense, WorkspaceWithoutData) {
  EXPECT_REJECTED(Kind::kInvalid, bwd(fa::Workspace{nullptr, 4096}),
                  "argument 'workspace': expected non-null data for 4096 bytes, got nullptr");
}

TEST_F(ErrorsDense, WorkspaceMisaligned) {
  fa::Tensor scratch = pool_.tensor(f32, {1024});
  const std::size_t needed = fa::backward_workspace_size(q, k, v, opts);
  fa::Workspace ws{static_cast<std::byte*>(scratch.data) + 4, std::max<std::size_t>(needed, 64)};
  if (needed > 4000) GTEST_SKIP() << "backward wants " << needed << " bytes for this problem";
  EXPECT_REJECTED(Kind::kInvalid, bwd(ws), "argument 'workspace': expected data 16-byte aligned, got address 0x");
}

TEST_F(ErrorsDense, WorkspaceTooSmall) {
  const std::size_t needed = fa::backward_workspace_size(q, k, v, opts);
  if (needed == 0) GTEST_SKIP() << "the CPU backward needs no workspace for this problem";
  std::vector<std::byte> scratch(needed);
  const std::string expected = "argument 'workspace': expected >= " + std::to_string(needed) +
                               " bytes, got " + std::to_string(needed - 1) + " bytes";
  EXPECT_REJECTED(Kind::kInvalid, bwd(fa::Workspace{scratch.data(), needed - 1}), expected.c_str());
}

TEST_F(ErrorsDense, WorkspaceSizeChecksItsArguments) {
  k = pool_.tensor(f32, {b, s_k, h_k, 4});
  EXPECT_REJECTED(Kind::kInvalid, fa::backward_workspace_size(q, k, v, opts),
                  "flashattn::backward_workspace_size: argument 'k': expected shape[3] == 8 (head dim of q), got 4");
}

// ------------------------------------------------------------------ CUDA-specific rules
// Checked directly: in a CPU-only build a CUDA tensor never gets this far.

TEST(ErrorsCudaRules, HeadDimMustBeAMultipleOf8) {
  const fa::detail::api::Check check("forward");
  try {
    fa::detail::api::check_supported(check, fa::detail::api::Target::kCUDA, fa::DType::kFloat16, 60, 60, 2, 8,
                                     fa::detail::api::CudaCall::kForward);
    FAIL() << "d = 60 accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q'"));
    EXPECT_THAT(e.what(), HasSubstr("d % 8 == 0"));
    EXPECT_THAT(e.what(), HasSubstr("got d = 60"));
  }
}

// d_v != d runs on CUDA (DeepSeek-V3's (192, 128)) where d_v follows d's rules: up to 512 in
// the forward and the backward.
TEST(ErrorsCudaRules, HeadDimOfVFollowsTheRulesOfD) {
  namespace api = fa::detail::api;
  const api::Check check("forward");
  // A build with the buckets (a CPU-only build compiles none: the bucket rule then fails).
  if (fa::detail::cuda::supports_head_dim(192) && fa::detail::cuda::supports_head_dim(128)) {
    EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat16, 192, 128, 2, 8,
                                         api::CudaCall::kForward));
    EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 64, 128, 2, 8,
                                         api::CudaCall::kBackward));
  }
  if (fa::detail::cuda::supports_wide_head_dim(512)) {
    EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 192, 512, 2, 8,
                                         api::CudaCall::kForward));
    EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 128, 264, 2, 8,
                                         api::CudaCall::kBackward));
  }
  for (int d_v : {100, 0, 520}) {
    try {
      api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat16, 128, d_v, 2, 8, api::CudaCall::kForward);
      FAIL() << "d_v = " << d_v << " accepted for the CUDA forward";
    } catch (const fa::Unsupported& e) {
      EXPECT_THAT(e.what(), HasSubstr("argument 'v': expected head dim with d_v % 8 == 0 and 8 <= d_v <= 512"));
      EXPECT_THAT(e.what(), HasSubstr("got d_v = " + std::to_string(d_v)));
    }
  }
  const api::Check bwd("backward");
  for (int d_v : {100, 520}) {
    try {
      api::check_supported(bwd, api::Target::kCUDA, fa::DType::kFloat16, 128, d_v, 2, 8, api::CudaCall::kBackward);
      FAIL() << "d_v = " << d_v << " accepted for the CUDA backward";
    } catch (const fa::Unsupported& e) {
      EXPECT_THAT(e.what(), HasSubstr("argument 'v': expected head dim with d_v % 8 == 0 and 8 <= d_v <= 512 "
                                      "(CUDA backend), got d_v = " + std::to_string(d_v)));
    }
  }
}

// CUDA KV-cache calls take d_v != d (the fused forward runs them) within the compiled
// head dims (up to 512), naming v_cache beyond; an fp8 cache or a draft-tree mask with
// d_v != d (the decode kernel's alone, one head dim) is Unsupported naming v_cache.
TEST(ErrorsCudaRules, KVCacheNamesVCache) {
  namespace api = fa::detail::api;
  const api::Check check("kvcache_forward");
  if (fa::detail::cuda::supports_head_dim(192) && fa::detail::cuda::supports_head_dim(128)) {
    EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 192, 128, 2, 16,
                                         api::CudaCall::kKVCache, "v_cache"));
  }
  if (fa::detail::cuda::supports_wide_head_dim(512)) {
    EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 64, 512, 2, 16,
                                         api::CudaCall::kKVCache, "v_cache"));
  }
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 64, 520, 2, 16, api::CudaCall::kKVCache,
                         "v_cache");
    FAIL() << "d_v = 520 accepted for a CUDA KV-cache call";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'v_cache': expected head dim with d_v % 8 == 0 and 8 <= d_v <= 512 "
                                    "(CUDA backend), got d_v = 520"));
  }
  // 16-bit caches without a tree mask, d_v == d, and the CPU backend: no error.
  EXPECT_NO_THROW(api::check_kvcache_head_dim_v(check, api::Target::kCUDA, 192, 128, false, false));
  EXPECT_NO_THROW(api::check_kvcache_head_dim_v(check, api::Target::kCUDA, 128, 128, true, true));
  EXPECT_NO_THROW(api::check_kvcache_head_dim_v(check, api::Target::kCPU, 192, 128, true, true));
  struct Row {
    bool fp8, tree;
    const char* with;
  };
  for (const Row r : {Row{true, false, "with a float8_e4m3 cache (k_cache, v_cache) on CUDA"},
                      Row{false, true, "with a draft-tree mask (tree_mask) on CUDA"},
                      Row{true, true, "with a float8_e4m3 cache and a draft-tree mask (tree_mask) on CUDA"}}) {
    try {
      api::check_kvcache_head_dim_v(check, api::Target::kCUDA, 192, 128, r.fp8, r.tree);
      FAIL() << "d_v != d accepted for CUDA with fp8 " << r.fp8 << ", tree " << r.tree;
    } catch (const fa::Unsupported& e) {
      EXPECT_EQ(e.argument(), "v_cache");
      EXPECT_THAT(e.what(), HasSubstr("argument 'v_cache': expected head dim d_v == d = 192 " + std::string(r.with)));
      EXPECT_THAT(e.what(), HasSubstr("got d_v = 128"));
    }
  }
}

TEST(ErrorsCudaRules, Fp8ForwardRunsOnCuda) {
  // fp8 q, k, v: forward / varlen_forward (CudaCall::kForward) take them on CUDA too, whatever the head
  // dim within the usual CUDA rules (the sm90 fp8 kernel declines what it does not cover
  // itself, with Unsupported); the CPU backend takes them as before.
  namespace api = fa::detail::api;
  const api::Check check("forward");
  EXPECT_NO_THROW(api::check_supported(check, api::Target::kCPU, fa::DType::kFloat8E4M3, 128, 128, 2, 16,
                                       api::CudaCall::kForward));
  for (int d : {64, 96, 128, 256}) {
    try {
      api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat8E4M3, d, d, 2, 16, api::CudaCall::kForward);
      EXPECT_TRUE(fa::detail::cuda::supports_head_dim(d)) << "d = " << d;
    } catch (const fa::Unsupported& e) {
      // Only a head dim this build did not compile (a CPU-only build compiles none).
      EXPECT_FALSE(fa::detail::cuda::supports_head_dim(d)) << e.what();
      EXPECT_THAT(e.what(), HasSubstr("FLASHATTN_HEAD_DIMS"));
    }
  }
  // The usual CUDA rules still apply to fp8 (d % 8), and other dtypes name fp8 among those.
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat8E4M3, 60, 60, 2, 16, api::CudaCall::kForward);
    FAIL() << "d = 60 accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected head dim with d % 8 == 0"));
  }
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat32, 128, 128, 2, 16, api::CudaCall::kForward);
    FAIL() << "fp32 accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected dtype float16, bfloat16 or float8_e4m3 (CUDA "
                                    "backend), got float32"));
  }
}

TEST(ErrorsCudaRules, Fp8QRunsOnCudaInForwardAndKVCacheCalls) {
  // fp8 q on CUDA: the forward calls (the sm90 fp8 forward) and kvcache_forward (the decode
  // kernel) take it; any other call kind is Unsupported naming q (the backward entry points
  // reject fp8 q before they get here). A KV-cache call is not declined for its dtype (a
  // build without CUDA may still decline its head dim, as not compiled in).
  namespace api = fa::detail::api;
  const api::Check check("kvcache_forward");
  EXPECT_NO_THROW(api::check_supported(check, api::Target::kCPU, fa::DType::kFloat8E4M3, 128, 128, 2, 16,
                                       api::CudaCall::kKVCache, "v_cache"));
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat8E4M3, 128, 128, 2, 16,
                         api::CudaCall::kKVCache, "v_cache");
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("dtype"))) << "fp8 q declined for a CUDA KV-cache call";
    EXPECT_THAT(e.what(), HasSubstr("compiled into this build"));
  }
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat8E4M3, 128, 128, 2, 16,
                         api::CudaCall::kBackward, "v_cache");
    FAIL() << "fp8 accepted for a CUDA backward";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("flashattn::kvcache_forward: argument 'q': expected dtype float16 or "
                                    "bfloat16 (CUDA backend: float8_e4m3 q, k, v run on CUDA in forward, "
                                    "varlen_forward and kvcache_forward only; here they run on the CPU "
                                    "backend), got float8_e4m3"));
  }
}

// fp8 q, k, v on CUDA: the descales go to the kernel as device pointers, so each must be a
// contiguous [b, h_k]; the CUDA fp8 forward has no dropout, probabilities or block masks.
// Tensors labelled cuda:0 over host memory: only their metadata is read.
class ErrorsCudaFp8 : public ::testing::Test {
 protected:
  static constexpr int b = 3, h_k = 2;
  alignas(16) std::uint8_t q_bytes[3 * 4 * 4 * 16] = {};
  alignas(16) float descale_buf[64] = {};
  fa::Tensor q = fa::Tensor::contiguous(q_bytes, fa::DType::kFloat8E4M3, {b, 4, 4, 16}, fa::Device::cuda(0));
  fa::Options opts;
  fa::Tensor descale(std::initializer_list<std::int64_t> shape, std::initializer_list<std::int64_t> stride) {
    return fa::Tensor::strided(descale_buf, fa::DType::kFloat32, shape, stride, fa::Device::cuda(0));
  }
  std::string invalid(bool cuda = true, int batch = b) {
    const fa::detail::api::Check check("forward");
    try {
      fa::detail::api::check_fp8(check, opts, q, batch, h_k);
      fa::detail::api::check_fp8_cuda(check, opts, q, cuda, batch, h_k);
    } catch (const fa::Unsupported& e) {
      return std::string("Unsupported: ") + e.what();
    } catch (const fa::InvalidArgument& e) {
      return e.what();
    }
    return "accepted";
  }
  std::string unsupported(bool cuda = true) {
    const fa::detail::api::Check check("varlen_forward");
    try {
      fa::detail::api::check_fp8_cuda(check, opts, q, cuda, b, h_k);
    } catch (const fa::Unsupported& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("not Unsupported: ") + e.what();
    }
    return "accepted";
  }
};

TEST_F(ErrorsCudaFp8, ContiguousDescalesAreAccepted) {
  opts.q_descale = descale({b, h_k}, {h_k, 1});
  opts.v_descale = descale({b, h_k}, {h_k, 1});  // k_descale undefined: 1
  EXPECT_EQ(invalid(), "accepted");
}

TEST_F(ErrorsCudaFp8, DescaleRowsMustBeContiguous) {
  // A padded [b, h_k] (row stride 4 > h_k): the kernel would read descale[b * h_k + g].
  opts.k_descale = descale({b, h_k}, {4, 1});
  EXPECT_THAT(invalid(), HasSubstr("flashattn::forward: argument 'opts.k_descale': expected stride[0] == 2 "
                                   "(h_k: contiguous [b, h_k], the CUDA fp8 forward reads descale[b * h_k + "
                                   "g] on the device), got 4"));
  // The CPU backend reads the descales on the host with their strides: accepted there.
  EXPECT_EQ(invalid(/*cuda=*/false), "accepted");
  // A broadcast row (stride 0, as torch's expand) is not [b, h_k] memory either.
  opts.k_descale = {};
  opts.v_descale = descale({b, h_k}, {0, 1});
  EXPECT_THAT(invalid(), HasSubstr("argument 'opts.v_descale': expected stride[0] == 2"));
  EXPECT_THAT(invalid(), HasSubstr("got 0"));
}

TEST_F(ErrorsCudaFp8, OneSequenceTakesAnyRowStride) {
  opts.q_descale = descale({1, h_k}, {7, 1});  // b = 1: stride[0] is never used
  EXPECT_EQ(invalid(true, /*batch=*/1), "accepted");
}

TEST_F(ErrorsCudaFp8, DescaleLastDimStillContiguous) {
  // A transposed [b, h_k] view: check_fp8's layout rule, as on the CPU.
  opts.q_descale = descale({b, h_k}, {1, b});
  EXPECT_THAT(invalid(), HasSubstr("argument 'opts.q_descale': expected stride[1] == 1 (contiguous last "
                                   "dimension), got 3"));
}

TEST_F(ErrorsCudaFp8, DescaleOnAnotherDevice) {
  opts.k_descale = fa::Tensor::contiguous(descale_buf, fa::DType::kFloat32, {b, h_k});  // host memory
  EXPECT_THAT(invalid(), HasSubstr("argument 'opts.k_descale': expected device cuda:0"));
}

TEST_F(ErrorsCudaFp8, DropoutIsUnsupported) {
  opts.dropout_p = 0.1f;
  EXPECT_THAT(unsupported(), HasSubstr("flashattn::varlen_forward: argument 'opts.dropout_p': expected 0 with "
                                       "float8_e4m3 q, k, v on CUDA"));
  EXPECT_THAT(unsupported(), HasSubstr("got 0.1"));
  EXPECT_EQ(unsupported(/*cuda=*/false), "accepted");  // the CPU backend runs fp8 dropout
}

TEST_F(ErrorsCudaFp8, ReturnProbsIsUnsupported) {
  alignas(16) static float probs[3 * 4 * 4 * 4];
  opts.return_probs = fa::Tensor::contiguous(probs, fa::DType::kFloat32, {b, 4, 4, 4}, fa::Device::cuda(0));
  EXPECT_THAT(unsupported(), HasSubstr("argument 'opts.return_probs': expected an undefined tensor with "
                                       "float8_e4m3 q, k, v on CUDA"));
  EXPECT_THAT(unsupported(), HasSubstr("got a tensor of shape [3, 4, 4, 4]"));
  EXPECT_EQ(unsupported(false), "accepted");
}

TEST_F(ErrorsCudaFp8, BlockSparseIsUnsupported) {
  alignas(16) static std::int32_t cnt[3 * 4], idx[3 * 4];
  opts.block_sparse.mask_block_cnt = fa::Tensor::contiguous(cnt, fa::DType::kInt32, {b, 4, 1}, fa::Device::cuda(0));
  opts.block_sparse.mask_block_idx = fa::Tensor::contiguous(idx, fa::DType::kInt32, {b, 4, 1, 1}, fa::Device::cuda(0));
  EXPECT_THAT(unsupported(), HasSubstr("argument 'opts.block_sparse': expected undefined lists with float8_e4m3 "
                                       "q, k, v on CUDA"));
  EXPECT_EQ(unsupported(false), "accepted");
}

TEST_F(ErrorsCudaFp8, SixteenBitQIsNotConcerned) {
  // Without fp8 q the CUDA rules of those options are the usual ones (dropout runs on CUDA).
  q.dtype = fa::DType::kBFloat16;
  opts.dropout_p = 0.1f;
  EXPECT_EQ(unsupported(), "accepted");
}

TEST(ErrorsCudaRules, Fp8DescalesGoToCudaAsDevicePointers) {
  // set_fp8 on the CUDA target: the descale tensors' own pointers (nullptr where undefined,
  // read as 1 by the kernel), nothing read or copied on the host; the CPU target keeps the
  // host copy with 1 for an undefined descale.
  namespace api = fa::detail::api;
  alignas(16) static float qd[6] = {1, 2, 3, 4, 5, 6}, vd[6] = {7, 8, 9, 10, 11, 12};
  alignas(16) static std::uint16_t out_buf[8];
  fa::Options opts;
  opts.q_descale = fa::Tensor::contiguous(qd, fa::DType::kFloat32, {3, 2}, fa::Device::cuda(0));
  opts.v_descale = fa::Tensor::contiguous(vd, fa::DType::kFloat32, {3, 2}, fa::Device::cuda(0));
  const fa::Tensor out = fa::Tensor::contiguous(out_buf, fa::DType::kFloat16, {1, 1, 1, 8}, fa::Device::cuda(0));
  fa::detail::FwdParams p;
  p.batch = 3;
  p.h_k = 2;
  p.dtype = p.q_dtype = p.kv_dtype = fa::DType::kFloat8E4M3;
  std::vector<float> storage{42.0f};
  api::set_fp8(opts, out, /*cuda=*/true, p, storage);
  EXPECT_EQ(p.q_descale, qd);
  EXPECT_EQ(p.k_scale, nullptr);
  EXPECT_EQ(p.v_scale, vd);
  EXPECT_EQ(p.scale_block_stride, 2);
  EXPECT_TRUE(p.scale_by_sequence);
  EXPECT_EQ(p.dtype, fa::DType::kFloat16);
  EXPECT_EQ(p.q_dtype, fa::DType::kFloat8E4M3);
  EXPECT_EQ(p.kv_dtype, fa::DType::kFloat8E4M3);
  EXPECT_TRUE(storage.empty());

  fa::detail::FwdParams c;
  c.batch = 3;
  c.h_k = 2;
  c.dtype = c.q_dtype = c.kv_dtype = fa::DType::kFloat8E4M3;
  api::set_fp8(opts, out, /*cuda=*/false, c, storage);
  ASSERT_EQ(storage.size(), 18u);
  EXPECT_EQ(c.q_descale, storage.data());
  EXPECT_EQ(c.k_scale, storage.data() + 6);
  EXPECT_EQ(c.v_scale, storage.data() + 12);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(c.q_descale[i], qd[i]);
    EXPECT_EQ(c.k_scale[i], 1.0f);
    EXPECT_EQ(c.v_scale[i], vd[i]);
  }
  EXPECT_EQ(c.scale_block_stride, 2);
  EXPECT_TRUE(c.scale_by_sequence);

  // 16-bit q: nothing changes.
  fa::detail::FwdParams h;
  h.dtype = h.q_dtype = h.kv_dtype = fa::DType::kBFloat16;
  api::set_fp8(opts, out, true, h, storage);
  EXPECT_EQ(h.q_descale, nullptr);
  EXPECT_EQ(h.k_scale, nullptr);
  EXPECT_FALSE(h.scale_by_sequence);
  EXPECT_EQ(h.dtype, fa::DType::kBFloat16);
}

// qv on CUDA runs the MLA kernel (src/cuda/sm80/mla_kernel.cuh), inference only: dropout
// with it is Unsupported naming opts.dropout_p (its head dims are check_supported's).
TEST(ErrorsCudaRules, QvOnCudaTakesNoDropout) {
  const fa::detail::api::Check check("forward");
  alignas(16) static std::uint16_t buf[64];
  fa::Options opts;
  opts.qv = fa::Tensor::contiguous(buf, fa::DType::kFloat16, {1, 1, 1, 64}, fa::Device::cuda(0));
  EXPECT_NO_THROW(fa::detail::api::check_qv_target(check, opts, false));
  EXPECT_NO_THROW(fa::detail::api::check_qv_target(check, opts, true));
  opts.dropout_p = 0.25f;
  EXPECT_NO_THROW(fa::detail::api::check_qv_target(check, opts, false));
  try {
    fa::detail::api::check_qv_target(check, opts, true);
    FAIL() << "qv with dropout accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'opts.dropout_p': expected 0 with opts.qv on CUDA (the MLA kernel has "
                                    "no dropout), got 0.25"));
  }
}

// The CUDA head-dim rules of a call with qv (CudaCall::kMla): d <= 64 (q), d_v <= 512 (v),
// whatever buckets this build compiled; the CPU takes any.
TEST(ErrorsCudaRules, QvHeadDimsOnCuda) {
  namespace api = fa::detail::api;
  const api::Check check("kvcache_forward");
  EXPECT_NO_THROW(api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 64, 512, 1, 128,
                                       api::CudaCall::kMla, "v_cache"));
  EXPECT_NO_THROW(api::check_supported(check, api::Target::kCPU, fa::DType::kBFloat16, 128, 512, 1, 128,
                                       api::CudaCall::kMla, "v_cache"));
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kBFloat16, 128, 512, 1, 128, api::CudaCall::kMla,
                         "v_cache");
    FAIL() << "d = 128 with qv accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_EQ(e.argument(), "q");
    EXPECT_THAT(e.what(), HasSubstr("8 <= d <= 64 with opts.qv"));
    EXPECT_THAT(e.what(), HasSubstr("got d = 128"));
  }
  try {
    api::check_supported(check, api::Target::kCUDA, fa::DType::kFloat16, 64, 1024, 1, 16, api::CudaCall::kMla,
                         "v_cache");
    FAIL() << "d_v = 1024 with qv accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_EQ(e.argument(), "v_cache");
    EXPECT_THAT(e.what(), HasSubstr("got d_v = 1024"));
  }
}

// A causal / window forward on CUDA indexes query tiles by grid z (at most 65535 tiles of
// 64 rows); past that, an Unsupported naming q before anything runs (issue 25), instead of
// a launch failure. Unbounded masks and the CPU have no such limit.
TEST(ErrorsCudaRules, CausalForwardRowsFitTheGrid) {
  const fa::detail::api::Check check("forward");
  namespace api = fa::detail::api;
  fa::detail::FwdParams p;
  p.seqlen_q = 65535 * 64;
  p.mask = fa::semantics::Mask::make(true, -1, -1);
  EXPECT_NO_THROW(api::check_cuda_forward_rows(check, api::Target::kCUDA, p));
  p.seqlen_q += 1;
  EXPECT_NO_THROW(api::check_cuda_forward_rows(check, api::Target::kCPU, p));
  try {
    api::check_cuda_forward_rows(check, api::Target::kCUDA, p);
    FAIL() << "4194241 causal query rows accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected at most 4194240 query rows per sequence "
                                    "with a causal or window mask (CUDA backend), got 4194241 rows"));
  }
  p.mask = fa::semantics::Mask::make(false, 100, -1);  // a window: the same grid
  EXPECT_THROW(api::check_cuda_forward_rows(check, api::Target::kCUDA, p), fa::Unsupported);
  p.mask = fa::semantics::Mask::make(false, -1, -1);  // unbounded: tiles in grid x
  EXPECT_NO_THROW(api::check_cuda_forward_rows(check, api::Target::kCUDA, p));
}

// Head dims above 256 (issue 22): the CUDA forward, backward and KV-cache calls take them up
// to 512 (the 512 bucket), naming q's head dim beyond.
TEST(ErrorsCudaRules, HeadDimAbove256) {
  namespace api = fa::detail::api;
  const api::Check fwd("forward");
  if (fa::detail::cuda::supports_wide_head_dim(512)) {
    EXPECT_NO_THROW(api::check_supported(fwd, api::Target::kCUDA, fa::DType::kBFloat16, 512, 512, 2, 8,
                                         api::CudaCall::kForward));
    EXPECT_NO_THROW(api::check_supported(fwd, api::Target::kCUDA, fa::DType::kFloat16, 264, 128, 2, 8,
                                         api::CudaCall::kForward));
  }
  try {
    api::check_supported(fwd, api::Target::kCUDA, fa::DType::kBFloat16, 520, 520, 2, 8, api::CudaCall::kForward);
    FAIL() << "d = 520 accepted for the CUDA forward";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected head dim with d % 8 == 0 and 8 <= d <= 512 (CUDA backend), got d = 520"));
  }
  const api::Check bwd("backward");
  if (fa::detail::cuda::supports_wide_head_dim(512)) {
    EXPECT_NO_THROW(api::check_supported(bwd, api::Target::kCUDA, fa::DType::kBFloat16, 512, 512, 2, 8,
                                         api::CudaCall::kBackward));
    EXPECT_NO_THROW(api::check_supported(bwd, api::Target::kCUDA, fa::DType::kFloat16, 320, 512, 2, 8,
                                         api::CudaCall::kBackward));
  }
  try {
    api::check_supported(bwd, api::Target::kCUDA, fa::DType::kBFloat16, 520, 512, 2, 8, api::CudaCall::kBackward);
    FAIL() << "d = 520 accepted for the CUDA backward";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected head dim with d % 8 == 0 and 8 <= d <= 512 (CUDA "
                                    "backend), got d = 520"));
  }
  const api::Check kv("kvcache_forward");
  if (fa::detail::cuda::supports_wide_head_dim(512)) {
    EXPECT_NO_THROW(api::check_supported(kv, api::Target::kCUDA, fa::DType::kBFloat16, 320, 320, 2, 8,
                                         api::CudaCall::kKVCache, "v_cache"));
    EXPECT_NO_THROW(api::check_supported(kv, api::Target::kCUDA, fa::DType::kFloat8E4M3, 512, 512, 2, 8,
                                         api::CudaCall::kKVCache, "v_cache"));
  }
  try {
    api::check_supported(kv, api::Target::kCUDA, fa::DType::kBFloat16, 528, 528, 2, 8, api::CudaCall::kKVCache,
                         "v_cache");
    FAIL() << "d = 528 accepted for a CUDA KV-cache call";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected head dim with d % 8 == 0 and 8 <= d <= 512 (CUDA "
                                    "backend), got d = 528"));
  }
}

TEST(ErrorsCudaRules, OnlyHalfPrecision) {
  // (the forward takes float8_e4m3 too: Fp8ForwardRunsOnCuda)
  const fa::detail::api::Check check("backward");
  try {
    fa::detail::api::check_supported(check, fa::detail::api::Target::kCUDA, fa::DType::kFloat32, 64, 64, 2, 8,
                                     fa::detail::api::CudaCall::kBackward);
    FAIL() << "fp32 accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected dtype float16 or bfloat16 (CUDA backend), got float32"));
  }
}

TEST(ErrorsCudaRules, GridLimits) {
  const fa::detail::api::Check check("varlen_forward");
  try {
    fa::detail::api::check_supported(check, fa::detail::api::Target::kCUDA, fa::DType::kBFloat16, 64,
                                     64, 70000, 8, fa::detail::api::CudaCall::kForward);
    FAIL() << "70000 sequences accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'q': expected at most 65535 sequences per call (CUDA backend), got 70000 sequences"));
  }
  try {
    fa::detail::api::check_supported(check, fa::detail::api::Target::kCUDA, fa::DType::kBFloat16, 64,
                                     64, 2, 65536, fa::detail::api::CudaCall::kForward);
    FAIL() << "65536 heads accepted for CUDA";
  } catch (const fa::Unsupported& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected at most 65535 query heads (CUDA backend), got 65536 heads"));
  }
}

TEST(ErrorsCudaRules, DataMustBe16ByteAligned) {
  alignas(16) static std::uint16_t buf[2 * 16 * 64 + 8];
  const fa::Tensor t = fa::Tensor::contiguous(buf + 4, fa::DType::kFloat16, {2, 16, 1, 64},
                                              fa::Device::cuda(0));
  const fa::detail::api::Check check("forward");
  try {
    fa::detail::api::check_cuda_layout(check, "k", t);
    FAIL() << "an 8-byte aligned tensor accepted for CUDA";
  } catch (const fa::InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'k': expected data 16-byte aligned (CUDA backend), got address 0x"));
  }
}

TEST(ErrorsCudaRules, StridesMustBeMultiplesOf8) {
  alignas(16) static std::uint16_t buf[2 * 16 * 12];
  const fa::Tensor t = fa::Tensor::strided(buf, fa::DType::kBFloat16, {2, 16, 1, 8},
                                           {16 * 12, 12, 8, 1}, fa::Device::cuda(0));
  const fa::detail::api::Check check("backward");
  try {
    fa::detail::api::check_cuda_layout(check, "dq", t);
    FAIL() << "stride 12 accepted for CUDA";
  } catch (const fa::InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("flashattn::backward: argument 'dq': expected stride[1] a multiple of 8 elements (CUDA backend: 16-byte aligned rows), got 12"));
  }
}

TEST(ErrorsCudaRules, ProbsAreCpuOnly) {
  float buf[16];
  fa::Options opts;
  opts.return_probs = fa::Tensor::contiguous(buf, fa::DType::kFloat32, {1, 1, 4, 4}, fa::Device::cuda(0));
  fa::detail::FwdParams p;
  const fa::detail::api::Check check("forward");
  EXPECT_THROW(fa::detail::api::fill_probs(check, opts, false, fa::Device::cuda(0), {1, 1, 4, 4}, p),
               fa::Unsupported);
}

// ------------------------------------------------------------------ workspace handling
// Checked directly too: whether the CPU backend wants scratch depends on the problem.

TEST(ErrorsWorkspace, TooSmall) {
  alignas(16) static std::byte buf[128];
  const fa::detail::api::Check check("backward");
  fa::detail::BwdParams p;
  fa::detail::api::Scratch scratch;
  try {
    fa::detail::api::attach_workspace(check, fa::detail::api::Target::kCPU, {buf, 100}, 128, p,
                                      scratch);
    FAIL() << "a 100-byte workspace accepted for 128 bytes";
  } catch (const fa::InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "flashattn::backward: argument 'workspace': expected >= 128 bytes, got 100 bytes");
  }
  EXPECT_EQ(p.workspace, nullptr);
}

TEST(ErrorsWorkspace, CallerWorkspaceIsUsed) {
  alignas(16) static std::byte buf[256];
  const fa::detail::api::Check check("backward");
  fa::detail::BwdParams p;
  fa::detail::api::Scratch scratch;
  fa::detail::api::attach_workspace(check, fa::detail::api::Target::kCPU, {buf, 256}, 128, p,
                                    scratch);
  EXPECT_EQ(p.workspace, static_cast<void*>(buf));
  EXPECT_EQ(p.workspace_bytes, 256u);
}

TEST(ErrorsWorkspace, AllocatedWhenNoneGiven) {
  const fa::detail::api::Check check("kvcache_forward");
  fa::detail::FwdParams p;
  fa::detail::api::Scratch scratch;
  fa::detail::api::attach_workspace(check, fa::detail::api::Target::kCPU, {}, 1000, p, scratch);
  ASSERT_NE(p.workspace, nullptr);
  EXPECT_EQ(p.workspace_bytes, 1000u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.workspace) % 64, 0u);
  std::memset(p.workspace, 0, 1000);  // the whole allocation is writable

  fa::detail::FwdParams none;
  fa::detail::api::Scratch unused;
  fa::detail::api::attach_workspace(check, fa::detail::api::Target::kCPU, {}, 0, none, unused);
  EXPECT_EQ(none.workspace, nullptr);
  EXPECT_EQ(none.workspace_bytes, 0u);
}

// ------------------------------------------------------------------ varlen

// 3 sequences: q lengths 2, 0, 5 (total 7); k lengths 3, 4, 1 (total 8).
class ErrorsVarlen : public ErrorsTest {
 protected:
  static constexpr std::int64_t total_q = 7, total_k = 8, h_q = 4, h_k = 2, d = 8;
  const fa::DType f32 = fa::DType::kFloat32;
  const Pool::Fill nan = Pool::Fill::kNaN;
  fa::VarlenArgs args = make_args();
  fa::Tensor out = pool_.tensor(f32, {total_q, h_q, d}, nan);
  fa::Tensor lse = pool_.tensor(f32, {h_q, total_q}, nan);
  fa::Tensor dout = pool_.tensor(f32, {total_q, h_q, d});
  fa::Tensor lse_in = pool_.tensor(f32, {h_q, total_q});
  fa::Tensor dq = pool_.tensor(f32, {total_q, h_q, d}, nan);
  fa::Tensor dk = pool_.tensor(f32, {total_k, h_k, d}, nan);
  fa::Tensor dv = pool_.tensor(f32, {total_k, h_k, d}, nan);
  fa::Options opts;

  fa::VarlenArgs make_args() {
    fa::VarlenArgs a;
    a.q = pool_.tensor(f32, {total_q, h_q, d});
    a.k = pool_.tensor(f32, {total_k, h_k, d});
    a.v = pool_.tensor(f32, {total_k, h_k, d});
    a.cu_seqlens_q = pool_.int32({0, 2, 2, 7});
    a.cu_seqlens_k = pool_.int32({0, 3, 7, 8});
    a.max_seqlen_q = 5;
    a.max_seqlen_k = 4;
    return a;
  }
  void fwd() { fa::varlen_forward(args, out, lse, opts); }
  void bwd() { fa::varlen_backward(args, dout, out, lse_in, dq, dk, dv, opts); }
};

TEST_F(ErrorsVarlen, ValidBaselinesAreAccepted) {
  expect_accepted([&] { fwd(); });
  expect_accepted([&] { bwd(); });
  args.seqused_k = pool_.int32({3, 0, 1});
  expect_accepted([&] { fwd(); });
  EXPECT_NO_THROW(fa::varlen_backward_workspace_size(args, opts));
}

TEST_F(ErrorsVarlen, EmptyBatchIsAccepted) {
  args.cu_seqlens_q = pool_.int32({0});
  args.cu_seqlens_k = pool_.int32({0});
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsVarlen, QRank) {
  args.q = pool_.tensor(f32, {1, total_q, h_q, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "flashattn::varlen_forward: argument 'q': expected rank 3 [total_q, h_q, d], got rank 4");
}

TEST_F(ErrorsVarlen, CuSeqlensDtype) {
  args.cu_seqlens_k = pool_.tensor(f32, {4});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cu_seqlens_k': expected dtype int32, got float32");
}

TEST_F(ErrorsVarlen, CuSeqlensKLength) {
  args.cu_seqlens_k = pool_.int32({0, 3, 8});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cu_seqlens_k': expected shape [4] ([b + 1], same as cu_seqlens_q), got [3]");
}

TEST_F(ErrorsVarlen, CuSeqlensFirstNotZero) {
  args.cu_seqlens_q = pool_.int32({1, 2, 2, 7});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cu_seqlens_q': expected cu_seqlens_q[0] == 0, got 1");
}

TEST_F(ErrorsVarlen, CuSeqlensDecreasing) {
  args.cu_seqlens_q = pool_.int32({0, 2, 9, 5});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "flashattn::varlen_forward: argument 'cu_seqlens_q': expected non-decreasing values, got cu_seqlens_q[3] = 5 < cu_seqlens_q[2] = 9");
}

TEST_F(ErrorsVarlen, CuSeqlensPastTheEnd) {
  args.cu_seqlens_k = pool_.int32({0, 3, 7, 9});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cu_seqlens_k': expected cu_seqlens_k[3] <= 8 (k.shape[0]), got 9");
}

TEST_F(ErrorsVarlen, MaxSeqlenTooSmall) {
  args.max_seqlen_q = 4;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'max_seqlen_q': expected >= 5 (the length of sequence 2 in cu_seqlens_q), got 4");
}

TEST_F(ErrorsVarlen, MaxSeqlenNegative) {
  args.max_seqlen_k = -1;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'max_seqlen_k': expected >= 0, got -1");
}

TEST_F(ErrorsVarlen, SequsedKTooLong) {
  args.seqused_k = pool_.int32({3, 5, 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'seqused_k': expected seqused_k[1] in [0, 4] (the key length of sequence 1), got seqused_k[1] = 5");
}

TEST_F(ErrorsVarlen, SequsedKNegative) {
  args.seqused_k = pool_.int32({3, 2, -1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'seqused_k'", "got seqused_k[2] = -1");
}

TEST_F(ErrorsVarlen, SequsedKShape) {
  args.seqused_k = pool_.int32({3, 2});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'seqused_k': expected shape [3] ([b]), got [2]");
}

TEST_F(ErrorsVarlen, LseShape) {
  lse = pool_.tensor(f32, {total_q, h_q}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected shape [4, 7] ([h_q, total_q]), got [7, 4]");
}

TEST_F(ErrorsVarlen, ProbsShape) {
  opts.return_probs = pool_.tensor(f32, {h_q, total_q, 5}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.return_probs': expected shape [4, 7, 4] ([h_q, total_q, max_seqlen_k]), got [4, 7, 5]");
}

TEST_F(ErrorsVarlen, AlibiPerSequence) {
  opts.alibi_slopes = pool_.tensor(f32, {2, h_q});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.alibi_slopes': expected shape [4] or [3, 4]", "got [2, 4]");
}

TEST_F(ErrorsVarlen, LseOverlapsCuSeqlens) {
  const std::int32_t cu_k[4] = {0, 3, 7, 8};
  std::memcpy(static_cast<float*>(lse.data) + 5, cu_k, sizeof cu_k);
  args.cu_seqlens_k = fa::Tensor::contiguous(static_cast<float*>(lse.data) + 5, fa::DType::kInt32, {4});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected memory disjoint from input 'cu_seqlens_k'");
}

TEST_F(ErrorsVarlen, BackwardDkShape) {
  dk = pool_.tensor(f32, {total_q, h_k, d}, nan);
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "flashattn::varlen_backward: argument 'dk': expected shape [8, 2, 8] (same as k), got [7, 2, 8]");
}

TEST_F(ErrorsVarlen, BackwardContentChecks) {
  args.cu_seqlens_k = pool_.int32({0, 4, 3, 8});
  EXPECT_REJECTED(Kind::kInvalid, bwd(), "argument 'cu_seqlens_k': expected non-decreasing values, got cu_seqlens_k[2] = 3 < cu_seqlens_k[1] = 4");
}

TEST_F(ErrorsVarlen, WorkspaceSizeChecksContents) {
  args.max_seqlen_k = 3;
  EXPECT_REJECTED(Kind::kInvalid, fa::varlen_backward_workspace_size(args, opts),
                  "flashattn::varlen_backward_workspace_size: argument 'max_seqlen_k': expected >= 4");
}

// ------------------------------------------------------------------ KV cache

// b = 2, s_q = 1, h_q = 4, h_k = 2, d = 8; dense cache [3, 16, 2, 8] with 5 and 9 keys,
// 2 new keys each; paged variant: 6 blocks of 4 rows, 4 blocks per sequence.
class ErrorsKVCache : public ErrorsTest {
 protected:
  static constexpr std::int64_t b = 2, s_q = 1, h_q = 4, h_k = 2, d = 8, s_cache = 16, s_new = 2;
  static constexpr std::int64_t num_blocks = 6, block_size = 4, max_blocks = 4;
  const fa::DType f32 = fa::DType::kFloat32;
  const Pool::Fill nan = Pool::Fill::kNaN;
  fa::KVCacheArgs args = dense_args();
  fa::Tensor out = pool_.tensor(f32, {b, s_q, h_q, d}, nan);
  fa::Tensor lse = pool_.tensor(f32, {b, h_q, s_q}, nan);
  fa::Options opts;

  fa::KVCacheArgs dense_args() {
    fa::KVCacheArgs a;
    a.q = pool_.tensor(f32, {b, s_q, h_q, d});
    a.k_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
    a.v_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
    a.cache_seqlens = pool_.int32({5, 9});
    a.k_new = pool_.tensor(f32, {b, s_new, h_k, d});
    a.v_new = pool_.tensor(f32, {b, s_new, h_k, d});
    return a;
  }
  void make_paged() {
    args.k_cache = pool_.tensor(f32, {num_blocks, block_size, h_k, d});
    args.v_cache = pool_.tensor(f32, {num_blocks, block_size, h_k, d});
    // 7 and 11 keys after the append: 2 and 3 blocks used.
    args.block_table = pool_.int32_2d(b, max_blocks, {0, 2, -1, -1, 1, 3, 5, 99});
  }
  void fwd(fa::Workspace ws = {}) { fa::kvcache_forward(args, out, lse, opts, ws); }
};

TEST_F(ErrorsKVCache, ValidBaselinesAreAccepted) {
  expect_accepted([&] { fwd(); });
  EXPECT_NO_THROW(fa::kvcache_workspace_size(args, opts));
  args.cache_batch_idx = pool_.int32({2, 0});
  expect_accepted([&] { fwd(); });
  args.cache_batch_idx = fa::Tensor{};
  make_paged();
  expect_accepted([&] { fwd(); });
  args.k_new = args.v_new = fa::Tensor{};
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsKVCache, KNewWithoutVNew) {
  args.v_new = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "flashattn::kvcache_forward: argument 'v_new': expected a defined tensor (k_new and v_new are given together), got an undefined tensor");
}

TEST_F(ErrorsKVCache, KNewShape) {
  args.k_new = pool_.tensor(f32, {b, s_new, h_q, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_new': expected shape [2, 2, 2, 8] ([b, s_new, h_k, d]), got [2, 2, 4, 8]");
}

TEST_F(ErrorsKVCache, VNewShape) {
  args.v_new = pool_.tensor(f32, {b, s_new + 1, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_new': expected shape [2, 2, 2, 8] (same as k_new but the head dim d_v of v_cache), got [2, 3, 2, 8]");
}

TEST_F(ErrorsKVCache, CacheHeadDim) {
  args.k_cache = pool_.tensor(f32, {3, s_cache, h_k, 16});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_cache': expected shape[3] == 8 (head dim of q), got 16");
}

TEST_F(ErrorsKVCache, CacheSeqlensRequired) {
  args.cache_seqlens = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_seqlens': expected a defined tensor, got an undefined tensor");
}

TEST_F(ErrorsKVCache, CacheSeqlensDtype) {
  args.cache_seqlens = pool_.tensor(f32, {b});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_seqlens': expected dtype int32, got float32");
}

TEST_F(ErrorsKVCache, CacheSeqlensNegative) {
  args.cache_seqlens = pool_.int32({5, -1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_seqlens': expected values >= 0, got cache_seqlens[1] = -1");
}

TEST_F(ErrorsKVCache, DenseCacheTooSmall) {
  args.cache_seqlens = pool_.int32({5, 15});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'cache_seqlens': expected cache_seqlens[i] + s_new <= 16 (s_cache = k_cache.shape[1]), got cache_seqlens[1] + 2 = 17");
}

TEST_F(ErrorsKVCache, PagedCacheTooSmall) {
  make_paged();
  args.cache_seqlens = pool_.int32({5, 15});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_seqlens'",
                  "expected cache_seqlens[i] + s_new <= 16 (max_blocks_per_seq * block_size = 4 * 4 of block_table and k_cache)",
                  "got cache_seqlens[1] + 2 = 17");
}

TEST_F(ErrorsKVCache, TooFewCacheRows) {
  args.k_cache = pool_.tensor(f32, {1, s_cache, h_k, d});
  args.v_cache = pool_.tensor(f32, {1, s_cache, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_cache': expected shape[0] (b_cache) >= 2 (batch of q), got 1");
}

TEST_F(ErrorsKVCache, CacheBatchIdxOutOfRange) {
  args.cache_batch_idx = pool_.int32({0, 3});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_batch_idx': expected values in [0, 3) (b_cache = k_cache.shape[0]), got cache_batch_idx[1] = 3");
}

TEST_F(ErrorsKVCache, CacheBatchIdxWithPagedCache) {
  make_paged();
  args.cache_batch_idx = pool_.int32({0, 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_batch_idx': expected an undefined tensor (cache_batch_idx is for dense caches", "got a tensor of shape [2]");
}

TEST_F(ErrorsKVCache, BlockTableEntryOutOfRange) {
  make_paged();
  // Sequence 1 holds 9 + 2 = 11 keys: blocks 0..2 are used, so entry [1][2] = 6 is read.
  args.block_table = pool_.int32_2d(b, max_blocks, {0, 2, -1, -1, 1, 3, 6, 99});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'block_table': expected used entries in [0, 6) (num_blocks = k_cache.shape[0]), got block_table[1][2] = 6");
}

// Issue 25: an append must not write one slot twice, nor a slot that is read as a cached
// key; blocks shared for reading (prefix sharing) stay valid.
TEST_F(ErrorsKVCache, AppendTwiceToOneBlockOfASequence) {
  make_paged();
  // Sequence 1: 7 cached keys + 2 new ones, at block_table[1][1] slot 3 and [1][2] slot 0,
  // and both entries name block 3, whose slot 0 holds cached key 4.
  args.cache_seqlens = pool_.int32({5, 7});
  args.block_table = pool_.int32_2d(b, max_blocks, {0, 2, -1, -1, 1, 3, 3, 99});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'block_table': expected append targets that no other append and no cached key use",
                  "got sequence 1 reads block_table[1][1] = block 3, slots 0..2, and sequence 1 appends to block_table[1][2] = block 3, slots 0..0");
}

TEST_F(ErrorsKVCache, AppendOfTwoSequencesToOneBlock) {
  make_paged();
  // Both sequences append to slots 1..2 of block 5.
  args.block_table = pool_.int32_2d(b, max_blocks, {0, 5, -1, -1, 1, 3, 5, 99});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'block_table'",
                  "sequence 0 appends to block_table[0][1] = block 5, slots 1..2, and sequence 1 appends to block_table[1][2] = block 5, slots 1..2");
  EXPECT_REJECTED(Kind::kInvalid, fa::kvcache_workspace_size(args, opts), "argument 'block_table'");
}

TEST_F(ErrorsKVCache, BlocksSharedForReadingAreAccepted) {
  make_paged();
  // Block 0 holds the first 4 cached keys of both sequences; the appends go elsewhere.
  args.block_table = pool_.int32_2d(b, max_blocks, {0, 2, -1, -1, 0, 3, 5, 99});
  expect_accepted([&] { fwd(); });
  // Without new keys nothing is written: any sharing is fine.
  args.block_table = pool_.int32_2d(b, max_blocks, {0, 0, -1, -1, 0, 0, 0, 99});
  args.k_new = args.v_new = fa::Tensor{};
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsKVCache, AppendOfTwoSequencesToOneCacheRow) {
  args.cache_batch_idx = pool_.int32({1, 1});
  // Sequence 0 appends at 5..6 of row 1, where sequence 1 holds cached keys.
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_batch_idx': expected append targets",
                  "got sequence 1 reads cache row 1, slots 0..8, and sequence 0 appends to cache row 1, slots 5..6");
  args.cache_seqlens = pool_.int32({5, 5});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'cache_batch_idx'",
                  "sequence 0 appends to cache row 1, slots 5..6, and sequence 1 appends to cache row 1, slots 5..6");
  // Reading one row from two sequences is fine.
  args.k_new = args.v_new = fa::Tensor{};
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsKVCache, AppendWithKCacheAsVCache) {
  args.v_cache = args.k_cache;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_cache': expected memory apart from k_cache (the append writes both), got the data pointer of k_cache, 0x");
  args.k_new = args.v_new = fa::Tensor{};
  expect_accepted([&] { fwd(); });
}

// Every check of the attention runs before the append: an argument error found on the
// attention's side (the probabilities, lse, the output overlapping the cache) leaves the
// cache as it was (EXPECT_REJECTED compares every buffer before and after).
TEST_F(ErrorsKVCache, AttentionErrorsLeaveTheCacheUnchanged) {
  opts.return_probs = pool_.tensor(f32, {b, h_q, s_q, 5});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.return_probs'", "[2, 4, 1, 11]");
  opts.return_probs = fa::Tensor{};
  lse = pool_.tensor(f32, {b, h_q, s_q + 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse'");
  lse = fa::Tensor{};
  opts.window_left = -2;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.window_left'");
}

TEST_F(ErrorsKVCache, BlockTableBatch) {
  make_paged();
  args.block_table = pool_.int32_2d(1, max_blocks, {0, 1, 2, 3});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'block_table': expected shape[0] == 2 (batch of q), got 1");
}

TEST_F(ErrorsKVCache, NumSplitsNegative) {
  args.num_splits = -1;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'num_splits': expected a value in [0, 256] (0 = heuristic), got -1");
}

TEST_F(ErrorsKVCache, NumSplitsTooMany) {
  args.num_splits = 257;
  EXPECT_REJECTED(Kind::kInvalid, fa::kvcache_workspace_size(args, opts),
                  "flashattn::kvcache_workspace_size: argument 'num_splits'", "got 257");
}

TEST_F(ErrorsKVCache, DropoutIsUnsupported) {
  opts.dropout_p = 0.1f;
  EXPECT_REJECTED(Kind::kUnsupported, fwd(), "argument 'opts.dropout_p': expected 0 (kvcache_forward is inference only)");
}

TEST_F(ErrorsKVCache, ProbsShape) {
  // The longest sequence has 9 + 2 = 11 keys.
  opts.return_probs = pool_.tensor(f32, {b, h_q, s_q, 16}, nan);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'opts.return_probs': expected shape [2, 4, 1, 11] ([b, h_q, s_q, s_k]), got [2, 4, 1, 16]");
}

TEST_F(ErrorsKVCache, OutOverlapsCache) {
  out.data = static_cast<float*>(args.v_cache.data) + 100;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected memory disjoint from input 'v_cache'");
}

TEST_F(ErrorsKVCache, LseOverlapsKNew) {
  lse.data = args.k_new.data;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected memory disjoint from input 'k_new'");
}

TEST_F(ErrorsKVCache, AppendSourceOverlapsCache) {
  args.k_new = fa::Tensor::contiguous(args.k_cache.data, f32, {b, s_new, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_cache': expected memory disjoint from input 'k_new'");
}

TEST_F(ErrorsKVCache, WorkspaceWithoutData) {
  EXPECT_REJECTED(Kind::kInvalid, fwd(fa::Workspace{nullptr, 256}),
                  "argument 'workspace': expected non-null data for 256 bytes, got nullptr");
}

// ------------------------------------------------------------------ KV cache: fp8 and tree mask

// The ErrorsKVCache problem with an fp8 cache (per-head scales [h_k]) and a tree mask
// [b, s_q, 1].
class ErrorsKVCacheFp8 : public ErrorsKVCache {
 protected:
  const fa::DType f8 = fa::DType::kFloat8E4M3;
  ErrorsKVCacheFp8() {
    args.k_cache = pool_.tensor(f8, {3, s_cache, h_k, d});
    args.v_cache = pool_.tensor(f8, {3, s_cache, h_k, d});
    args.k_scale = pool_.tensor(f32, {h_k});
    args.v_scale = pool_.tensor(f32, {h_k});
    args.tree_mask = pool_.int32_2d(b, s_q, {1, 1});
    args.tree_mask.rank = 3;
    args.tree_mask.shape[2] = 1;
    args.tree_mask.stride[2] = 1;
  }
  fa::Tensor tree(std::int64_t rows, std::int64_t words) {
    fa::Tensor t = pool_.int32(std::vector<std::int32_t>(static_cast<std::size_t>(b * rows * words), 1));
    t.rank = 3;
    t.shape[0] = b, t.shape[1] = rows, t.shape[2] = words;
    t.stride[0] = rows * words, t.stride[1] = words, t.stride[2] = 1;
    return t;
  }
};

TEST_F(ErrorsKVCacheFp8, ValidBaselinesAreAccepted) {
  expect_accepted([&] { fwd(); });
  EXPECT_NO_THROW(fa::kvcache_workspace_size(args, opts));
  args.k_scale = pool_.tensor(f32, {3, h_k});  // per (cache row, head)
  args.v_scale = pool_.tensor(f32, {3, h_k});
  expect_accepted([&] { fwd(); });
  args.k_cache = pool_.tensor(f8, {num_blocks, block_size, h_k, d});
  args.v_cache = pool_.tensor(f8, {num_blocks, block_size, h_k, d});
  args.block_table = pool_.int32_2d(b, max_blocks, {0, 2, -1, -1, 1, 3, 5, 99});
  args.k_scale = pool_.tensor(f32, {num_blocks, h_k});  // per (block, head)
  args.v_scale = pool_.tensor(f32, {num_blocks, h_k});
  expect_accepted([&] { fwd(); });
  args.tree_mask = fa::Tensor{};
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsKVCacheFp8, TreeMaskWithoutFp8IsAccepted) {
  args.k_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
  args.v_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
  args.k_scale = args.v_scale = fa::Tensor{};
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsKVCacheFp8, CacheDtypeNeitherQNorFp8) {
  args.k_cache = pool_.tensor(fa::DType::kFloat16, {3, s_cache, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "flashattn::kvcache_forward: argument 'k_cache': expected dtype float32 (same as q) or float8_e4m3 (an fp8 cache), got float16");
}

TEST_F(ErrorsKVCacheFp8, VCacheNotFp8) {
  args.v_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_cache': expected dtype float8_e4m3 (same as k_cache), got float32");
}

TEST_F(ErrorsKVCacheFp8, KCacheNotFp8) {
  args.k_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
  args.k_scale = args.v_scale = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_cache': expected dtype float32 (same as k_cache), got float8_e4m3");
}

TEST_F(ErrorsKVCacheFp8, KScaleMissing) {
  args.k_scale = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'k_scale': expected a defined fp32 tensor [h_k] = [2] or [cache_rows, h_k] = [3, 2] (cache_rows = k_cache.shape[0]) (k_cache is float8_e4m3), got an undefined tensor");
}

TEST_F(ErrorsKVCacheFp8, VScaleMissing) {
  args.v_scale = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fa::kvcache_workspace_size(args, opts),
                  "flashattn::kvcache_workspace_size: argument 'v_scale': expected a defined fp32 tensor", "got an undefined tensor");
}

TEST_F(ErrorsKVCacheFp8, ScaleShape) {
  args.k_scale = pool_.tensor(f32, {h_k + 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'k_scale': expected shape [h_k] = [2] or [cache_rows, h_k] = [3, 2] (cache_rows = k_cache.shape[0]), got [3]");
  args.k_scale = pool_.tensor(f32, {2, h_k});  // rows must match k_cache.shape[0] = 3
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_scale': expected shape [h_k] = [2] or [cache_rows, h_k] = [3, 2]", "got [2, 2]");
  args.k_scale = pool_.tensor(f32, {3, h_k});
  args.v_scale = pool_.tensor(f32, {1, 3, h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_scale': expected shape [h_k] = [2] or [cache_rows, h_k] = [3, 2]", "got [1, 3, 2]");
}

TEST_F(ErrorsKVCacheFp8, ScalePerBlockOfPagedCache) {
  make_paged();
  args.k_cache = pool_.tensor(f8, {num_blocks, block_size, h_k, d});
  args.v_cache = pool_.tensor(f8, {num_blocks, block_size, h_k, d});
  args.k_scale = pool_.tensor(f32, {3, h_k});  // a dense cache's row count, not num_blocks
  args.v_scale = pool_.tensor(f32, {3, h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_scale': expected shape [h_k] = [2] or [cache_rows, h_k] = [6, 2]", "got [3, 2]");
}

TEST_F(ErrorsKVCacheFp8, ScaleDtype) {
  args.v_scale = pool_.tensor(fa::DType::kFloat16, {h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_scale': expected dtype float32 (fp8 dequantization scales), got float16");
}

TEST_F(ErrorsKVCacheFp8, ScaleDevice) {
  args.k_scale.device = fa::Device::cuda(0);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_scale': expected device cpu (same as q), got cuda:0");
}

TEST_F(ErrorsKVCacheFp8, ScaleLastDimNotContiguous) {
  fa::Tensor t = pool_.tensor(f32, {3, 2 * h_k});
  args.v_scale = fa::Tensor::strided(t.data, f32, {3, h_k}, {2 * h_k, 2});
  args.k_scale = pool_.tensor(f32, {3, h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_scale': expected stride[1] == 1 (contiguous last dimension), got 2");
}

TEST_F(ErrorsKVCacheFp8, ScaleLayoutsDiffer) {
  args.v_scale = pool_.tensor(f32, {3, h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'v_scale': expected the layout of k_scale (shape [2], stride[0] 1), got shape [3, 2], stride[0] 2");
  fa::Tensor t = pool_.tensor(f32, {3, 2 * h_k});
  args.k_scale = pool_.tensor(f32, {3, h_k});
  args.v_scale = fa::Tensor::strided(t.data, f32, {3, h_k}, {2 * h_k, 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'v_scale': expected the layout of k_scale (shape [3, 2], stride[0] 2), got shape [3, 2], stride[0] 4");
}

TEST_F(ErrorsKVCacheFp8, ScalesWithoutFp8Cache) {
  args.k_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
  args.v_cache = pool_.tensor(f32, {3, s_cache, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(),
                  "argument 'k_scale': expected an undefined tensor (scales are for a float8_e4m3 cache; k_cache is float32), got a tensor of shape [2]");
  args.k_scale = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'v_scale': expected an undefined tensor (scales are for a float8_e4m3 cache");
}

TEST_F(ErrorsKVCacheFp8, NewKeysMustKeepQsDtype) {
  args.k_new = pool_.tensor(f8, {b, s_new, h_k, d});
  args.v_new = pool_.tensor(f8, {b, s_new, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_new': expected dtype float32 (same as q), got float8_e4m3");
}

TEST_F(ErrorsKVCacheFp8, Fp8QueriesTakeDescalesNotScales) {
  // fp8 q over an fp8 cache is FlashAttention-3's call: opts.q/k/v_descale [b, h_k], no
  // k_scale / v_scale, out bfloat16 / float16.
  args.q = pool_.tensor(f8, {b, s_q, h_q, d});
  out = pool_.tensor(f8, {b, s_q, h_q, d});
  args.k_new = pool_.tensor(f8, {b, s_new, h_k, d});
  args.v_new = pool_.tensor(f8, {b, s_new, h_k, d});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_scale': expected an undefined tensor (q is float8_e4m3");
  args.k_scale = fa::Tensor{};
  args.v_scale = fa::Tensor{};
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'out': expected dtype bfloat16 or float16");
}

TEST_F(ErrorsKVCacheFp8, TreeMaskShape) {
  args.tree_mask = tree(s_q, 2);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'tree_mask': expected shape [2, 1, 1] ([b, s_q, ceil(s_q / 32)]), got [2, 1, 2]");
  args.tree_mask = tree(2, 1);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'tree_mask': expected shape [2, 1, 1] ([b, s_q, ceil(s_q / 32)]), got [2, 2, 1]");
}

TEST_F(ErrorsKVCacheFp8, TreeMaskWordsFollowSq) {
  // s_q = 33 queries need two words per row.
  args.q = pool_.tensor(f32, {b, 33, h_q, d});
  out = pool_.tensor(f32, {b, 33, h_q, d}, nan);
  lse = pool_.tensor(f32, {b, h_q, 33}, nan);
  args.tree_mask = tree(33, 1);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'tree_mask': expected shape [2, 33, 2] ([b, s_q, ceil(s_q / 32)]), got [2, 33, 1]");
  args.tree_mask = tree(33, 2);
  expect_accepted([&] { fwd(); });
}

TEST_F(ErrorsKVCacheFp8, TreeMaskDtype) {
  args.tree_mask = pool_.tensor(f32, {b, s_q, 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'tree_mask': expected dtype int32, got float32");
}

TEST_F(ErrorsKVCacheFp8, TreeMaskDevice) {
  args.tree_mask.device = fa::Device::cuda(0);
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'tree_mask': expected device cpu (same as q), got cuda:0");
}

TEST_F(ErrorsKVCacheFp8, TreeMaskLastDimNotContiguous) {
  fa::Tensor t = tree(s_q, 2);
  t.shape[2] = 1;
  t.stride[2] = 2;
  args.tree_mask = t;
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'tree_mask': expected stride[2] == 1 (contiguous last dimension), got 2");
}

TEST_F(ErrorsKVCacheFp8, LseOverlapsTreeMask) {
  args.tree_mask = fa::Tensor::contiguous(lse.data, fa::DType::kInt32, {b, s_q, 1});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'lse': expected memory disjoint from input 'tree_mask'");
}

TEST_F(ErrorsKVCacheFp8, AppendOverwritesScale) {
  args.k_scale = fa::Tensor::contiguous(args.k_cache.data, f32, {h_k});
  EXPECT_REJECTED(Kind::kInvalid, fwd(), "argument 'k_cache': expected memory disjoint from input 'k_scale'");
}

}  // namespace
