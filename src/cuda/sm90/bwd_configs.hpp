// The sm90 backward's configuration table: per head-dim bucket, the tile shapes
// (BwdConfig<head dim, query rows per pair, stages>; 128 keys per block, two consumer
// warpgroups).
#pragma once

#include "cuda/sm90/bwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

using BwdHdim64 = BwdConfig<64, 128, 2>;
using BwdHdim128 = BwdConfig<128, 64, 2>;

template <class Cfg, typename Element>
void launch_bwd(const BwdArgs& args, void* stream);

}  // namespace flashattn::detail::cuda::sm90
