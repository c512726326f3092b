// The host side of the KV-cache decode path (decode_dispatch.cu).
#pragma once

#include <cstddef>

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm80 {

struct DecodePlan {
  bool use = false;  // the call takes the decode kernel
  bool small = false;  // its small configuration (decode_launch.hpp: fewer stages, 99 KiB)
  int splits = 1;
  // sm90 with 2..kMaxClusterSplits (16) splits: merged within a thread-block cluster through
  // shared memory (DecodeArgs::cluster), no workspace; above 8 only where the device holds
  // every cluster of the grid at once (decode_max_active_clusters).
  bool cluster = false;
  int row_chunks = 1;
  std::size_t o_bytes = 0;          // partial O, at workspace offset 0
  std::size_t lse_bytes = 0;        // partial lse, after it
  std::size_t counter_bytes = 0;    // the split merge's arrival counters, after it
  std::size_t workspace_bytes = 0;  // partial O + partial lse + arrival counters; 0 without splits or with the cluster merge
  std::size_t counter_offset() const { return o_bytes + lse_bytes; }
};

// A pure function of p's shapes and bounds, p.smem_limit and the device's cached
// cluster occupancy (never device memory): the
// workspace sizing (dispatch.cu: forward_workspace_size) resolves p.smem_limit as the call
// does, so both see the same plan. A KV-cache call that no decode configuration within
// p.smem_limit fits (16-bit K/V at d >= 160, up to 256, on a 99 KiB GPU) is left to the
// fused forward (use = false), or, with a draft-tree mask (or an fp8 cache), is Unsupported
// here, naming tree_mask (k_cache), the bytes needed and the limit. A call with d_v != d
// is left to the fused forward too (the decode kernel has one head dim), or, with an fp8
// cache or a draft-tree mask, is Unsupported here naming v_cache (as it is above head dim
// 256 where the fused forward's tile does not fit: a 99 KiB GPU). The decode kernel takes
// every row count above 256 where the fused forward does not fit.
DecodePlan plan_decode(const FwdParams& p);
void run_decode_path(const FwdParams& p, const DecodePlan& plan);

}  // namespace flashattn::detail::cuda::sm80
