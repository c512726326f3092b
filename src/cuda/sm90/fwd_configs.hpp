// The sm90 forward's configuration table: per head-dim bucket, the tile shapes
// (FwdConfig<head dim, keys per tile, consumer warpgroups, stages>).
#pragma once

#include "cuda/sm90/fwd_kernel.cuh"

namespace flashattn::detail::cuda::sm90 {

using FwdHdim64 = FwdConfig<64, 128, 2, 3>;
using FwdHdim64Tall = FwdConfig<64, 128, 3, 2>;
using FwdHdim128 = FwdConfig<128, 128, 2, 2>;
using FwdHdim128Wide = FwdConfig<128, 176, 2, 2>;
using FwdHdim256 = FwdConfig<256, 80, 2, 2>;
// fp8 (e4m3): V^T in 64-key blocks.
using FwdFp8Hdim64 = FwdConfig<64, 256, 2, 3, 1>;
using FwdFp8Hdim128 = FwdConfig<128, 192, 2, 3, 1>;
using FwdFp8Hdim256 = FwdConfig<256, 128, 2, 2, 1>;

template <class Cfg, typename Element, typename Out = Element>
void launch_fwd(FwdArgs& args);

}  // namespace flashattn::detail::cuda::sm90
