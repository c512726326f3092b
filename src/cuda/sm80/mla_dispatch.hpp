// The host side of the MLA path (mla_dispatch.cu): which calls with FwdParams::qv the MLA
// kernel (mla_kernel.cuh) takes, its split count and workspace, and its launch.
#pragma once

#include <cstddef>

#include "core/params.hpp"
#include "cuda/sm80/mla_launch.hpp"

namespace flashattn::detail::cuda::sm80 {

struct MlaPlan {
  int splits = 1;
  int row_chunks = 1;
  std::size_t o_bytes = 0;          // partial O, at workspace offset 0
  std::size_t lse_bytes = 0;        // partial lse, after it
  std::size_t counter_bytes = 0;    // the split merge's arrival counters, after it
  std::size_t workspace_bytes = 0;  // 0 without splits
};

// A call with p.qv: a pure function of p's shapes and bounds and p.smem_limit (never
// device memory; the workspace sizing sees the same plan as the call). What the kernel does
// not cover is Unsupported naming the argument: q / k / v dtypes other than one 16-bit
// type (k_cache for an fp8 cache), d > 64 (q), d_v > 512 (v), a draft-tree mask, dropout,
// a block-sparse mask, a left-padded cache, and a shared-memory limit below the kernel's
// need (opts.qv: the 99 KiB GPUs, or opts.smem_cap). Splits (num_splits > 1, or 0: a
// heuristic from the SM count and the work) only for KV-cache calls.
MlaPlan plan_mla(const FwdParams& p);
void run_mla_path(const FwdParams& p, const MlaPlan& plan);
// The launch arguments of a plan (also the sm90 MLA kernel's, sm90/mla_dispatch.cu): the
// workspace checked against the plan's need (Unsupported naming it) and carved, its
// arrival counters zeroed in p.stream.
MlaArgs mla_args(const FwdParams& p, const MlaPlan& plan);

}  // namespace flashattn::detail::cuda::sm80
