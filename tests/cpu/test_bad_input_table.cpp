// Bad input as a table (issue 24): every row mutates one valid baseline call and asserts
// (1) the error type, (2) that the message names the argument with its expected and
// actual value, and (3) that no buffer was written (outputs are poisoned with a byte
// pattern and every buffer of the call is compared byte for byte afterwards).
// test_errors.cpp holds the detailed one-case-per-test suite; this table runs every
// entry point through one parameterized test, plus the valid edge cases (empty batch,
// zero lengths) and tensors whose element offsets pass 2^31.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/half.hpp"

namespace fa = flashattn;
using ::testing::HasSubstr;

namespace {

constexpr std::byte kPoison{0xA5};

// Owns every buffer of a call: inputs random, outputs poisoned.
class Pool {
 public:
  fa::Tensor input(fa::DType dtype, std::initializer_list<std::int64_t> shape) {
    fa::Tensor t = alloc(dtype, shape);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto* at = static_cast<std::byte*>(t.data);
    for (std::int64_t i = 0; i < t.numel(); ++i) store(dtype, dist(rng_), at + i * fa::dtype_size(dtype));
    return t;
  }
  fa::Tensor output(fa::DType dtype, std::initializer_list<std::int64_t> shape) {
    return alloc(dtype, shape);  // already poisoned
  }
  fa::Tensor int32(const std::vector<std::int32_t>& values) {
    fa::Tensor t = alloc(fa::DType::kInt32, {static_cast<std::int64_t>(values.size())});
    if (!values.empty()) std::memcpy(t.data, values.data(), values.size() * 4);
    return t;
  }
  fa::Tensor int32_2d(std::int64_t rows, std::int64_t cols, const std::vector<std::int32_t>& v) {
    fa::Tensor t = alloc(fa::DType::kInt32, {rows, cols});
    std::memcpy(t.data, v.data(), v.size() * 4);
    return t;
  }
  fa::Tensor int32_shaped(std::initializer_list<std::int64_t> shape, const std::vector<std::int32_t>& v) {
    fa::Tensor t = alloc(fa::DType::kInt32, shape);
    if (!v.empty()) std::memcpy(t.data, v.data(), v.size() * 4);
    return t;
  }
  std::vector<std::vector<std::byte>> snapshot() const {
    std::vector<std::vector<std::byte>> copy;
    for (const auto& b : buffers_) copy.push_back(*b);
    return copy;
  }

 private:
  fa::Tensor alloc(fa::DType dtype, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    // 16 spare bytes, poisoned too: a write just past the end shows as well.
    buffers_.push_back(std::make_unique<std::vector<std::byte>>(
        static_cast<std::size_t>(n) * fa::dtype_size(dtype) + 16, kPoison));
    return fa::Tensor::contiguous(buffers_.back()->data(), dtype, shape);
  }
  static void store(fa::DType dtype, float x, std::byte* at) {
    switch (dtype) {
      case fa::DType::kFloat16: { const std::uint16_t h = fa::float_to_fp16(x); std::memcpy(at, &h, 2); break; }
      case fa::DType::kBFloat16: { const std::uint16_t h = fa::float_to_bf16(x); std::memcpy(at, &h, 2); break; }
      case fa::DType::kFloat64: { const double d = x; std::memcpy(at, &d, 8); break; }
      case fa::DType::kFloat8E4M3: *at = std::byte{0x38}; break;  // 1.0
      case fa::DType::kInt32: { const std::int32_t v = 0; std::memcpy(at, &v, 4); break; }
      case fa::DType::kFloat32: std::memcpy(at, &x, 4); break;
    }
  }
  std::mt19937 rng_{24};
  std::vector<std::unique_ptr<std::vector<std::byte>>> buffers_;
};

enum class Entry { kForward, kBackward, kVarlenForward, kVarlenBackward, kKVCache };

// The valid baseline of every entry point, fp32 on the CPU.
//   dense:  b = 2, s_q = 5, s_k = 7, h_q = 4, h_k = 2, d = 8
//   varlen: q lengths 2, 0, 5 (total 7); k lengths 3, 4, 1 (total 8)
//   kvcache: dense cache [3, 16, 2, 8] holding 5 and 9 keys, 2 new keys each; paged
//            variant (make_paged): 6 blocks of 4 rows, 4 blocks per sequence.
struct Call {
  static constexpr std::int64_t b = 2, s_q = 5, s_k = 7, h_q = 4, h_k = 2, d = 8;
  static constexpr fa::DType f32 = fa::DType::kFloat32;
  Pool pool;
  Entry entry = Entry::kForward;
  fa::Options opts;
  // dense
  fa::Tensor q = pool.input(f32, {b, s_q, h_q, d}), k = pool.input(f32, {b, s_k, h_k, d}),
             v = pool.input(f32, {b, s_k, h_k, d});
  fa::Tensor out = pool.output(f32, {b, s_q, h_q, d}), lse = pool.output(f32, {b, h_q, s_q});
  fa::Tensor dout = pool.input(f32, {b, s_q, h_q, d}), lse_in = pool.input(f32, {b, h_q, s_q});
  fa::Tensor dq = pool.output(f32, {b, s_q, h_q, d}), dk = pool.output(f32, {b, s_k, h_k, d}),
             dv = pool.output(f32, {b, s_k, h_k, d});
  // varlen
  fa::VarlenArgs va = varlen_args();
  fa::Tensor vout = pool.output(f32, {7, h_q, d}), vlse = pool.output(f32, {h_q, 7});
  fa::Tensor vdout = pool.input(f32, {7, h_q, d}), vlse_in = pool.input(f32, {h_q, 7});
  fa::Tensor vdq = pool.output(f32, {7, h_q, d}), vdk = pool.output(f32, {8, h_k, d}),
             vdv = pool.output(f32, {8, h_k, d});
  // kv cache (the caches are written in place by a valid call: poisoned-by-snapshot)
  fa::KVCacheArgs ka = kv_args();
  fa::Tensor kout = pool.output(f32, {b, 1, h_q, d}), klse = pool.output(f32, {b, h_q, 1});

  fa::VarlenArgs varlen_args() {
    fa::VarlenArgs a;
    a.q = pool.input(f32, {7, h_q, d});
    a.k = pool.input(f32, {8, h_k, d});
    a.v = pool.input(f32, {8, h_k, d});
    a.cu_seqlens_q = pool.int32({0, 2, 2, 7});
    a.cu_seqlens_k = pool.int32({0, 3, 7, 8});
    a.max_seqlen_q = 5;
    a.max_seqlen_k = 4;
    return a;
  }
  fa::KVCacheArgs kv_args() {
    fa::KVCacheArgs a;
    a.q = pool.input(f32, {b, 1, h_q, d});
    a.k_cache = pool.input(f32, {3, 16, h_k, d});
    a.v_cache = pool.input(f32, {3, 16, h_k, d});
    a.cache_seqlens = pool.int32({5, 9});
    a.k_new = pool.input(f32, {b, 2, h_k, d});
    a.v_new = pool.input(f32, {b, 2, h_k, d});
    return a;
  }
  void make_paged() {
    ka.k_cache = pool.input(f32, {6, 4, h_k, d});
    ka.v_cache = pool.input(f32, {6, 4, h_k, d});
    // 7 and 11 keys after the append: blocks 0, 2 and 1, 3, 5 are used.
    ka.block_table = pool.int32_2d(b, 4, {0, 2, -1, -1, 1, 3, 5, 99});
  }

