// The sm90 backward's configuration table: per head-dim bucket, the tile shapes
// (BwdConfig<head dim, query rows per pair, stages>; 128 keys per block, two consumer
// warpgroups).
#pragma once

#include "cuda/sm90/bwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

using BwdHdim64 = BwdConfig<64, 128, 2>;
using BwdHdim128 = BwdConfig<128, 64, 2>;
// Head dims 129-256: 64 x 64 tiles, the head dim split between the consumers (kSplitHd),
// one Q / dO stage (FA4's shape there; two do not fit the shared memory).
using BwdHdim256 = BwdConfig<256, 64, 1>;

template <class Cfg, typename Element>
void launch_bwd(const BwdArgs& args, void* stream);

}  // namespace flashattn::detail::cuda::sm90
