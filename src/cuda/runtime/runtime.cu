// The CUDA backend's runtime services: device queries, supported head dims, the host's
// validation copy of index tensors (skipped while a stream is captured; the checks on the
// device are in index_checks.cu), stream-ordered scratch memory and the in-place KV-cache
// append.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/backend.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_guard.hpp"
#include "flashattn_cuda_manifest.hpp"

namespace flashattn::detail::cuda {

bool built() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error (no driver / no device)
    return 0;
  }
  return n;
}

int compute_capability(int device) noexcept {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

namespace {
// The largest bucket of every sm80 kernel, and of the forward, the backward and the
// KV-cache decode kernel (their 512 bucket).
constexpr int largest_bucket() {
  int d = 0;
#define FLASHATTN_MAX_BUCKET_D(D) d = D > d ? D : d;
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_MAX_BUCKET_D)
#undef FLASHATTN_MAX_BUCKET_D
  return d;
}
constexpr int largest_wide_bucket() {
  int d = largest_bucket();
#define FLASHATTN_MAX_BUCKET_D(D) d = D > d ? D : d;
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_MAX_BUCKET_D)
#undef FLASHATTN_MAX_BUCKET_D
  return d;
}
}  // namespace

// Any d % 8 == 0 up to the largest compiled bucket runs in the next bucket up.
bool supports_head_dim(int d) noexcept { return d > 0 && d % 8 == 0 && d <= largest_bucket(); }
int head_dim_bucket(int d) noexcept {
  int bucket = 0;
#define FLASHATTN_BUCKET_OF_D(D) \
  if (bucket == 0 && d > 0 && d <= D) bucket = D;
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_BUCKET_OF_D)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_BUCKET_OF_D)
#undef FLASHATTN_BUCKET_OF_D
  return bucket;
}
bool supports_wide_head_dim(int d) noexcept {
  return d > 0 && d % 8 == 0 && d <= largest_wide_bucket();
}

bool copy_to_host_for_validation(void* dst, const void* src, std::size_t bytes, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(s, &capture);
  if (err != cudaSuccess) {
    // The legacy stream under a global-mode capture elsewhere: no copy is allowed now.
    cudaGetLastError();
    return false;
  }
  if (capture != cudaStreamCaptureStatusNone) return false;
  if (bytes == 0) return true;
  FLASHATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  FLASHATTN_CUDA_CHECK(cudaStreamSynchronize(s));
  return true;
}

void* alloc_async(std::size_t bytes, void* stream) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  FLASHATTN_CUDA_CHECK(cudaMallocAsync(&ptr, bytes, static_cast<cudaStream_t>(stream)));
  return ptr;
}

void free_async(void* ptr, void* stream) {
  if (ptr != nullptr) cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));
}