  void run() {
    switch (entry) {
      case Entry::kForward: fa::forward(q, k, v, out, lse, opts); break;
      case Entry::kBackward: fa::backward(dout, q, k, v, out, lse_in, dq, dk, dv, opts); break;
      case Entry::kVarlenForward: fa::varlen_forward(va, vout, vlse, opts); break;
      case Entry::kVarlenBackward:
        fa::varlen_backward(va, vdout, out_of_varlen(), vlse_in, vdq, vdk, vdv, opts);
        break;
      case Entry::kKVCache: fa::kvcache_forward(ka, kout, klse, opts); break;
    }
  }
  // The backward's `out` input: a separate input buffer (vout is the forward's output).
  fa::Tensor varlen_out_in = pool.input(f32, {7, h_q, d});
  fa::Tensor out_of_varlen() const { return varlen_out_in; }
};

enum class Kind { kInvalid, kUnsupported };

struct Row {
  const char* name;
  Entry entry;
  std::function<void(Call&)> mutate;
  Kind kind;
  const char* argument;  // the argument named in the message
  const char* expected;  // a substring of the expected part
  const char* actual;    // a substring of the actual part
};

fa::Tensor with_stride(fa::Tensor t, int dim, std::int64_t stride) {
  t.stride[dim] = stride;
  return t;
}
fa::Tensor with_shape(fa::Tensor t, int dim, std::int64_t size) {
  t.shape[dim] = size;
  return t;
}

constexpr auto F = Entry::kForward;
constexpr auto B = Entry::kBackward;
constexpr auto VF = Entry::kVarlenForward;
constexpr auto VB = Entry::kVarlenBackward;
constexpr auto KV = Entry::kKVCache;
constexpr auto I = Kind::kInvalid;
constexpr auto U = Kind::kUnsupported;
constexpr auto f16 = fa::DType::kFloat16;
constexpr auto bf16 = fa::DType::kBFloat16;
constexpr auto f32 = fa::DType::kFloat32;
constexpr auto f64 = fa::DType::kFloat64;
constexpr auto i32 = fa::DType::kInt32;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A valid block-sparse mask for the dense baseline (s_q = 5, s_k = 7): 4 x 4 blocks, so
// M = 2 query blocks and N = 2 key blocks; query block 0 visits key blocks 1 and 0, query
// block 1 visits key block 0 (entries past the count are never read).
void block_sparse(Call& c, std::vector<std::int32_t> cnt = {2, 1},
                  std::vector<std::int32_t> idx = {1, 0, 0, -5}) {
  c.opts.block_sparse.block_size_q = 4;
  c.opts.block_sparse.block_size_k = 4;
  c.opts.block_sparse.mask_block_cnt = c.pool.int32_shaped({1, 1, 2}, cnt);
  c.opts.block_sparse.mask_block_idx = c.pool.int32_shaped({1, 1, 2, 2}, idx);
}

constexpr auto f8 = fa::DType::kFloat8E4M3;

// The dense baseline with fp8 q, k, v, a bf16 out and valid descales ([b, h_k] = [2, 2]).
void fp8_dense(Call& c) {
  c.q = c.pool.input(f8, {2, 5, 4, 8});
  c.k = c.pool.input(f8, {2, 7, 2, 8});
  c.v = c.pool.input(f8, {2, 7, 2, 8});
  c.out = c.pool.output(bf16, {2, 5, 4, 8});
  c.opts.q_descale = c.pool.input(f32, {2, 2});
  c.opts.k_descale = c.pool.input(f32, {2, 2});
  c.opts.v_descale = c.pool.input(f32, {2, 2});
}

// FlashAttention-3's fp8 KV-cache call on the kvcache baseline: fp8 q, caches, k_new /
// v_new, descales [b, h_k], out bfloat16.
void fp8_kv(Call& c) {
  c.ka.q = c.pool.input(f8, {2, 1, 4, 8});
  c.ka.k_cache = c.pool.input(f8, {3, 16, 2, 8});
  c.ka.v_cache = c.pool.input(f8, {3, 16, 2, 8});
  c.ka.k_new = c.pool.input(f8, {2, 2, 2, 8});
  c.ka.v_new = c.pool.input(f8, {2, 2, 2, 8});
  c.kout = c.pool.output(bf16, {2, 1, 4, 8});
  c.opts.q_descale = c.pool.input(f32, {2, 2});
  c.opts.k_descale = c.pool.input(f32, {2, 2});
  c.opts.v_descale = c.pool.input(f32, {2, 2});
}

std::vector<Row> rows() {
  using C = Call;
  return {
      // ---------------------------------------------------------------- dtypes
      {"q_int32", F, [](C& c) { c.q = c.pool.input(i32, {2, 5, 4, 8}); c.k = c.pool.input(i32, {2, 7, 2, 8}); c.v = c.pool.input(i32, {2, 7, 2, 8}); c.out = c.pool.output(i32, {2, 5, 4, 8}); },
       I, "q", "a floating-point dtype", "int32"},
      // fp8 q, k, v (issue 21): out bf16 / fp16, descales fp32 [b, h_k], forward only.
      {"fp8_out_float8", F, [](C& c) { fp8_dense(c); c.out = c.pool.output(f8, {2, 5, 4, 8}); },
       I, "out", "dtype bfloat16 or float16 (the output of float8_e4m3 q, k, v)", "float8_e4m3"},
      {"fp8_out_float32", F, [](C& c) { fp8_dense(c); c.out = c.pool.output(f32, {2, 5, 4, 8}); },
       I, "out", "bfloat16 or float16", "float32"},
      {"fp8_out_shape", F, [](C& c) { fp8_dense(c); c.out = c.pool.output(bf16, {2, 5, 4, 4}); },
       I, "out", "shape [2, 5, 4, 8]", "[2, 5, 4, 4]"},
      {"fp8_q_bf16_k", F, [](C& c) { fp8_dense(c); c.k = c.pool.input(bf16, {2, 7, 2, 8}); },
       I, "k", "dtype float8_e4m3 (same as q)", "bfloat16"},
      {"fp8_q_descale_h_q", F, [](C& c) { fp8_dense(c); c.opts.q_descale = c.pool.input(f32, {2, 4}); },
       I, "opts.q_descale", "shape [2, 2] ([b, h_k], one per (sequence, KV head))", "[2, 4]"},
      {"fp8_k_descale_float16", F, [](C& c) { fp8_dense(c); c.opts.k_descale = c.pool.input(f16, {2, 2}); },
       I, "opts.k_descale", "dtype float32", "float16"},
      {"fp8_v_descale_stride", F, [](C& c) { fp8_dense(c); c.opts.v_descale = with_stride(c.pool.input(f32, {2, 2}), 1, 2); },
       I, "opts.v_descale", "stride[1] == 1", "2"},
      {"descale_without_fp8", F, [](C& c) { c.opts.v_descale = c.pool.input(f32, {2, 2}); },
       I, "opts.v_descale", "an undefined tensor when q is not float8_e4m3", "float32"},
      {"fp8_backward", B, [](C& c) { fp8_dense(c); },
       U, "q", "no backward for float8_e4m3 q, k, v", "float8_e4m3"},
      {"bwd_descale_without_fp8", B, [](C& c) { c.opts.q_descale = c.pool.input(f32, {2, 2}); },
       I, "opts.q_descale", "an undefined tensor when q is not float8_e4m3", "float32"},
      {"fp8_varlen_descale_shape", VF, [](C& c) { c.va.q = c.pool.input(f8, {7, 4, 8}); c.va.k = c.pool.input(f8, {8, 2, 8}); c.va.v = c.pool.input(f8, {8, 2, 8}); c.vout = c.pool.output(bf16, {7, 4, 8}); c.opts.k_descale = c.pool.input(f32, {2, 2}); },
       I, "opts.k_descale", "shape [3, 2]", "[2, 2]"},
      {"fp8_varlen_backward", VB, [](C& c) { c.va.q = c.pool.input(f8, {7, 4, 8}); c.va.k = c.pool.input(f8, {8, 2, 8}); c.va.v = c.pool.input(f8, {8, 2, 8}); },
       U, "q", "no backward for float8_e4m3 q, k, v", "float8_e4m3"},
      {"fp8_kv_q_bf16_cache", KV, [](C& c) { fp8_kv(c); c.ka.k_cache = c.pool.input(bf16, {3, 16, 2, 8}); c.ka.v_cache = c.pool.input(bf16, {3, 16, 2, 8}); },
       I, "k_cache", "dtype float8_e4m3 (q is float8_e4m3", "bfloat16"},
      {"fp8_kv_q_with_k_scale", KV, [](C& c) { fp8_kv(c); c.ka.k_scale = c.pool.input(f32, {2}); c.ka.v_scale = c.pool.input(f32, {2}); },
       I, "k_scale", "an undefined tensor (q is float8_e4m3", "shape [2]"},
      {"fp8_kv_k_new_bf16", KV, [](C& c) { fp8_kv(c); c.ka.k_new = c.pool.input(bf16, {2, 2, 2, 8}); c.ka.v_new = c.pool.input(bf16, {2, 2, 2, 8}); },
       I, "k_new", "dtype float8_e4m3 (same as q)", "bfloat16"},
      {"fp8_kv_out_float32", KV, [](C& c) { fp8_kv(c); c.kout = c.pool.output(f32, {2, 1, 4, 8}); },
       I, "out", "dtype bfloat16 or float16", "float32"},
      {"fp8_kv_k_descale_b_cache", KV, [](C& c) { fp8_kv(c); c.opts.k_descale = c.pool.input(f32, {3, 2}); },
       I, "opts.k_descale", "shape [2, 2] ([b, h_k]", "[3, 2]"},
      {"fp8_kv_q_descale_float16", KV, [](C& c) { fp8_kv(c); c.opts.q_descale = c.pool.input(f16, {2, 2}); },
       I, "opts.q_descale", "dtype float32", "float16"},
      {"fp8_kv_qv", KV, [](C& c) { fp8_kv(c); c.opts.qv = c.pool.input(f8, {2, 1, 4, 8}); },
       U, "opts.qv", "no fp8 qv", "shape [2, 1, 4, 8]"},
      {"fp8_kv_dropout", KV, [](C& c) { fp8_kv(c); c.opts.dropout_p = 0.1f; },
       U, "opts.dropout_p", "0 (kvcache_forward is inference only)", "0.1"},
      {"kv_descale_with_bf16_q", KV, [](C& c) { c.opts.v_descale = c.pool.input(f32, {2, 2}); },
       I, "opts.v_descale", "an undefined tensor when q is not float8_e4m3", "float32"},
      {"mixed_k_float64", F, [](C& c) { c.k = c.pool.input(f64, {2, 7, 2, 8}); }, I, "k", "dtype float32 (same as q)", "float64"},
      {"mixed_v_bfloat16", F, [](C& c) { c.v = c.pool.input(bf16, {2, 7, 2, 8}); }, I, "v", "dtype float32 (same as k)", "bfloat16"},
      {"mixed_out_float16", F, [](C& c) { c.out = c.pool.output(f16, {2, 5, 4, 8}); }, I, "out", "dtype float32 (same as q)", "float16"},
      {"lse_float64", F, [](C& c) { c.lse = c.pool.output(f64, {2, 4, 5}); }, I, "lse", "dtype float32", "float64"},
      {"bwd_mixed_dq_float16", B, [](C& c) { c.dq = c.pool.output(f16, {2, 5, 4, 8}); }, I, "dq", "dtype float32 (same as q)", "float16"},
      {"bwd_mixed_dout_float64", B, [](C& c) { c.dout = c.pool.input(f64, {2, 5, 4, 8}); }, I, "dout", "dtype float32 (same as q)", "float64"},
      {"alibi_float64", F, [](C& c) { c.opts.alibi_slopes = c.pool.input(f64, {4}); }, I, "opts.alibi_slopes", "dtype float32", "float64"},
      // ---------------------------------------------------------------- shapes, strides
      {"k_head_dim_mismatch", F, [](C& c) { c.k = c.pool.input(f32, {2, 7, 2, 16}); }, I, "k", "shape[3] == 8 (head dim of q)", "16"},
      {"k_batch_mismatch", F, [](C& c) { c.k = c.pool.input(f32, {3, 7, 2, 8}); }, I, "k", "shape[0] == 2 (batch of q)", "3"},
      {"v_seqlen_mismatch", F, [](C& c) { c.v = c.pool.input(f32, {2, 6, 2, 8}); }, I, "v", "shape [2, 7, 2, 8] (same as k but any head dim d_v)", "[2, 6, 2, 8]"},
      {"kv_heads_not_dividing", F, [](C& c) { c.k = c.pool.input(f32, {2, 7, 3, 8}); c.v = c.pool.input(f32, {2, 7, 3, 8}); }, I, "k", "dividing h_q = 4", "3"},
      {"out_shape", F, [](C& c) { c.out = c.pool.output(f32, {2, 4, 4, 8}); }, I, "out", "shape [2, 5, 4, 8] (same as q but the head dim d_v of v)", "[2, 4, 4, 8]"},
      {"lse_shape", F, [](C& c) { c.lse = c.pool.output(f32, {2, 5, 4}); }, I, "lse", "shape [2, 4, 5] ([b, h_q, s_q])", "[2, 5, 4]"},
      {"q_rank3", F, [](C& c) { c.q = c.pool.input(f32, {5, 4, 8}); }, I, "q", "rank 4 [b, s_q, h_q, d]", "rank 3"},
      {"q_last_stride_2", F, [](C& c) { c.q = with_stride(c.q, 3, 2); }, I, "q", "stride[3] == 1 (contiguous last dimension)", "2"},
      {"v_last_stride_0", F, [](C& c) { c.v = with_stride(c.v, 3, 0); }, I, "v", "stride[3] == 1", "0"},
      {"out_last_stride_2", F, [](C& c) { c.out = with_stride(c.out, 3, 2); }, I, "out", "stride[3] == 1", "2"},
      {"bwd_dk_shape", B, [](C& c) { c.dk = c.pool.output(f32, {2, 7, 4, 8}); }, I, "dk", "shape [2, 7, 2, 8] (same as k)", "[2, 7, 4, 8]"},
      {"bwd_dout_last_stride_2", B, [](C& c) { c.dout = with_stride(c.dout, 3, 2); }, I, "dout", "stride[3] == 1", "2"},
      {"bwd_lse_missing", B, [](C& c) { c.lse_in = fa::Tensor{}; }, I, "lse", "a defined tensor", "an undefined tensor"},
      // ---------------------------------------------------------------- head dim
      {"head_dim_0", F, [](C& c) { c.q = c.pool.input(f32, {2, 5, 4, 0}); c.k = c.pool.input(f32, {2, 7, 2, 0}); c.v = c.pool.input(f32, {2, 7, 2, 0}); c.out = c.pool.output(f32, {2, 5, 4, 0}); },
       U, "q", "head dim d in [1, 512]", "d = 0"},
      {"head_dim_520", F, [](C& c) { c.q = c.pool.input(f32, {2, 5, 4, 520}); c.k = c.pool.input(f32, {2, 7, 2, 520}); c.v = c.pool.input(f32, {2, 7, 2, 520}); c.out = c.pool.output(f32, {2, 5, 4, 520}); },
       U, "q", "head dim d in [1, 512]", "d = 520"},
      {"bwd_head_dim_520", B, [](C& c) { for (fa::Tensor* t : {&c.q, &c.out, &c.dout}) *t = c.pool.input(f32, {2, 5, 4, 520}); c.dq = c.pool.output(f32, {2, 5, 4, 520}); for (fa::Tensor* t : {&c.k, &c.v}) *t = c.pool.input(f32, {2, 7, 2, 520}); c.dk = c.pool.output(f32, {2, 7, 2, 520}); c.dv = c.pool.output(f32, {2, 7, 2, 520}); },
       U, "q", "head dim d in [1, 512]", "d = 520"},
      // ---------------------------------------------------------------- options
      {"window_left_-2", F, [](C& c) { c.opts.window_left = -2; }, I, "opts.window_left", ">= -1", "-2"},
      {"window_right_-7", F, [](C& c) { c.opts.window_right = -7; }, I, "opts.window_right", ">= -1", "-7"},
      {"window_left_int_min", F, [](C& c) { c.opts.window_left = std::numeric_limits<int>::min(); }, I, "opts.window_left", ">= -1", "-2147483648"},
      {"bwd_window_right_-2", B, [](C& c) { c.opts.window_right = -2; }, I, "opts.window_right", ">= -1", "-2"},
      {"softmax_scale_nan", F, [](C& c) { c.opts.softmax_scale = kNaN; }, I, "opts.softmax_scale", "a finite value", "nan"},
      {"softmax_scale_inf", F, [](C& c) { c.opts.softmax_scale = kInf; }, I, "opts.softmax_scale", "a finite value", "inf"},
      {"softmax_scale_-inf", B, [](C& c) { c.opts.softmax_scale = -kInf; }, I, "opts.softmax_scale", "a finite value", "-inf"},
      {"softcap_nan", F, [](C& c) { c.opts.softcap = kNaN; }, I, "opts.softcap", "a finite value >= 0", "nan"},
      {"softcap_inf", F, [](C& c) { c.opts.softcap = kInf; }, I, "opts.softcap", "a finite value >= 0", "inf"},
      {"softcap_negative", B, [](C& c) { c.opts.softcap = -1.0f; }, I, "opts.softcap", "a finite value >= 0", "-1"},
      {"dropout_1", F, [](C& c) { c.opts.dropout_p = 1.0f; }, I, "opts.dropout_p", "a value in [0, 1)", "1"},
      {"dropout_negative", F, [](C& c) { c.opts.dropout_p = -0.25f; }, I, "opts.dropout_p", "a value in [0, 1)", "-0.25"},
      {"dropout_nan", B, [](C& c) { c.opts.dropout_p = kNaN; }, I, "opts.dropout_p", "a value in [0, 1)", "nan"},
      {"dropout_above_1", VF, [](C& c) { c.opts.dropout_p = 1.5f; }, I, "opts.dropout_p", "a value in [0, 1)", "1.5"},
      {"alibi_shape_h_k", F, [](C& c) { c.opts.alibi_slopes = c.pool.input(f32, {2}); }, I, "opts.alibi_slopes", "shape [4] or [2, 4]", "[2]"},
      {"alibi_shape_transposed", F, [](C& c) { c.opts.alibi_slopes = c.pool.input(f32, {4, 2}); }, I, "opts.alibi_slopes", "shape [4] or [2, 4]", "[4, 2]"},
      {"varlen_alibi_shape", VF, [](C& c) { c.opts.alibi_slopes = c.pool.input(f32, {2, 4}); }, I, "opts.alibi_slopes", "shape [4] or [3, 4]", "[2, 4]"},
      // ---------------------------------------------------------------- block-sparse masks
      {"bs_cnt_float32", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_cnt = c.pool.input(f32, {1, 1, 2}); }, I, "opts.block_sparse.mask_block_cnt", "dtype int32", "float32"},
      {"bs_cnt_rank2", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_cnt = c.pool.int32_shaped({1, 2}, {2, 1}); }, I, "opts.block_sparse.mask_block_cnt", "rank 3", "2"},
      {"bs_idx_missing", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_idx = {}; }, I, "opts.block_sparse.mask_block_idx", "", ""},
      {"bs_cnt_batch_3", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_cnt = c.pool.int32_shaped({3, 1, 2}, {0, 0, 0, 0, 0, 0}); }, I, "opts.block_sparse.mask_block_cnt", "shape[0] == 2 (batch: 1 or b)", "3"},
      {"bs_cnt_heads_2", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_cnt = c.pool.int32_shaped({1, 2, 2}, {0, 0, 0, 0}); }, I, "opts.block_sparse.mask_block_cnt", "shape[1] == 4 (heads: 1 or h_q)", "2"},
      {"bs_block_size_q_disagrees", F, [](C& c) { block_sparse(c); c.opts.block_sparse.block_size_q = 2; }, I, "opts.block_sparse.mask_block_cnt", "M = ceil(s_q / block_size_q) = ceil(5 / 2) = 3", "2"},
      {"bs_block_size_k_disagrees", F, [](C& c) { block_sparse(c); c.opts.block_sparse.block_size_k = 8; }, I, "opts.block_sparse.mask_block_idx", "N = ceil(s_k / block_size_k) = ceil(7 / 8) = 1", "[1, 1, 2, 2]"},
      {"bs_block_size_zero", F, [](C& c) { block_sparse(c); c.opts.block_sparse.block_size_k = 0; }, I, "opts.block_sparse.block_size_k", ">= 1", "0"},
      {"bs_idx_shape", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_idx = c.pool.int32_shaped({1, 1, 2, 3}, {1, 0, 0, 0, 0, 0}); }, I, "opts.block_sparse.mask_block_idx", "shape [1, 1, 2, 2]", "[1, 1, 2, 3]"},
      {"bs_count_above_n", F, [](C& c) { block_sparse(c, {3, 1}); }, I, "opts.block_sparse.mask_block_cnt", "counts in [0, N = ceil(s_k / block_size_k) = ceil(7 / 4) = 2] at [0, 0, 0]", "3"},
      {"bs_count_negative", F, [](C& c) { block_sparse(c, {2, -1}); }, I, "opts.block_sparse.mask_block_cnt", "counts in [0, N", "-1"},
      {"bs_index_out_of_range", F, [](C& c) { block_sparse(c, {2, 1}, {1, 2, 0, 0}); }, I, "opts.block_sparse.mask_block_idx", "key block indices in [0, N) (N = ceil(s_k / block_size_k) = ceil(7 / 4) = 2) at [0, 0, 0, 1]", "2"},
      {"bs_index_negative", F, [](C& c) { block_sparse(c, {2, 1}, {1, 0, -1, 0}); }, I, "opts.block_sparse.mask_block_idx", "key block indices in [0, N)", "-1"},
      {"bs_index_duplicated", F, [](C& c) { block_sparse(c, {2, 1}, {1, 1, 0, 0}); }, I, "opts.block_sparse.mask_block_idx", "each key block listed at most once", "key block 1 listed again"},
      {"bs_full_and_mask_same_block", F, [](C& c) { block_sparse(c); c.opts.block_sparse.full_block_cnt = c.pool.int32_shaped({1, 1, 2}, {0, 1}); c.opts.block_sparse.full_block_idx = c.pool.int32_shaped({1, 1, 2, 2}, {0, 0, 0, 0}); }, I, "opts.block_sparse.full_block_idx", "each key block listed at most once", "key block 0 listed again"},
      {"bs_full_cnt_without_idx", F, [](C& c) { block_sparse(c); c.opts.block_sparse.full_block_cnt = c.pool.int32_shaped({1, 1, 2}, {0, 0}); }, I, "opts.block_sparse.full_block_idx", "a tensor, since opts.block_sparse.full_block_cnt is given", "an undefined tensor"},
      {"bs_cnt_device_cuda", F, [](C& c) { block_sparse(c); c.opts.block_sparse.mask_block_cnt.device = fa::Device::cuda(0); }, I, "opts.block_sparse.mask_block_cnt", "device cpu (same as q)", "cuda:0"},
      {"bs_q_doc_ids_only", F, [](C& c) { block_sparse(c); c.opts.block_sparse.q_doc_ids = c.pool.int32_2d(2, 5, std::vector<std::int32_t>(10, 0)); }, I, "opts.block_sparse.k_doc_ids", "both or neither", "an undefined tensor"},
      {"bs_doc_ids_shape", F, [](C& c) { block_sparse(c); c.opts.block_sparse.q_doc_ids = c.pool.int32_2d(2, 5, std::vector<std::int32_t>(10, 0)); c.opts.block_sparse.k_doc_ids = c.pool.int32_2d(2, 5, std::vector<std::int32_t>(10, 0)); }, I, "opts.block_sparse.k_doc_ids", "shape [2, 7]", "[2, 5]"},
      {"bs_prefix_negative", F, [](C& c) { block_sparse(c); c.opts.block_sparse.prefix_keys = c.pool.int32({3, -2}); }, I, "opts.block_sparse.prefix_keys", "values >= 0 at [1]", "-2"},
      {"bs_prefix_shape", F, [](C& c) { block_sparse(c); c.opts.block_sparse.prefix_keys = c.pool.int32({1, 2, 3}); }, I, "opts.block_sparse.prefix_keys", "shape [1] or [2] ([1] or [b])", "[3]"},
      {"bs_prefix_without_lists", F, [](C& c) { c.opts.block_sparse.prefix_keys = c.pool.int32({3, 2}); }, I, "opts.block_sparse.prefix_keys", "an undefined tensor when opts.block_sparse has no block lists", "a defined tensor"},
      {"bwd_bs_count_above_n", B, [](C& c) { block_sparse(c, {1, 5}); }, I, "opts.block_sparse.mask_block_cnt", "counts in [0, N", "5"},
      {"varlen_bs_block_size_disagrees", VF, [](C& c) { block_sparse(c); }, I, "opts.block_sparse.mask_block_idx", "N = ceil(max_seqlen_k / block_size_k) = ceil(4 / 4) = 1", "[1, 1, 2, 2]"},
      {"varlen_bwd_bs_doc_ids_shape", VB, [](C& c) { block_sparse(c, {1, 1}, {0, 0}); c.opts.block_sparse.mask_block_idx = c.pool.int32_shaped({1, 1, 2, 1}, {0, 0}); c.opts.block_sparse.q_doc_ids = c.pool.int32_2d(2, 5, std::vector<std::int32_t>(10, 0)); c.opts.block_sparse.k_doc_ids = c.pool.int32(std::vector<std::int32_t>(8, 0)); }, I, "opts.block_sparse.q_doc_ids", "shape [7] ([total_q])", "[2, 5]"},
      {"varlen_bs_count_above_n", VF, [](C& c) { block_sparse(c, {2, 0}, {0, 0}); c.opts.block_sparse.mask_block_idx = c.pool.int32_shaped({1, 1, 2, 1}, {0, 0}); }, I, "opts.block_sparse.mask_block_cnt", "counts in [0, N = ceil(max_seqlen_k / block_size_k) = ceil(4 / 4) = 1]", "2"},
      {"kv_bs_unsupported", KV, [](C& c) { block_sparse(c); }, U, "opts.block_sparse", "undefined lists (KV-cache calls take no block-sparse mask)", "a block-sparse mask"},
      // ---------------------------------------------------------------- learnable sink
      {"sink_float64", F, [](C& c) { c.opts.learnable_sink = c.pool.input(f64, {4}); }, I, "opts.learnable_sink", "dtype float32", "float64"},
      {"kv_sink_float16", KV, [](C& c) { c.opts.learnable_sink = c.pool.input(f16, {4}); }, I, "opts.learnable_sink", "dtype float32", "float16"},
      {"sink_shape_h_k", F, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {2}); }, I, "opts.learnable_sink", "shape [4] ([h_q], one logit per query head)", "[2]"},
      {"varlen_sink_shape_2d", VF, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {3, 4}); }, I, "opts.learnable_sink", "shape [4]", "[3, 4]"},
      {"bwd_sink_shape", B, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {5}); }, I, "opts.learnable_sink", "shape [4]", "[5]"},
      {"sink_device_cuda", F, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {4}); c.opts.learnable_sink.device = fa::Device::cuda(0); }, I, "opts.learnable_sink", "device cpu (same as q)", "cuda:0"},
      {"bwd_sink_grad_without_sink", B, [](C& c) { c.opts.learnable_sink_grad = c.pool.output(f32, {4}); }, I, "opts.learnable_sink_grad", "an undefined tensor when opts.learnable_sink is undefined", "a tensor of shape [4]"},
      {"bwd_sink_grad_shape", B, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {4}); c.opts.learnable_sink_grad = c.pool.output(f32, {2}); }, I, "opts.learnable_sink_grad", "shape [4]", "[2]"},
      {"varlen_bwd_sink_grad_bfloat16", VB, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {4}); c.opts.learnable_sink_grad = c.pool.output(bf16, {4}); }, I, "opts.learnable_sink_grad", "dtype float32", "bfloat16"},
      {"bwd_sink_grad_device_cuda", B, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {4}); c.opts.learnable_sink_grad = c.pool.output(f32, {4}); c.opts.learnable_sink_grad.device = fa::Device::cuda(0); }, I, "opts.learnable_sink_grad", "device cpu (same as q)", "cuda:0"},
      {"bwd_sink_grad_is_the_sink", B, [](C& c) { c.opts.learnable_sink = c.pool.input(f32, {4}); c.opts.learnable_sink_grad = c.opts.learnable_sink; }, I, "opts.learnable_sink_grad", "memory disjoint from input 'opts.learnable_sink'", "bytes ["},
      // ---------------------------------------------------------------- seqused_q
      {"varlen_seqused_q_shape", VF, [](C& c) { c.va.seqused_q = c.pool.int32({2, 0}); }, I, "seqused_q", "shape [3] ([b])", "[2]"},
      {"varlen_seqused_q_float32", VF, [](C& c) { c.va.seqused_q = c.pool.input(f32, {3}); }, I, "seqused_q", "dtype int32", "float32"},
      {"varlen_seqused_q_too_long", VF, [](C& c) { c.va.seqused_q = c.pool.int32({2, 0, 6}); }, I, "seqused_q", "seqused_q[2] in [0, 5] (the query length of sequence 2)", "seqused_q[2] = 6"},
      {"varlen_bwd_seqused_q_negative", VB, [](C& c) { c.va.seqused_q = c.pool.int32({-1, 0, 5}); }, I, "seqused_q", "seqused_q[0] in [0, 2]", "seqused_q[0] = -1"},
      // ---------------------------------------------------------------- devices
      {"mixed_devices_k_cuda", F, [](C& c) { c.k.device = fa::Device::cuda(0); }, I, "k", "device cpu (same as q)", "cuda:0"},
      {"mixed_devices_out_cuda", F, [](C& c) { c.out.device = fa::Device::cuda(0); }, I, "out", "device cpu (same as q)", "cuda:0"},
      {"mixed_devices_cu_seqlens_cuda", VF, [](C& c) { c.va.cu_seqlens_k.device = fa::Device::cuda(0); }, I, "cu_seqlens_k", "device cpu", "cuda:0"},
      {"mixed_devices_cache_seqlens_cuda", KV, [](C& c) { c.ka.cache_seqlens.device = fa::Device::cuda(0); }, I, "cache_seqlens", "device cpu", "cuda:0"},
      // ---------------------------------------------------------------- cu_seqlens, seqused_k
      {"cu_seqlens_q_float32", VF, [](C& c) { c.va.cu_seqlens_q = c.pool.input(f32, {4}); }, I, "cu_seqlens_q", "dtype int32", "float32"},
      {"cu_seqlens_k_wrong_length", VF, [](C& c) { c.va.cu_seqlens_k = c.pool.int32({0, 3, 7}); }, I, "cu_seqlens_k", "shape [4]", "[3]"},
      {"cu_seqlens_q_not_monotone", VF, [](C& c) { c.va.cu_seqlens_q = c.pool.int32({0, 4, 2, 7}); }, I, "cu_seqlens_q", "non-decreasing values", "cu_seqlens_q[2] = 2 < cu_seqlens_q[1] = 4"},
      {"cu_seqlens_q_not_from_0", VF, [](C& c) { c.va.cu_seqlens_q = c.pool.int32({1, 2, 2, 7}); }, I, "cu_seqlens_q", "cu_seqlens_q[0] == 0", "1"},
      {"cu_seqlens_k_overrun", VF, [](C& c) { c.va.cu_seqlens_k = c.pool.int32({0, 3, 7, 9}); }, I, "cu_seqlens_k", "cu_seqlens_k[3] <= 8 (k.shape[0])", "9"},
      {"bwd_cu_seqlens_k_not_monotone", VB, [](C& c) { c.va.cu_seqlens_k = c.pool.int32({0, 3, 2, 8}); }, I, "cu_seqlens_k", "non-decreasing values", "cu_seqlens_k[2] = 2"},
      {"max_seqlen_q_too_small", VF, [](C& c) { c.va.max_seqlen_q = 4; }, I, "max_seqlen_q", ">= 5", "4"},
      {"seqused_k_above_seqlen", VF, [](C& c) { c.va.seqused_k = c.pool.int32({3, 5, 1}); }, I, "seqused_k", "seqused_k[1] in [0, 4]", "seqused_k[1] = 5"},
      {"seqused_k_negative", VB, [](C& c) { c.va.seqused_k = c.pool.int32({-1, 4, 1}); }, I, "seqused_k", "seqused_k[0] in [0, 3]", "seqused_k[0] = -1"},
      // ---------------------------------------------------------------- kv cache
      {"cache_seqlens_beyond_capacity", KV, [](C& c) { c.ka.cache_seqlens = c.pool.int32({5, 15}); }, I, "cache_seqlens", "cache_seqlens[i] + s_new <= 16", "cache_seqlens[1] + 2 = 17"},
      {"paged_cache_seqlens_beyond_capacity", KV, [](C& c) { c.make_paged(); c.ka.cache_seqlens = c.pool.int32({15, 9}); }, I, "cache_seqlens", "cache_seqlens[i] + s_new <= 16", "cache_seqlens[0] + 2 = 17"},
      {"cache_seqlens_float32", KV, [](C& c) { c.ka.cache_seqlens = c.pool.input(f32, {2}); }, I, "cache_seqlens", "dtype int32", "float32"},
      {"block_table_negative", KV, [](C& c) { c.make_paged(); c.ka.block_table = c.pool.int32_2d(2, 4, {0, -3, -1, -1, 1, 3, 5, 99}); }, I, "block_table", "used entries in [0, 6)", "block_table[0][1] = -3"},
      {"block_table_out_of_range", KV, [](C& c) { c.make_paged(); c.ka.block_table = c.pool.int32_2d(2, 4, {0, 2, -1, -1, 1, 6, 5, 99}); }, I, "block_table", "used entries in [0, 6)", "block_table[1][1] = 6"},
      {"block_table_float32", KV, [](C& c) { c.make_paged(); c.ka.block_table = c.pool.input(f32, {2, 4}); }, I, "block_table", "dtype int32", "float32"},
      {"cache_leftpad_float32", KV, [](C& c) { c.ka.cache_leftpad = c.pool.input(f32, {2}); }, I, "cache_leftpad", "dtype int32", "float32"},
      {"cache_leftpad_shape", KV, [](C& c) { c.ka.cache_leftpad = c.pool.int32({0, 1, 2}); }, I, "cache_leftpad", "[2]", "[3]"},
      {"cache_leftpad_negative", KV, [](C& c) { c.ka.cache_leftpad = c.pool.int32({0, -1}); }, I, "cache_leftpad", "values in [0, cache_seqlens[i]]", "cache_leftpad[1] = -1"},
      {"cache_leftpad_past_seqlens", KV, [](C& c) { c.ka.cache_leftpad = c.pool.int32({6, 0}); }, I, "cache_leftpad", "cache_seqlens[0] = 5", "cache_leftpad[0] = 6"},
      {"cache_leftpad_paged", KV, [](C& c) { c.make_paged(); c.ka.cache_leftpad = c.pool.int32({0, 1}); }, U, "cache_leftpad", "a paged cache", "shape [2]"},
      {"cache_batch_idx_out_of_range", KV, [](C& c) { c.ka.cache_batch_idx = c.pool.int32({0, 3}); }, I, "cache_batch_idx", "values in [0, 3)", "cache_batch_idx[1] = 3"},
      {"kv_mixed_k_new_float64", KV, [](C& c) { c.ka.k_new = c.pool.input(f64, {2, 2, 2, 8}); c.ka.v_new = c.pool.input(f64, {2, 2, 2, 8}); }, I, "k_new", "dtype float32 (same as q)", "float64"},
      {"kv_window_left_-2", KV, [](C& c) { c.opts.window_left = -2; }, I, "opts.window_left", ">= -1", "-2"},
      {"kv_softcap_nan", KV, [](C& c) { c.opts.softcap = kNaN; }, I, "opts.softcap", "a finite value >= 0", "nan"},
      // ---------------------------------------------------------------- head dims of v (d_v), qv
      {"v_head_dim_520", F, [](C& c) { c.v = c.pool.input(f32, {2, 7, 2, 520}); c.out = c.pool.output(f32, {2, 5, 4, 520}); }, U, "v", "head dim d_v in [1, 512] (CPU backend)", "d_v = 520"},
      {"v_head_dim_0", F, [](C& c) { c.v = c.pool.input(f32, {2, 7, 2, 0}); c.out = c.pool.output(f32, {2, 5, 4, 0}); }, U, "v", "head dim d_v in [1, 512] (CPU backend)", "d_v = 0"},
      {"out_head_dim_not_v", F, [](C& c) { c.v = c.pool.input(f32, {2, 7, 2, 4}); }, I, "out", "shape [2, 5, 4, 4] (same as q but the head dim d_v of v)", "[2, 5, 4, 8]"},
      {"v_rank_3", F, [](C& c) { c.v = c.pool.input(f32, {2, 7, 16}); }, I, "v", "rank 4 [b, s_k, h_k, d_v]", "rank 3"},
      {"bwd_dout_head_dim_not_v", B, [](C& c) { for (fa::Tensor* t : {&c.v}) *t = c.pool.input(f32, {2, 7, 2, 16}); c.out = c.pool.input(f32, {2, 5, 4, 16}); c.dv = c.pool.output(f32, {2, 7, 2, 16}); }, I, "dout", "shape [2, 5, 4, 16] (same as q but the head dim d_v of v)", "[2, 5, 4, 8]"},
      {"bwd_dv_head_dim_of_k", B, [](C& c) { c.v = c.pool.input(f32, {2, 7, 2, 16}); c.out = c.pool.input(f32, {2, 5, 4, 16}); c.dout = c.pool.input(f32, {2, 5, 4, 16}); }, I, "dv", "shape [2, 7, 2, 16] (same as v)", "[2, 7, 2, 8]"},
      {"varlen_out_head_dim_not_v", VF, [](C& c) { c.va.v = c.pool.input(f32, {8, 2, 12}); }, I, "out", "shape [7, 4, 12] (same as q but the head dim d_v of v)", "[7, 4, 8]"},
      {"kv_v_cache_head_dim_520", KV, [](C& c) { c.ka.v_cache = c.pool.input(f32, {3, 16, 2, 520}); c.ka.v_new = c.pool.input(f32, {2, 2, 2, 520}); c.kout = c.pool.output(f32, {2, 1, 4, 520}); }, U, "v_cache", "head dim d_v in [1, 512]", "d_v = 520"},
      {"kv_v_new_head_dim_not_v_cache", KV, [](C& c) { c.ka.v_cache = c.pool.input(f32, {3, 16, 2, 16}); c.kout = c.pool.output(f32, {2, 1, 4, 16}); }, I, "v_new", "shape [2, 2, 2, 16] (same as k_new but the head dim d_v of v_cache)", "[2, 2, 2, 8]"},
      {"kv_v_cache_blocks_not_k_cache", KV, [](C& c) { c.ka.v_cache = c.pool.input(f32, {3, 8, 2, 8}); }, I, "v_cache", "shape [3, 16, 2, 8] (same as k_cache but any head dim d_v)", "[3, 8, 2, 8]"},
      {"kv_qv_head_dim", KV, [](C& c) { c.opts.qv = c.pool.input(f32, {2, 1, 4, 4}); }, I, "opts.qv", "shape [2, 1, 4, 8] (same as q but the head dim d_v of v)", "[2, 1, 4, 4]"},
      {"kv_qv_heads", KV, [](C& c) { c.opts.qv = c.pool.input(f32, {2, 1, 2, 8}); }, I, "opts.qv", "shape [2, 1, 4, 8]", "[2, 1, 2, 8]"},
      {"kv_qv_float64", KV, [](C& c) { c.opts.qv = c.pool.input(f64, {2, 1, 4, 8}); }, I, "opts.qv", "dtype float32 (same as q)", "float64"},
      {"kv_qv_device_cuda", KV, [](C& c) { c.opts.qv = c.pool.input(f32, {2, 1, 4, 8}); c.opts.qv.device = fa::Device::cuda(0); }, I, "opts.qv", "device cpu (same as q)", "cuda:0"},
      {"qv_head_dim_of_q", F, [](C& c) { c.opts.qv = c.pool.input(f32, {2, 5, 4, 16}); c.v = c.pool.input(f32, {2, 7, 2, 12}); c.out = c.pool.output(f32, {2, 5, 4, 12}); }, I, "opts.qv", "shape [2, 5, 4, 12] (same as q but the head dim d_v of v)", "[2, 5, 4, 16]"},
      {"varlen_qv_rows", VF, [](C& c) { c.opts.qv = c.pool.input(f32, {6, 4, 8}); }, I, "opts.qv", "shape [7, 4, 8]", "[6, 4, 8]"},
      {"qv_overlaps_out", F, [](C& c) { c.opts.qv = c.out; }, I, "out", "memory disjoint from input 'opts.qv'", "bytes"},
      {"bwd_qv", B, [](C& c) { c.opts.qv = c.pool.input(f32, {2, 5, 4, 8}); }, U, "opts.qv", "an undefined tensor (qv has no backward, as in FlashAttention-3", "a tensor of shape [2, 5, 4, 8]"},
      {"varlen_bwd_qv", VB, [](C& c) { c.opts.qv = c.pool.input(f32, {7, 4, 8}); }, U, "opts.qv", "an undefined tensor (qv has no backward", "a tensor of shape [7, 4, 8]"},
      // ---------------------------------------------------------------- sizes past 2^31
      {"q_seqlen_2^31", F, [](C& c) { c.q = with_shape(c.q, 1, std::int64_t{1} << 31); }, I, "q", "shape[1] < 2^31", "2147483648"},
      {"varlen_k_total_2^31", VF, [](C& c) { c.va.k = with_shape(c.va.k, 0, std::int64_t{1} << 31); }, I, "k", "shape[0] < 2^31", "2147483648"},
      // Offsets of 2^62 elements: no tensor can span that many bytes (nor can the byte
      // range that the overlap check computes): must be rejected, not wrapped around.
      {"q_batch_stride_2^62", F, [](C& c) { c.q = with_stride(c.q, 0, std::int64_t{1} << 62); }, I, "q", "element offsets", "stride"},
      {"out_stride_int64_max", F, [](C& c) { c.out = with_stride(c.out, 1, std::numeric_limits<std::int64_t>::max()); }, I, "out", "element offsets", "stride"},
      {"k_cache_stride_2^61", KV, [](C& c) { c.ka.k_cache = with_stride(c.ka.k_cache, 0, std::int64_t{1} << 61); }, I, "k_cache", "element offsets", "stride"},
  };
}

