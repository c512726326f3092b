// The sm90a (Hopper) forward family: TMA, wgmma and warp-specialized kernels.
// The dispatch (src/cuda) asks fwd_unsupported() first and falls back to the sm80 family
// with a debug log naming the reason when it is not null.
#pragma once

#include <cstddef>

#include "core/params.hpp"

namespace flashattn::detail::cuda::sm90 {

// Whether the sm90a forward kernels were compiled into this build (90 in
// FLASHATTN_CUDA_ARCHS).
bool fwd_built() noexcept;

// nullptr when the sm90a forward runs this call on device p.device_index (a Hopper GPU);
// else a short reason, e.g. "dropout", "paged KV cache", "not built".
const char* fwd_unsupported(const FwdParams& p) noexcept;

// Launches the sm90a forward on p.stream. Precondition: fwd_unsupported(p) == nullptr.
// fp8 (e4m3) q, k, v: fp8_vt is fp8_vt_bytes(p) bytes of workspace (16-byte aligned) for
// the transposed copy of V (fp8_vt.cu), written first on the same stream.
void run_fwd(const FwdParams& p, void* fp8_vt = nullptr);

// The fp8 forward's V^T: keys padded to kFp8VtKeyAlign (the fp8 tiles' keys), per
// (sequence, KV head, value column); 0 bytes unless q is float8_e4m3.
inline constexpr int kFp8VtKeyAlign = 128;
int fp8_vt_keys(const FwdParams& p) noexcept;
std::size_t fp8_vt_bytes(const FwdParams& p) noexcept;
void transpose_v_fp8(const FwdParams& p, void* vt);

}  // namespace flashattn::detail::cuda::sm90
