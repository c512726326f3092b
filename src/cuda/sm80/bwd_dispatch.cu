// The sm80 backward: the workspace, the preprocess (D = rowsum(dO * O)), the learnable
// sink's gradient (when asked for), the main kernel of the compiled head-dim bucket, and
// the postprocess (dQ = scale * dq_accum in the output type).
#include <algorithm>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/backend.hpp"  // alloc_async, free_async
#include "cuda/arch/pack.cuh"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/sm80/bwd_config.cuh"
#include "cuda/sm80/bwd_launch.hpp"
#include "cuda/sm80/family.hpp"
#include "flashattn/error.hpp"
#include "flashattn_cuda_manifest.hpp"

namespace flashattn::detail::cuda::sm80 {

namespace {

constexpr int kRowThreads = 8;                         // threads per row, 8 elements each
constexpr int kRowsPerBlock = 256 / kRowThreads;       // 32 rows of one head per block

template <typename Element>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const std::uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (__is_same(Element, __half)) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      f[2 * k] = v.x;
      f[2 * k + 1] = v.y;
    } else {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k]));
      f[2 * k] = v.x;
      f[2 * k + 1] = v.y;
    }
  }
}

// D[h, row] = sum_c dO[row, h, c] * O[row, h, c] in fp32. Grid (row blocks, h_q, batch).
template <typename Element>
__global__ void __launch_bounds__(256) bwd_dot_do_o_kernel(const __grid_constant__ BwdParams p,
                                                           const BwdWorkspace ws) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int i = blockIdx.x * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int sub = threadIdx.x % kRowThreads;
  const bool active = i < p.seq_len_q(b);
  float sum = 0.0f;
  if (active) {
    const Element* dout = static_cast<const Element*>(p.dout) + p.do_offset(b) +
                          std::int64_t(i) * p.do_row_stride + std::int64_t(h) * p.do_head_stride;
    const Element* out = static_cast<const Element*>(p.out) + p.o_offset(b) +
                         std::int64_t(i) * p.o_row_stride + std::int64_t(h) * p.o_head_stride;
    for (int c = sub * 8; c < p.d_v; c += kRowThreads * 8) {
      float a[8], o[8];
      unpack8<Element>(*reinterpret_cast<const uint4*>(dout + c), a);
      unpack8<Element>(*reinterpret_cast<const uint4*>(out + c), o);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum = fmaf(a[k], o[k], sum);
    }
  }
#pragma unroll
  for (int off = kRowThreads / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (active && sub == 0) {
    const std::int64_t row0 = p.cu_seqlens_q ? p.q_start(b) : std::int64_t(b) * p.seqlen_q;
    ws.dpsum[h * ws.rows_total + row0 + i] = sum;
  }
}

