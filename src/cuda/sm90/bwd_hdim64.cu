// The sm90 backward kernels of head-dim bucket 64 (sm_90a).
#include "cuda/sm90/bwd_configs.hpp"
#include "cuda/sm90/bwd_launch.cuh"

namespace flashattn::detail::cuda::sm90 {
template void launch_bwd<BwdHdim64, __nv_bfloat16>(const BwdArgs&, void*);
template void launch_bwd<BwdHdim64, __half>(const BwdArgs&, void*);
}  // namespace flashattn::detail::cuda::sm90