class BadInput : public ::testing::TestWithParam<Row> {};

TEST_P(BadInput, RejectedNamingTheArgumentWithNothingWritten) {
  const Row& row = GetParam();
  Call call;
  call.entry = row.entry;
  row.mutate(call);
  const auto before = call.pool.snapshot();
  std::string message;
  bool unsupported = false;
  try {
    call.run();
    ADD_FAILURE() << "the call was accepted";
  } catch (const fa::Unsupported& e) {
    message = e.what(), unsupported = true;
    EXPECT_EQ(e.argument(), row.argument) << message;
  } catch (const fa::InvalidArgument& e) {
    message = e.what();
    EXPECT_EQ(e.argument(), row.argument) << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an argument error: " << e.what();
  }
  EXPECT_EQ(unsupported, row.kind == Kind::kUnsupported) << message;
  EXPECT_THAT(message, HasSubstr(std::string("argument '") + row.argument + "': expected "));
  const std::size_t got = message.rfind(", got ");
  ASSERT_NE(got, std::string::npos) << message;
  EXPECT_THAT(message.substr(0, got), HasSubstr(row.expected));
  EXPECT_THAT(message.substr(got), HasSubstr(row.actual));
  EXPECT_TRUE(call.pool.snapshot() == before) << "a rejected call wrote memory";
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::ValuesIn(rows()),
                         [](const ::testing::TestParamInfo<Row>& info) {
                           std::string n;
                           for (char ch : std::string(info.param.name)) {
                             n += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           }
                           return n;
                         });

