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
// Its loop is latency-bound (P and dS single-buffered behind a consumer barrier) where the
// sm80 kernel's is not: on an H100 it leads up to 2k (non-causal 512 / 1k / 2k +46 / +23 /
// +9 %, causal 512 / 2k +38 / +11 %), ties at 4k and trails at 16k (-10 % / -5 %), so calls
// with more queries or keys than this run the sm80 kernel.
inline constexpr int kBwdHdim256MaxLen = 2048;

template <class Cfg, typename Element>
void launch_bwd(const BwdArgs& args, void* stream);

}  // namespace flashattn::detail::cuda::sm90
