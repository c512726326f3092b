// The sm90 fp8 (e4m3) forward kernels, head-dim buckets 64, 128 and 256 (sm_90a), 16-bit out.
#include "cuda/sm90/fwd_configs.hpp"
#include "cuda/sm90/fwd_launch.cuh"

namespace flashattn::detail::cuda::sm90 {
template void launch_fwd<FwdFp8Hdim64, __nv_fp8_e4m3, __nv_bfloat16>(FwdArgs&);
template void launch_fwd<FwdFp8Hdim64, __nv_fp8_e4m3, __half>(FwdArgs&);
template void launch_fwd<FwdFp8Hdim128, __nv_fp8_e4m3, __nv_bfloat16>(FwdArgs&);
template void launch_fwd<FwdFp8Hdim128, __nv_fp8_e4m3, __half>(FwdArgs&);
template void launch_fwd<FwdFp8Hdim256, __nv_fp8_e4m3, __nv_bfloat16>(FwdArgs&);
template void launch_fwd<FwdFp8Hdim256, __nv_fp8_e4m3, __half>(FwdArgs&);
}  // namespace flashattn::detail::cuda::sm90