TEST(BadInputTable, HasAtLeast40Rows) { EXPECT_GE(rows().size(), 40u); }

// ---------------------------------------------------------------- valid edge cases

// An empty batch and zero lengths are valid: no error, and the right result (a query
// row that sees no key has out = 0 and lse = -inf, semantics::empty_row_lse).
TEST(BadInputValid, EmptyDenseBatch) {
  Pool pool;
  fa::Tensor q = pool.input(f32, {0, 5, 4, 8}), k = pool.input(f32, {0, 7, 2, 8});
  fa::Tensor out = pool.output(f32, {0, 5, 4, 8}), lse = pool.output(f32, {0, 4, 5});
  const auto before = pool.snapshot();
  EXPECT_NO_THROW(fa::forward(q, k, k, out, lse));
  EXPECT_TRUE(pool.snapshot() == before);  // nothing to write, not even the spare bytes
}

TEST(BadInputValid, EmptyVarlenBatch) {
  Pool pool;
  fa::VarlenArgs a;
  a.q = pool.input(f32, {0, 4, 8});
  a.k = a.v = pool.input(f32, {0, 2, 8});
  a.cu_seqlens_q = a.cu_seqlens_k = pool.int32({0});
  fa::Tensor out = pool.output(f32, {0, 4, 8}), lse = pool.output(f32, {4, 0});
  const auto before = pool.snapshot();
  EXPECT_NO_THROW(fa::varlen_forward(a, out, lse));
  EXPECT_TRUE(pool.snapshot() == before);
}

