// The sm90 backward's host side: which calls it runs, the tensor maps of a call, and the
// configuration per head-dim bucket.
#include <algorithm>
#include <cstdint>

#include "cuda/runtime/device_attribute.hpp"
#include "cuda/sm90/bwd.hpp"
#include "cuda/sm90/bwd_configs.hpp"
#include "cuda/sm90/tensor_map.hpp"

namespace flashattn::detail::cuda::sm90 {

const char* bwd_unsupported(const BwdParams& p) noexcept {
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(p.device_index, 0) != 9) {
    return "not a compute capability 9.0 GPU";
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return "dtype";
  // Head dims above 256 (d or d_v): the sm90 tiles stop at 256; the sm80 family's 512
  // bucket runs them.
  if (std::max(p.d, p.d_v) > 256) return "head dim above 256: the sm80 family's 512 bucket";
  if (p.d % 8 != 0) return "head dim";
  if (p.d_v != p.d) return "d_v != d";
  const int smem = p.d <= 64 ? BwdHdim64::kSmemBytes : p.d <= 128 ? BwdHdim128::kSmemBytes : BwdHdim256::kSmemBytes;
  if (p.smem_limit > 0 && p.smem_limit < smem) return "shared memory limit below the sm90 tiles";
  if (p.dropout_p > 0.0f) return "dropout";
  if (p.bs_lists[0].cnt != nullptr) return "block-sparse mask";
  if (p.is_varlen() && (p.total_q <= 0 || p.total_k <= 0)) return "varlen without packed totals";
  if (p.is_varlen() != (p.cu_seqlens_k != nullptr)) return "mixed varlen layout";
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return "no queries or keys";
  // Above 128 the consumers add dQ with per-lane reductions in whatever order the key tiles
  // reach a query tile; the sm80 kernel orders its own behind ws.dq_sem.
  if (p.d > 128 && p.deterministic) return "deterministic at head dim above 128 (unordered dQ reductions)";
  return nullptr;
}

namespace {

template <class Cfg, typename Element>
void run(const BwdParams& p, BwdArgs& args, void* stream) {
  const std::int64_t q_rows = p.is_varlen() ? p.total_q : p.seqlen_q;
  const std::int64_t q_batches = p.is_varlen() ? 1 : p.batch;
  const std::int64_t k_rows = p.is_varlen() ? p.total_k : p.seqlen_k;
  const std::int64_t k_batches = p.is_varlen() ? 1 : p.batch;
  const std::uint64_t q_dims[4] = {std::uint64_t(p.d), std::uint64_t(q_rows), std::uint64_t(p.h_q),
                                   std::uint64_t(q_batches)};
  const std::uint64_t k_dims[4] = {std::uint64_t(p.d), std::uint64_t(k_rows), std::uint64_t(p.h_k),
                                   std::uint64_t(k_batches)};
  // A map over a [batch][heads][rows][d] tensor of 16-bit elements, from its element strides.
  auto map = [&](const void* base, const std::uint64_t (&dims)[4], std::int64_t row_stride,
                 std::int64_t head_stride, std::int64_t batch_stride, std::uint32_t box_rows) {
    return make_tensor_map_4d(base, p.dtype, dims,
                              {tma_stride(std::int64_t(dims[1]), row_stride), tma_stride(std::int64_t(dims[2]), head_stride),
                               tma_stride(std::int64_t(dims[3]), batch_stride)},
                              box_rows);
  };
  args.tmap_q = map(p.q, q_dims, p.q_row_stride, p.q_head_stride, p.q_batch_stride, Cfg::kBlockM);
  args.tmap_do = map(p.dout, q_dims, p.do_row_stride, p.do_head_stride, p.do_batch_stride, Cfg::kBlockM);
  args.tmap_k = map(p.k, k_dims, p.k_row_stride, p.k_head_stride, p.k_batch_stride, Cfg::kBlockN);
  args.tmap_v = map(p.v, k_dims, p.v_row_stride, p.v_head_stride, p.v_batch_stride, Cfg::kBlockN);
  // dk, dv: TMA stores where their bases and strides are 16-byte aligned (bwd_kernel's epilogue).
  args.dkv_tma = false;
  if constexpr (Cfg::kTmaStoreDkv) {
    if (tma_layout_ok(p.dk, k_rows, p.dk_row_stride, p.h_k, p.dk_head_stride, k_batches, p.dk_batch_stride) &&
        tma_layout_ok(p.dv, k_rows, p.dv_row_stride, p.h_k, p.dv_head_stride, k_batches, p.dv_batch_stride)) {
      args.tmap_dk = map(p.dk, k_dims, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride, 64);
      args.tmap_dv = map(p.dv, k_dims, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride, 64);
      args.dkv_tma = true;
    }
  }
  launch_bwd<Cfg, Element>(args, stream);
}

template <typename Element>
void run_bucket(const BwdParams& p, BwdArgs& args, void* stream) {
  if (p.d <= 64) return run<BwdHdim64, Element>(p, args, stream);
  if (p.d <= 128) return run<BwdHdim128, Element>(p, args, stream);
  return run<BwdHdim256, Element>(p, args, stream);
}

}  // namespace

void run_bwd_main(const BwdParams& p, const BwdWorkspace& ws, void* stream) {
  BwdArgs args{};
  args.p = p;
  args.ws = ws;
  args.scale_log2 = p.scale * 1.4426950408889634f;
  args.raw_scores = p.softcap <= 0.0f && p.alibi_slopes == nullptr;
  if (p.dtype == DType::kBFloat16) {
    run_bucket<__nv_bfloat16>(p, args, stream);
  } else {
    run_bucket<__half>(p, args, stream);
  }
}

}  // namespace flashattn::detail::cuda::sm90
