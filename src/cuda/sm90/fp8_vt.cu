// The fp8 forward's copy of V transposed: V^T[b][g][c][j'] (one byte each), the layout the
// 8-bit wgmma reads as the B operand of O += P V (K-major: keys contiguous), with the keys of
// every 32-key step in the order of the P fragment (fp8_vt_key, fwd_kernel.cuh's to_p).
// Keys past a sequence's end (to a multiple of kFp8VtTile) are zero, so the kernel needs no
// tail zeroing: masked probabilities are 0 and meet zero values. Layout: fwd.hpp.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm90/fwd.hpp"

namespace flashattn::detail::cuda::sm90 {

namespace {

constexpr int kVtKeys = 64;      // keys per thread block
constexpr int kVtThreads = 256;
constexpr int kVtMaxCols = 256;  // d_v

// Key (within its 32-key step) whose value A's column `pos` meets: the P fragment's
// register holds the thread's keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (+ 16) at columns
// 4 t .. 4 t + 3 (+ 16).
__device__ __forceinline__ int fp8_vt_key(int pos) {
  const int i = pos % 4, t = (pos % 16) / 4;
  return (pos / 16) * 16 + 2 * t + (i & 1) + 8 * (i >> 1);
}

__global__ void __launch_bounds__(kVtThreads) fp8_vt_kernel(const __grid_constant__ FwdParams p,
                                                             std::uint8_t* __restrict__ vt, std::int64_t rows) {
  __shared__ __align__(16) std::uint8_t tile[kVtKeys][kVtMaxCols + 16];
  const int j0 = blockIdx.x * kVtKeys, g = blockIdx.y, b = blockIdx.z;
  const int s_k = p.seq_len_k(b);
  if (j0 >= (s_k + kFp8VtTile - 1) / kFp8VtTile * kFp8VtTile) return;  // past the zeros a tile reads
  const int cols = p.d_v;  // a multiple of 16
  const auto* v = static_cast<const std::uint8_t*>(p.v);
  const std::int64_t base = p.cu_seqlens_k != nullptr
                                ? std::int64_t(p.k_start(b)) * p.v_row_stride
                                : std::int64_t(b) * p.v_batch_stride;
  const int chunks = cols / 16;
  for (int idx = threadIdx.x; idx < kVtKeys * chunks; idx += kVtThreads) {
    const int r = idx / chunks, c = idx % chunks;
    const int j = j0 + r;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (j < s_k) {
      x = *reinterpret_cast<const uint4*>(v + base + std::int64_t(j) * p.v_row_stride +
                                          std::int64_t(g) * p.v_head_stride + 16 * c);
    }
    *reinterpret_cast<uint4*>(&tile[r][16 * c]) = x;
  }
  __syncthreads();
  std::uint8_t* out = vt + std::int64_t(g) * cols * rows + fp8_vt_row0(p, b) + j0;
  // Task (column, 16-key chunk): four threads write one column's 64 keys (64 bytes).
  for (int idx = threadIdx.x; idx < cols * (kVtKeys / 16); idx += kVtThreads) {
    const int col = idx / (kVtKeys / 16), q = idx % (kVtKeys / 16);
    std::uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      std::uint32_t word = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = 16 * q + 4 * k + e;  // within the block's 64 keys
        const int key = (pos / 32) * 32 + fp8_vt_key(pos % 32);
        word |= std::uint32_t(tile[key][col]) << (8 * e);
      }
      w[k] = word;
    }
    *reinterpret_cast<uint4*>(out + std::int64_t(col) * rows + 16 * q) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace

std::size_t fp8_vt_bytes(const FwdParams& p) noexcept {
  if (p.q_dtype != DType::kFloat8E4M3) return 0;
  return std::size_t(p.h_k) * std::size_t(p.d_v) * std::size_t(fp8_vt_rows(p));
}

void transpose_v_fp8(const FwdParams& p, void* vt) {
  // seqlen_k bounds every sequence's keys (varlen: max_seqlen_k); blocks past a sequence's
  // padded keys return at once.
  const int blocks = (p.seqlen_k + kFp8VtTile - 1) / kFp8VtTile * (kFp8VtTile / kVtKeys);
  const dim3 grid(unsigned(blocks), unsigned(p.h_k), unsigned(p.batch));
  fp8_vt_kernel<<<grid, kVtThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p, static_cast<std::uint8_t*>(vt),
                                                                             fp8_vt_rows(p));
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda::sm90
