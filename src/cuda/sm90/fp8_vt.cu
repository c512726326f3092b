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

constexpr int kVtKeys = 128;     // keys per thread block
constexpr int kVtThreads = 256;
constexpr int kVtMaxCols = 256;  // d_v
constexpr int kVtPitch = kVtMaxCols;  // bytes per staged key row
static_assert(kFp8VtTile % kVtKeys == 0, "a V^T tile is whole blocks");

// Key (within its 32-key step) whose value A's column `pos` meets: the P fragment's
// register holds the thread's keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (+ 16) at columns
// 4 t .. 4 t + 3 (+ 16).
__device__ __forceinline__ int fp8_vt_key(int pos) {
  const int i = pos % 4, t = (pos % 16) / 4;
  return (pos / 16) * 16 + 2 * t + (i & 1) + 8 * (i >> 1);
}

// Bytes {a.b_i, b.b_i, a.b_(i+1), b.b_(i+1)} for i = 0 (lo) or 2 (hi), and the 4 x 4 byte
// transpose built from them: out[c] holds byte c of in[0..3].
__device__ __forceinline__ std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t sel) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ void transpose4x4(const std::uint32_t (&in)[4], std::uint32_t (&out)[4]) {
  const std::uint32_t lo01 = prmt(in[0], in[1], 0x5140), lo23 = prmt(in[2], in[3], 0x5140);
  const std::uint32_t hi01 = prmt(in[0], in[1], 0x7362), hi23 = prmt(in[2], in[3], 0x7362);
  out[0] = prmt(lo01, lo23, 0x5410);
  out[1] = prmt(lo01, lo23, 0x7632);
  out[2] = prmt(hi01, hi23, 0x5410);
  out[3] = prmt(hi01, hi23, 0x7632);
}

// Where key row r's 16-byte chunk c is staged: the chunks of rows 16 q .. 16 q + 15 are
// XOR-permuted by q, so that the eight 16-key chunks of one column group (a warp's lanes
// below) read eight different bank groups.
__device__ __forceinline__ int vt_staged(int r, int c) { return r * kVtPitch + 16 * (c ^ ((r >> 4) & 7)); }

// One block stages 128 keys x d_v bytes in shared memory (16-byte loads), then each task
// (4 columns, 16 keys) reads 16 words - the four columns of 16 keys in P's order - and
// transposes them in registers into one 16-byte store per column. Eight consecutive lanes
// take the eight 16-key chunks of one column group: each column's 128 keys are one
// contiguous 128-byte store of the warp.
__global__ void __launch_bounds__(kVtThreads) fp8_vt_kernel(const __grid_constant__ FwdParams p,
                                                             std::uint8_t* __restrict__ vt, std::int64_t rows) {
  __shared__ __align__(16) std::uint8_t tile[kVtKeys * kVtPitch];
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
    *reinterpret_cast<uint4*>(&tile[vt_staged(r, c)]) = x;
  }
  __syncthreads();
  std::uint8_t* out = vt + std::int64_t(g) * cols * rows + fp8_vt_row0(p, b) + j0;
  const int groups = cols / 4;  // 4-column groups
  for (int idx = threadIdx.x; idx < groups * (kVtKeys / 16); idx += kVtThreads) {
    const int q = idx % (kVtKeys / 16), c4 = idx / (kVtKeys / 16);  // 16-key chunk q of the block
    const int key0 = (q / 2) * 32;                                  // its 32-key step
    std::uint32_t w[4][4];                                          // [column][4-key word of the chunk]
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      std::uint32_t in[4], t[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + fp8_vt_key((q % 2) * 16 + 4 * k + e);
        in[e] = *reinterpret_cast<const std::uint32_t*>(&tile[vt_staged(key, c4 / 4) + 4 * (c4 % 4)]);
      }
      transpose4x4(in, t);
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i][k] = t[i];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      *reinterpret_cast<uint4*>(out + std::int64_t(4 * c4 + i) * rows + 16 * q) =
          make_uint4(w[i][0], w[i][1], w[i][2], w[i][3]);
    }
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
