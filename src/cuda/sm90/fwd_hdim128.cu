// The sm90 forward kernels of head-dim bucket 128 (sm_90a).
#include "cuda/sm90/fwd_configs.hpp"
#include "cuda/sm90/fwd_launch.cuh"

namespace flashattn::detail::cuda::sm90 {
template void launch_fwd<FwdHdim128, __nv_bfloat16>(FwdArgs&);
template void launch_fwd<FwdHdim128, __half>(FwdArgs&);
template void launch_fwd<FwdHdim128Wide, __nv_bfloat16>(FwdArgs&);
template void launch_fwd<FwdHdim128Wide, __half>(FwdArgs&);
}  // namespace flashattn::detail::cuda::sm90
