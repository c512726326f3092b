// The MLA kernel (mla_kernel.cuh) for fp16 q / qv / caches.
#include "cuda/sm80/mla_run.cuh"

namespace flashattn::detail::cuda::sm80 {
template void run_mla<__half>(const FwdParams&, const MlaArgs&);
}  // namespace flashattn::detail::cuda::sm80
