// The sm90 MLA kernel (mla_kernel.cuh) for float16 q / qv / caches (sm_90a).
#include "cuda/sm90/mla_launch.cuh"

namespace flashattn::detail::cuda::sm90 {
template void launch_mla<__half>(const FwdParams&, const MlaArgs&);
}  // namespace flashattn::detail::cuda::sm90