TEST(BadInputValid, ZeroKeysGiveEmptyRows) {
  Pool pool;
  fa::Tensor q = pool.input(f32, {2, 3, 4, 8}), k = pool.input(f32, {2, 0, 2, 8});
  fa::Tensor out = pool.output(f32, {2, 3, 4, 8}), lse = pool.output(f32, {2, 4, 3});
  ASSERT_NO_THROW(fa::forward(q, k, k, out, lse));
  const auto* o = static_cast<const float*>(out.data);
  const auto* l = static_cast<const float*>(lse.data);
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(o[i], 0.0f) << i;
  for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(l[i], -kInf) << i;
}

TEST(BadInputValid, ZeroLengthSequencesInVarlen) {
  // q lengths 0, 3, 0; k lengths 2, 0, 0: sequence 1 sees no key, the others have no query.
  Pool pool;
  fa::VarlenArgs a;
  a.q = pool.input(f32, {3, 4, 8});
  a.k = a.v = pool.input(f32, {2, 2, 8});
  a.cu_seqlens_q = pool.int32({0, 0, 3, 3});
  a.cu_seqlens_k = pool.int32({0, 2, 2, 2});
  a.max_seqlen_q = 3, a.max_seqlen_k = 2;
  fa::Tensor out = pool.output(f32, {3, 4, 8}), lse = pool.output(f32, {4, 3});
  ASSERT_NO_THROW(fa::varlen_forward(a, out, lse));
  const auto* o = static_cast<const float*>(out.data);
  const auto* l = static_cast<const float*>(lse.data);
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(o[i], 0.0f) << i;
  for (std::int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(l[i], -kInf) << i;
}

// ---------------------------------------------------------------- offsets past 2^31

// A q whose second batch starts 2^31 + 64 elements after the first (8 GiB of address
// space reserved, two pages touched): the result must equal the call on a compact copy.
TEST(BadInputValid, ElementOffsetsPast2To31AreComputedCorrectly) {
  constexpr std::int64_t b = 2, s = 3, h = 2, d = 8, far = (std::int64_t{1} << 31) + 64;
  const std::size_t bytes = static_cast<std::size_t>(far + s * h * d) * sizeof(float);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  std::unique_ptr<void, std::function<void(void*)>> unmap(base, [bytes](void* p) { munmap(p, bytes); });
  Pool pool;
  fa::Tensor compact = pool.input(f32, {b, s, h, d});
  auto* far_q = static_cast<float*>(base);
  const auto* src = static_cast<const float*>(compact.data);
  std::memcpy(far_q, src, s * h * d * sizeof(float));
  std::memcpy(far_q + far, src + s * h * d, s * h * d * sizeof(float));
  const fa::Tensor q = fa::Tensor::strided(base, f32, {b, s, h, d}, {far, h * d, d, 1});
  const fa::Tensor k = pool.input(f32, {b, 4, h, d}), v = pool.input(f32, {b, 4, h, d});
  fa::Tensor out1 = pool.output(f32, {b, s, h, d}), out2 = pool.output(f32, {b, s, h, d});
  fa::Tensor lse1 = pool.output(f32, {b, h, s}), lse2 = pool.output(f32, {b, h, s});
  fa::forward(compact, k, v, out1, lse1);
  fa::forward(q, k, v, out2, lse2);
  EXPECT_EQ(0, std::memcmp(out1.data, out2.data, out1.numel() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(lse1.data, lse2.data, lse1.numel() * sizeof(float)));
}

// Strides past 2^31 on dimensions of extent 1 never move: valid, and the same result.
TEST(BadInputValid, HugeStridesOnUnitDimensions) {
  Pool pool;
  fa::Tensor q = pool.input(f32, {1, 1, 4, 8}), k = pool.input(f32, {1, 5, 2, 8});
  fa::Tensor out1 = pool.output(f32, {1, 1, 4, 8}), out2 = pool.output(f32, {1, 1, 4, 8});
  fa::forward(q, k, k, out1, fa::Tensor{});
  fa::Tensor q_far = q;
  q_far.stride[0] = q_far.stride[1] = std::int64_t{1} << 40;
  fa::forward(q_far, k, k, out2, fa::Tensor{});
  EXPECT_EQ(0, std::memcmp(out1.data, out2.data, out1.numel() * sizeof(float)));
}

}  // namespace
