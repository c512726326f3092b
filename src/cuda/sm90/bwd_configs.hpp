// The sm90 backward's configuration table: per head-dim bucket, the tile shapes
// (BwdConfig<head dim, query rows per pair, stages>; 128 keys per block, two consumer
// warpgroups).
#pragma once

#include "cuda/sm90/bwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

using BwdHdim64 = BwdConfig<64, 128, 2>;
using BwdHdim128 = BwdConfig<128, 64, 2>;
// Head dims 129-256: 64 x 64 tiles, the head dim split between the consumers (kSplitHd),
// two Q / dO stages (210 KB): the consumers add dQ from registers, so the 64 KB that
// staged it for the writer warp hold the second stage (FA3's route; with the staging, one
// stage was all that fit, and the next pair's loads waited for this pair's end).
using BwdHdim256 = BwdConfig<256, 64, 2>;
// It runs at every length: on the H200 (2026-12-07) 1.20-1.54x the one-stage kernel up to
// 2k and 1.47-1.61x the sm80 kernel from 4k to 16k, which ran those lengths before.

template <class Cfg, typename Element>
void launch_bwd(const BwdArgs& args, void* stream);

}  // namespace flashattn::detail::cuda::sm90
