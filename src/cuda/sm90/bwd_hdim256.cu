// The sm90 backward kernels of head-dim bucket 256 (sm_90a; the head dim split between the
// consumers).
#include "cuda/sm90/bwd_configs.hpp"
#include "cuda/sm90/bwd_launch.cuh"

namespace flashattn::detail::cuda::sm90 {
template void launch_bwd<BwdHdim256, __nv_bfloat16>(const BwdArgs&, void*);
template void launch_bwd<BwdHdim256, __half>(const BwdArgs&, void*);
}  // namespace flashattn::detail::cuda::sm90