// The learnable sink's gradient, d sink[h] = -sum over the rows i of every sequence of
// exp(sink[h] - lse_i) * D_i (semantics::sink_prob; D from the preprocess), one block per
// query head: a fixed assignment of rows to threads and a fixed reduction tree, so the
// result is the same bits on every run (no atomics). The main kernel needs nothing for the
// sink: lse includes it, so the P it recomputes are normalised with it, and D stays
// rowsum(dO * O) (the sink carries no value). Rows are the packed rows of varlen
// (q_start(b) + i) or b * seqlen_q + i.
constexpr int kSinkThreads = 256;
__global__ void __launch_bounds__(kSinkThreads) bwd_sink_grad_kernel(const __grid_constant__ BwdParams p,
                                                                     const float* dpsum_all,
                                                                     std::int64_t rows_total) {
  const int h = blockIdx.x;
  const float sink = p.sink[h];
  const float* dpsum = dpsum_all + std::int64_t(h) * rows_total;
  float acc = 0.0f;
  if (sink != -INFINITY) {
    // Sequence by sequence through the index guards (params.hpp), so that a captured call
    // with bad cu_seqlens reads only rows the preprocess wrote.
    for (int b = 0; b < p.batch; ++b) {
      const int s_q = p.seq_len_q(b);
      const std::int64_t row0 = p.cu_seqlens_q ? p.q_start(b) : std::int64_t(b) * p.seqlen_q;
      const float* lse_b = p.lse + p.lse_offset(b, h);
      for (int i = threadIdx.x; i < s_q; i += kSinkThreads) {
        acc -= semantics::sink_prob(sink, lse_b[i]) * dpsum[row0 + i];
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  __shared__ float warp_sums[kSinkThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kSinkThreads / 32; ++w) total += warp_sums[w];
    p.dsink[h] = total;
  }
}

// dq[b, i, h, :] = scale * dq_accum[(b, i / kBwdBlockM, h), (i % kBwdBlockM, :)] in the
// output type, every row of every sequence (rows no key tile reached hold the zeros of
// the memset; rows past seqused_q get 0). A thread converts one 8-column slab of a row: in the fragment order of
// dq_accum those are four float2 at a 16-byte stride.
template <typename Element>
__global__ void __launch_bounds__(256) bwd_convert_dq_kernel(const __grid_constant__ BwdParams p,
                                                             const BwdWorkspace ws) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int i = blockIdx.x * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int sub = threadIdx.x % kRowThreads;
  if (i >= p.seq_rows_q(b)) return;
  Element* dq = static_cast<Element*>(p.dq) + p.dq_offset(b) + std::int64_t(i) * p.dq_row_stride +
                std::int64_t(h) * p.dq_head_stride;
  if (i >= p.seq_len_q(b)) {  // seqused_q: a row not computed has dq 0
    for (int c = sub * 8; c < p.d; c += kRowThreads * 8) *reinterpret_cast<uint4*>(dq + c) = make_uint4(0, 0, 0, 0);
    return;
  }
  const float* tile = ws.dq_accum + dq_accum_tile(ws, b, i / kBwdBlockM, h, p.h_q, p.d);
  const int r = i % kBwdBlockM;
  for (int c = sub * 8; c < p.d; c += kRowThreads * 8) {
    const float* slab = tile + dq_accum_index(r, c);  // columns c, c + 1; c + 2k at + 4k
    std::uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 v = *reinterpret_cast<const float2*>(slab + 4 * k);
      w[k] = pack2<Element>(v.x * p.scale, v.y * p.scale);
    }
    *reinterpret_cast<uint4*>(dq + c) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <typename Element>
void run_bwd(const BwdParams& p, const BwdWorkspace& ws, cudaStream_t stream, BwdMainKernel main) {
  // With no query rows (seqlen_q == 0) only the main kernel runs: it writes dk = dv = 0.
  const dim3 row_grid((p.seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock, p.h_q, p.batch);
  if (row_grid.x > 0) {
    bwd_dot_do_o_kernel<Element><<<row_grid, 256, 0, stream>>>(p, ws);
    FLASHATTN_CUDA_CHECK(cudaGetLastError());
  }
  if (p.dsink != nullptr) launch_sink_grad(p, ws.dpsum, ws.rows_total, stream);  // also with no rows: 0
  bool launched = p.seqlen_k == 0;
  const int kd = std::max(p.d, p.d_v);  // d_v != d: the bucket of the larger head dim
  if (!launched && main != nullptr) {
    main(p, ws, stream);
    launched = true;
  }
  // 192 < d <= 224 runs in the d = 256 bucket where that bucket runs its tall tile (sm90):
  // measured on the H200 1.20-1.25x the d = 224 bucket's own kernel at d = 224, despite
  // the 14% more MMA work of the padding (docs/performance.md).
#define FLASHATTN_BWD_TALL_256(D)                                                        \
  if constexpr (D == 256) {                                                              \
    if (!launched && kd > 192 && kd <= 224 && bwd_main_runs_tall<Element, D>(p)) {       \
      run_bwd_main<Element, D>(p, ws, stream);                                           \
      launched = true;                                                                   \
    }                                                                                    \
  }
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_BWD_TALL_256)
#undef FLASHATTN_BWD_TALL_256
#define FLASHATTN_BWD_BUCKET(D)                    \
  if (!launched && kd <= D) {                      \
    run_bwd_main<Element, D>(p, ws, stream);       \
    launched = true;                               \
  }
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_BWD_BUCKET)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_BWD_BUCKET)
#undef FLASHATTN_BWD_BUCKET
  if (row_grid.x > 0) {
    bwd_convert_dq_kernel<Element><<<row_grid, 256, 0, stream>>>(p, ws);
    FLASHATTN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

std::size_t backward_workspace_size(const BwdParams& p) { return bwd_workspace_layout(p).total(); }

int bwd_smem_need(int head_dim) {
#define FLASHATTN_BWD_SMEM_NEED(D) \
  if (head_dim <= D) return kBwdSmemNeed<D>;
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_BWD_SMEM_NEED)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_BWD_SMEM_NEED)
#undef FLASHATTN_BWD_SMEM_NEED
  return 0;
}

