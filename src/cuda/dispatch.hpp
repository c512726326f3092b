// The CUDA backend's dispatch (dispatch.cu): the kernel family and shared-memory limit of a
// call on its device, from the compute capability, the device's opt-in shared memory per
// block (cached per device) and what the caller asked for (p.kernel_family, p.smem_cap).
#pragma once

#include "core/kernel_family.hpp"
#include "core/params.hpp"

namespace flashattn::detail::cuda {

// choose_kernel_family (core/kernel_family.hpp) for p's device. `fn` names the entry point
// in errors ("forward", "backward").
KernelChoice resolve_kernel_family(const char* fn, const FwdParams& p);

}  // namespace flashattn::detail::cuda
