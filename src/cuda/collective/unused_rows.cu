#include "cuda/collective/unused_rows.hpp"

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/runtime/cuda_check.hpp"

namespace flashattn::detail::cuda {
namespace {

constexpr int kThreads = 256;

// Grid (h_q, batch): the block of (b, h) walks rows [seq_len_q(b), seq_rows_q(b)), a thread
// per 2-byte output element (fp16 / bf16 zero is the zero bit pattern) and per lse entry.
__global__ void __launch_bounds__(kThreads) unused_query_rows_kernel(const __grid_constant__ FwdParams p) {
  const int b = blockIdx.y, h = blockIdx.x;
  const int first = p.seq_len_q(b), rows = p.seq_rows_q(b) - first;
  if (rows <= 0) return;
  auto* out = static_cast<std::uint16_t*>(p.out) + p.o_offset(b) + std::int64_t(h) * p.o_head_stride;
  for (std::int64_t e = threadIdx.x; e < std::int64_t(rows) * p.d_v; e += kThreads) {
    const std::int64_t i = first + e / p.d_v;
    out[i * p.o_row_stride + e % p.d_v] = 0;
  }
  if (p.lse != nullptr) {
    float* lse = p.lse + p.lse_offset(b, h);
    for (int i = first + threadIdx.x; i < first + rows; i += kThreads) lse[i] = -INFINITY;
  }
}

}  // namespace

void write_unused_query_rows(const FwdParams& p) {
  if (p.seqused_q == nullptr || p.batch == 0 || p.h_q == 0) return;
  unused_query_rows_kernel<<<dim3(p.h_q, p.batch), kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda
