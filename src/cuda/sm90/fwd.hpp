// The sm90a (Hopper) forward family: TMA, wgmma and warp-specialized kernels.
// The dispatch (src/cuda) asks fwd_unsupported() first and falls back to the sm80 family
// with a debug log naming the reason when it is not null.
#pragma once

#include <cstddef>
#include <cstdint>

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

// The fp8 forward's V^T: [h_k][d_v][fp8_vt_rows(p)] bytes, sequence b's keys from row
// fp8_vt_row0(p, b) (16-byte aligned), followed by zeros up to a multiple of kFp8VtTile
// keys (the largest fp8 key tile), so a tile never reads the next sequence; sequences are
// stored keys + kFp8VtTile + 16 apart (a varlen batch costs its packed keys, not batch x
// max_seqlen_k). 0 bytes unless q is float8_e4m3.
inline constexpr int kFp8VtTile = 256;
FA_HD std::int64_t fp8_vt_row0(const FwdParams& p, int b) {
  const std::int64_t row = p.cu_seqlens_k != nullptr ? std::int64_t(p.k_start(b)) : std::int64_t(b) * p.seqlen_k;
  return (row + std::int64_t(kFp8VtTile + 16) * b + 15) / 16 * 16;
}
inline std::int64_t fp8_vt_rows(const FwdParams& p) {
  const std::int64_t keys = p.cu_seqlens_k != nullptr ? std::int64_t(p.total_k) : std::int64_t(p.batch) * p.seqlen_k;
  return (keys + std::int64_t(kFp8VtTile + 16) * p.batch + 15) / 16 * 16 + kFp8VtTile;
}
std::size_t fp8_vt_bytes(const FwdParams& p) noexcept;
void transpose_v_fp8(const FwdParams& p, void* vt);

}  // namespace flashattn::detail::cuda::sm90
