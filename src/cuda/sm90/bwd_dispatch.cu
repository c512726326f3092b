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
  args.tmap_q = make_tensor_map_4d(p.q, p.dtype, q_dims,
                                   {tma_stride(q_rows, p.q_row_stride), tma_stride(p.h_q, p.q_head_stride),
                                    tma_stride(q_batches, p.q_batch_stride)},
                                   Cfg::kBlockM);
  args.tmap_do = make_tensor_map_4d(p.dout, p.dtype, q_dims,
                                    {tma_stride(q_rows, p.do_row_stride), tma_stride(p.h_q, p.do_head_stride),
                                     tma_stride(q_batches, p.do_batch_stride)},
                                    Cfg::kBlockM);
  args.tmap_k = make_tensor_map_4d(p.k, p.dtype, k_dims,
                                   {tma_stride(k_rows, p.k_row_stride), tma_stride(p.h_k, p.k_head_stride),
                                    tma_stride(k_batches, p.k_batch_stride)},
                                   Cfg::kBlockN);
  args.tmap_v = make_tensor_map_4d(p.v, p.dtype, k_dims,
                                   {tma_stride(k_rows, p.v_row_stride), tma_stride(p.h_k, p.v_head_stride),
                                    tma_stride(k_batches, p.v_batch_stride)},
                                   Cfg::kBlockN);
  // dk, dv: TMA stores where their bases and strides are 16-byte aligned (bwd_kernel's epilogue).
  args.dkv_tma = false;
  if constexpr (Cfg::kTmaStoreDkv) {
    if (aligned16(p.dk) && aligned16(p.dv) && tma_stride_ok(k_rows, p.dk_row_stride) &&
        tma_stride_ok(p.h_k, p.dk_head_stride) && tma_stride_ok(k_batches, p.dk_batch_stride) &&
        tma_stride_ok(k_rows, p.dv_row_stride) && tma_stride_ok(p.h_k, p.dv_head_stride) &&
        tma_stride_ok(k_batches, p.dv_batch_stride)) {
      args.tmap_dk = make_tensor_map_4d(p.dk, p.dtype, k_dims,
                                        {tma_stride(k_rows, p.dk_row_stride), tma_stride(p.h_k, p.dk_head_stride),
                                         tma_stride(k_batches, p.dk_batch_stride)},
                                        64);
      args.tmap_dv = make_tensor_map_4d(p.dv, p.dtype, k_dims,
                                        {tma_stride(k_rows, p.dv_row_stride), tma_stride(p.h_k, p.dv_head_stride),
                                         tma_stride(k_batches, p.dv_batch_stride)},
                                        64);
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
