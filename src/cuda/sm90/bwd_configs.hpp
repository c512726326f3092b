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
// With one stage its loop was latency-bound where the sm80 kernel's is not: on an H100 it
// led up to 2k (non-causal 512 / 1k / 2k +46 / +23 / +9 %, causal 512 / 2k +38 / +11 %),
// tied at 4k and trailed at 16k (-10 % / -5 %), so calls with more queries or keys than
// this run the sm80 kernel (not yet measured with two stages).
inline constexpr int kBwdHdim256MaxLen = 2048;

template <class Cfg, typename Element>
void launch_bwd(const BwdArgs& args, void* stream);

}  // namespace flashattn::detail::cuda::sm90
