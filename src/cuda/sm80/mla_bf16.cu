// The MLA kernel (mla_kernel.cuh) for bf16 q / qv / caches.
#include "cuda/sm80/mla_run.cuh"

namespace flashattn::detail::cuda::sm80 {
template void run_mla<__nv_bfloat16>(const FwdParams&, const MlaArgs&);
}  // namespace flashattn::detail::cuda::sm80
