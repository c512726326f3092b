// The sm80 backward's main kernel as its dispatch sees it (the workspace it shares with
// the preprocess and postprocess: collective/bwd_workspace.hpp): the per-bucket launch,
// one explicit instantiation per (element type, head-dim bucket) generated from
// bwd.inst.cu.in through manifest.cmake.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "core/params.hpp"
#include "cuda/collective/bwd_workspace.hpp"

namespace flashattn::detail::cuda::sm80 {

// The main kernel for one bucket: grid (key tiles, h_k, batch); dK, dV written, dQ
// accumulated into ws.dq_accum. Defined in bwd_run.cuh, instantiated per bucket.
template <typename Element, int kHeadDim>
void run_bwd_main(const BwdParams& p, const BwdWorkspace& ws, cudaStream_t stream);
// Whether run_bwd_main<Element, kHeadDim> runs the bucket's 128-row sm90 tile (BwdTileConfig
// kTall) on the call's device.
template <typename Element, int kHeadDim>
bool bwd_main_runs_tall(const BwdParams& p);

}  // namespace flashattn::detail::cuda::sm80