namespace {

// One thread per 8-element chunk (16 bytes; 8 of float8_e4m3 k_new / v_new, copied as
// bytes into an fp8 cache, or of 16-bit ones quantized into it) of a new (sequence, row,
// KV head) row of k_new and v_new;
// the destination row is cache position cache_seqlens[b] + r through the cache layout
// (dense with cache_batch_idx, or paged through the block table). kSplitWidths: v has its
// own head dim (d_v != d): the chunks span the wider of the two rows, K's copied where
// col < d, V's where col < d_v.
// `skip`: the device check's verdict (AppendVerdict), one word per check block, or null.
template <bool kSplitWidths>
__global__ void append_kv_kernel(const __grid_constant__ AppendParams p, const int* skip, int skip_count) {
  if (skip != nullptr) {
    // Any append conflict found: no row is written (before the bounds return below, so
    // that every thread reaches the barrier).
    const int found = threadIdx.x < skip_count ? skip[threadIdx.x] : 0;
    if (__syncthreads_or(found)) return;
  }
  const int b = blockIdx.y;
  const int chunks_per_row = (kSplitWidths ? max(p.d, p.d_v) : p.d) / 8;
  const std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t total = std::int64_t(p.seqlen_new) * p.h_k * chunks_per_row;
  if (idx >= total) return;
  const int chunk = static_cast<int>(idx % chunks_per_row);
  const int head = static_cast<int>((idx / chunks_per_row) % p.h_k);
  const int r = static_cast<int>(idx / (std::int64_t(chunks_per_row) * p.h_k));
  // Index guards (params.hpp; checked on the device by default, on the host with
  // FLASHATTN_DEVICE_INDEX_CHECKS=0 outside graph capture): a destination outside the
  // cache (cache_seqlens[b] < 0 or past capacity - s_new, a cache_batch_idx or block id out
  // of range) is not written; the attention then reads the clamped positions
  // (docs/semantics.md).
  const std::int64_t len = p.cache.cache_seqlens[b];
  if (len < 0 || len > p.cache.cache_capacity() - p.seqlen_new) return;
  const std::int64_t j = len + r;
  if (p.cache.cache_batch_idx != nullptr) {
    const int row = p.cache.cache_batch_idx[b];
    if (row < 0 || row >= p.cache.kv_cache_rows) return;
  }
  if (p.cache.block_table != nullptr) {
    const int blk = p.cache.block_table[std::int64_t(b) * p.cache.block_table_batch_stride + j / p.cache.block_size];
    if (blk < 0 || blk >= p.cache.kv_cache_rows) return;
  }
  const int col = chunk * 8;
  const bool k_col = !kSplitWidths || col < p.d, v_col = !kSplitWidths || col < p.d_v;
  if (p.dtype == DType::kFloat8E4M3) {
    // float8_e4m3 k_new / v_new (fp8 q, FlashAttention-3) into the fp8 cache: their bytes,
    // 8 per chunk (8-byte aligned: 16-byte aligned rows, col % 8 == 0).
    const auto* kb = static_cast<const std::uint8_t*>(p.k_new) + std::int64_t(b) * p.kn_batch_stride +
                     std::int64_t(r) * p.kn_row_stride + std::int64_t(head) * p.kn_head_stride + col;
    const auto* vb = static_cast<const std::uint8_t*>(p.v_new) + std::int64_t(b) * p.vn_batch_stride +
                     std::int64_t(r) * p.vn_row_stride + std::int64_t(head) * p.vn_head_stride + col;
    auto* kc = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p.cache.k)) +
               p.cache.k_offset(b, j, head) + col;
    auto* vc = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p.cache.v)) +
               p.cache.v_offset(b, j, head) + col;
    if (k_col) *reinterpret_cast<uint2*>(kc) = *reinterpret_cast<const uint2*>(kb);
    if (v_col) *reinterpret_cast<uint2*>(vc) = *reinterpret_cast<const uint2*>(vb);
    return;
  }
  const auto* kn = static_cast<const std::uint16_t*>(p.k_new) + std::int64_t(b) * p.kn_batch_stride +
                   std::int64_t(r) * p.kn_row_stride + std::int64_t(head) * p.kn_head_stride + col;
  const auto* vn = static_cast<const std::uint16_t*>(p.v_new) + std::int64_t(b) * p.vn_batch_stride +
                   std::int64_t(r) * p.vn_row_stride + std::int64_t(head) * p.vn_head_stride + col;
  if (p.cache.kv_dtype == DType::kFloat8E4M3) {
    // e4m3(x / scale), round to nearest even, saturating at +-448 (KVCacheArgs).
    const std::int64_t at = p.cache.kv_block(b, j) * p.cache.scale_block_stride + head;
    const float ks = p.cache.k_scale[at], vs = p.cache.v_scale[at];
    const bool bf16 = p.dtype == DType::kBFloat16;
    auto quantize = [bf16](const std::uint16_t* src, float scale) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      std::uint32_t outw[2] = {0u, 0u};
      for (int e = 0; e < 8; ++e) {
        const std::uint16_t bits = static_cast<std::uint16_t>(w[e / 2] >> (16 * (e % 2)));
        float x;
        if (bf16) {
          x = __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
        } else {
          __half_raw hr;
          hr.x = bits;
          x = __half2float(__half(hr));
        }
        const std::uint32_t q = __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3);
        outw[e / 4] |= (q & 0xffu) << (8 * (e % 4));
      }
      return make_uint2(outw[0], outw[1]);
    };
    auto* kc = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p.cache.k)) +
               p.cache.k_offset(b, j, head) + col;
    auto* vc = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p.cache.v)) +
               p.cache.v_offset(b, j, head) + col;
    if (k_col) *reinterpret_cast<uint2*>(kc) = quantize(kn, ks);
    if (v_col) *reinterpret_cast<uint2*>(vc) = quantize(vn, vs);
    return;
  }
  auto* kc = const_cast<std::uint16_t*>(static_cast<const std::uint16_t*>(p.cache.k)) +
             p.cache.k_offset(b, j, head) + col;
  auto* vc = const_cast<std::uint16_t*>(static_cast<const std::uint16_t*>(p.cache.v)) +
             p.cache.v_offset(b, j, head) + col;
  if (k_col) *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
  if (v_col) *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
}

}  // namespace

void append_kv(const AppendParams& p, AppendVerdict verdict) {
  if (p.batch == 0 || p.seqlen_new == 0 || p.h_k == 0) return;
  const bool bytes = p.dtype == DType::kFloat8E4M3 && p.cache.kv_dtype == DType::kFloat8E4M3;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16 && !bytes) {
    throw Unsupported("flashattn::kvcache_forward", "k_new",
                      "dtype float16 or bfloat16 on CUDA (or float8_e4m3 into a float8_e4m3 cache)",
                      dtype_name(p.dtype));
  }
  if (p.d % 8 != 0) {
    throw Unsupported("flashattn::kvcache_forward", "k_new", "head dim d % 8 == 0 on CUDA",
                      std::to_string(p.d));
  }
  if (p.d_v % 8 != 0 || p.d_v <= 0) {
    throw Unsupported("flashattn::kvcache_forward", "v_new", "head dim d_v % 8 == 0 on CUDA",
                      std::to_string(p.d_v));
  }
  DeviceGuard guard(p.device_index);
  constexpr int kThreads = 256;
  const bool split = p.d_v != p.d;
  const std::int64_t total = std::int64_t(p.seqlen_new) * p.h_k * (std::max(p.d, p.d_v) / 8);
  const dim3 grid(static_cast<unsigned>((total + kThreads - 1) / kThreads),
                  static_cast<unsigned>(p.batch));
  static_assert(kThreads * sizeof(int) >= kAppendVerdictBytes, "one verdict word per thread");
  const auto kernel = split ? append_kv_kernel<true> : append_kv_kernel<false>;
  kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p, verdict.flags, verdict.count);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda
