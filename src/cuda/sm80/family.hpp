// The sm80 kernel family as the dispatch (src/cuda/dispatch.cu) sees it: forward (dense,
// varlen and the KV-cache decode path), backward and their workspace needs. Runs on every
// GPU from sm80 on. The caller has validated p, resolved p.smem_limit (every configuration
// it picks fits in it) and made p.device_index current.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/params.hpp"
#include "cuda/collective/bwd_workspace.hpp"

namespace flashattn::detail::cuda::sm80 {

void forward(const FwdParams& p);
std::size_t forward_workspace_size(const FwdParams& p);
// The backward: workspace, preprocess (D), the main kernel, postprocess (dQ). `main`, when
// given, replaces this family's main kernel (the sm90 backward runs inside this pipeline:
// the workspace and the pre- and postprocess are the same for both families).
using BwdMainKernel = void (*)(const BwdParams& p, const BwdWorkspace& ws, void* stream);
void backward(const BwdParams& p, BwdMainKernel main = nullptr);
std::size_t backward_workspace_size(const BwdParams& p);
// The shared memory per block the backward of head dim d needs at least (its bucket's
// smallest configuration; 0 past the compiled buckets).
int bwd_smem_need(int head_dim);

// The learnable sink's gradient for a backward that has D = rowsum(dO * O) in
// dpsum[h * rows_total + row] (row: the packed row cu_seqlens_q[b] + i when varlen, else
// b * seqlen_q + i): writes p.dsink[h] = -sum_rows exp(p.sink[h] - lse) * D, reading
// p.lse; one block per head, a fixed reduction (the same bits every run). Enqueued on
// `stream` (a cudaStream_t). sm80::backward calls it after its preprocess; another
// family's backward with its own D can call it too.
void launch_sink_grad(const BwdParams& p, const float* dpsum, std::int64_t rows_total, void* stream);

}  // namespace flashattn::detail::cuda::sm80