void launch_sink_grad(const BwdParams& p, const float* dpsum, std::int64_t rows_total, void* stream) {
  bwd_sink_grad_kernel<<<p.h_q, kSinkThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, dpsum,
                                                                                    rows_total);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

void backward(const BwdParams& p, BwdMainKernel main) {
  if (p.batch == 0 || p.h_q == 0) return;
  // A bucket without a configuration within the call's shared memory (d > 160 on a 99 KiB
  // GPU): declined before anything is enqueued.
  const int kd = std::max(p.d, p.d_v);
  if (main == nullptr && p.seqlen_k > 0 && p.smem_limit < bwd_smem_need(kd)) {
    throw Unsupported("backward", "q",
                      "at least " + std::to_string(bwd_smem_need(kd)) +
                          " bytes of shared memory per block for the backward at head dim " + std::to_string(kd),
                      std::to_string(p.smem_limit) + " bytes (the device's limit or opts.smem_cap)");
  }
  // The 512 bucket has no block-sparse kernel (as the forward's): declined before the
  // workspace or anything else.
  if (kd > 256 && p.bs_lists[0].cnt != nullptr) {
    throw Unsupported("backward", "opts.block_sparse",
                      "no block-sparse mask at head dims above 256 (CUDA: the 512 bucket has no "
                      "block-sparse kernel)",
                      "a mask with d = " + std::to_string(p.d) + ", d_v = " + std::to_string(p.d_v));
  }
  const auto stream = static_cast<cudaStream_t>(p.stream);
  const BwdWorkspaceLayout layout = bwd_workspace_layout(p);

  void* scratch = p.workspace;
  bool owned = false;
  if (layout.total() > 0 && (scratch == nullptr || p.workspace_bytes < layout.total())) {
    scratch = alloc_async(layout.total(), p.stream);
    owned = true;
  }
  BwdWorkspace ws;
  ws.rows_total = layout.rows_total;
  ws.m_blocks = layout.m_blocks;
  auto* base = static_cast<unsigned char*>(scratch);
  ws.dq_accum = reinterpret_cast<float*>(base);
  ws.dpsum = reinterpret_cast<float*>(base + layout.dq_accum_bytes);
  ws.dq_sem = p.deterministic
                  ? reinterpret_cast<unsigned*>(base + layout.dq_accum_bytes + layout.dpsum_bytes)
                  : nullptr;
  if (layout.dq_accum_bytes > 0) {
    FLASHATTN_CUDA_CHECK(cudaMemsetAsync(ws.dq_accum, 0, layout.dq_accum_bytes, stream));
  }
  if (layout.sem_bytes > 0) {
    FLASHATTN_CUDA_CHECK(cudaMemsetAsync(ws.dq_sem, 0, layout.sem_bytes, stream));
  }
  // A block-sparse mask: its kinds table, built on the device from the lists (the sm90
  // family declines these calls, so `main` is null here).
  BwdParams q = p;
  if (layout.kinds_bytes > 0) {
    auto* table = base + layout.kinds_offset();
    build_block_kinds(q, table, q.is_varlen() ? IndexCall::kVarlenBackward : IndexCall::kBackward);
    q.block_kinds = table;
  }
  try {
    if (q.dtype == DType::kBFloat16) {
      run_bwd<__nv_bfloat16>(q, ws, stream, main);
    } else {
      run_bwd<__half>(q, ws, stream, main);
    }
  } catch (...) {
    // A launch that declines (block sizes that split the tile, shared memory) after the
    // workspace was taken: give it back (dq, dk, dv are not written yet).
    if (owned) free_async(scratch, p.stream);
    throw;
  }
  if (owned) free_async(scratch, p.stream);
}

}  // namespace flashattn::detail::cuda::sm80
