// The entry points of the CUDA backend (core/backend.hpp): the one place that chooses a
// kernel family for a call. Everything below it in src/cuda is a family (sm80/, sm90/)
// built from collective/ over arch/.
//
//   call       family on cc 9.0 (auto)            elsewhere, or forced sm80
//   forward    the sm80 decode kernel for the     sm80 (its decode kernel for KV-cache
//              KV-cache calls it suits, else      calls it suits, else the fused forward)
//              sm90 where sm90::fwd_unsupported
//              is null, else sm80 (logged)
//   fp8 q      forward / varlen: sm90's fp8       forward / varlen: Unsupported naming q;
//              forward; KV cache: the decode      KV cache: the decode kernel
//              kernel
//   qv (MLA)   sm90's MLA kernel where            sm80's MLA kernel
//              sm90::mla_unsupported is null,
//              else sm80's (logged)
//   backward   sm90's main kernel inside the      sm80
//              shared pipeline (workspace, D, dQ
//              conversion) where
//              sm90::bwd_unsupported is null,
//              else sm80 (logged)
//
// seqused_q (varlen) runs in every family: the kernels compute seq_len_q(b) rows, the
// forward's remaining stored rows are written after them (collective/unused_rows.hpp), the
// backward's dq conversion writes their dq as 0.
//
// A learnable sink (FwdParams::sink) runs in every family: it joins the row max and sum in
// the epilogues (sm80 forward and decode, sm90 forward) or the split merge; the sm80
// backward adds a small kernel for its gradient (BwdParams::dsink).
//
// v with its own head dim (d_v != d) runs in the bucket of the larger in every family. A
// KV-cache call with d_v != d never takes the decode kernel (it has one head dim;
// sm80::plan_decode declines it): the sm90 forward where it takes the call, else the sm80
// fused forward, so an fp8 cache or a draft-tree mask with d_v != d is Unsupported (the
// API says so naming v_cache before the append).
//
// Head dims above 256 (the 512 bucket: d or d_v in 264 .. 512) run in the sm80 family
// alone (the sm90 family declines them, logged): the fused forward and backward, and for
// KV-cache calls the decode kernel (d_v == d; every feature it has below) or, with
// d_v != d or more packed rows than it takes, the fused forward (112 KiB: on a 99 KiB GPU
// the decode kernel takes every row count, and d_v != d is Unsupported naming v_cache).
//
// qv (MLA, FlashAttention-3's qv): dense, varlen and KV-cache calls with one plan
// (sm80::plan_mla: d <= 64, d_v <= 512, split count, workspace) and two kernels: on the
// sm90 family the sm90 MLA kernel (sm90/mla_kernel.cuh: wgmma, TMA) where
// sm90::mla_unsupported is null; else (logged), in the sm80 family (forced, or any other
// GPU) the sm80 MLA kernel (sm80/mla_kernel.cuh). Both raise plan_mla's errors, so a call
// one kernel declines is never an error the other would not raise. The head-dim buckets
// do not apply to it.
//
// Within a family the configuration (tiles, stages) is chosen from p.smem_limit, the
// shared memory per block the device grants (capped by Options::smem_cap).
#include "cuda/dispatch.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_runtime.h>

#include "core/backend.hpp"
#include "cuda/collective/unused_rows.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_attribute.hpp"
#include "cuda/runtime/device_guard.hpp"
#include "cuda/runtime/index_record.hpp"
#include "cuda/sm80/decode_dispatch.hpp"
#include "cuda/sm80/family.hpp"
#include "cuda/sm90/bwd.hpp"
#include "cuda/sm90/fwd.hpp"
#include "cuda/sm90/mla.hpp"
#include "flashattn/error.hpp"

namespace flashattn::detail::cuda {

#if !FLASHATTN_WITH_SM90
// A build without 90 in FLASHATTN_CUDA_ARCHS has no sm90 family: its interface answers so.
namespace sm90 {
bool fwd_built() noexcept { return false; }
const char* fwd_unsupported(const FwdParams&) noexcept { return "not built"; }
void run_fwd(const FwdParams&, void*) {}
std::size_t fp8_vt_bytes(const FwdParams&) noexcept { return 0; }
const char* bwd_unsupported(const BwdParams&) noexcept { return "not built"; }
void run_bwd_main(const BwdParams&, const BwdWorkspace&, void*) {}
const char* mla_unsupported(const FwdParams&) noexcept { return "not built"; }
void run_mla(const FwdParams&) {}
}  // namespace sm90
#endif

namespace {

// FLASHATTN_LOG=debug: one line on stderr when a call leaves the family it resolved to.
// Read once.
bool debug_log() {
  static const bool on = [] {
    const char* v = std::getenv("FLASHATTN_LOG");
    return v != nullptr && std::strcmp(v, "debug") == 0;
  }();
  return on;
}

// Where a block-sparse call's kinds table starts in the forward's workspace.
std::size_t block_kinds_offset(const FwdParams& p) {
  return (sm80::forward_workspace_size(p) + 255) & ~std::size_t(255);
}

// Where the fp8 forward's V^T (sm90/fp8_vt.cu) starts in the forward's workspace.
std::size_t fp8_vt_offset(const FwdParams& p) {
  return (block_kinds_offset(p) + block_kinds_bytes(p) + 255) & ~std::size_t(255);
}

// Checks every family shares; a family's own limits are its own. Every call (dense,
// varlen and KV-cache forward, backward) takes the compiled buckets up to the 512 one:
// the fused forward and backward, and the decode kernel (whose warps split O's columns
// there), run it in the sm80 family.
void check_common(const char* fn, const FwdParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Unsupported(fn, "q", "dtype float16 or bfloat16 on CUDA", dtype_name(p.dtype));
  }
  if (p.qv != nullptr) return;  // the MLA kernel's own rules (sm80::plan_mla)
  const char* buckets = "within the compiled CUDA buckets";
  if (p.d % 8 != 0 || !supports_wide_head_dim(p.d)) {
    throw Unsupported(fn, "q", std::string("a head dim d % 8 == 0 ") + buckets, "d = " + std::to_string(p.d));
  }
  // d_v != d: the sm80 kernels run in the bucket of the larger head dim (sm80/family.hpp).
  if (p.d_v % 8 != 0 || !supports_wide_head_dim(p.d_v) || !supports_wide_head_dim(std::max(p.d, p.d_v))) {
    throw Unsupported(fn, "v", std::string("a head dim d_v % 8 == 0 ") + buckets, "d_v = " + std::to_string(p.d_v));
  }
}

}  // namespace

KernelChoice resolve_kernel_family(const char* fn, const FwdParams& p) {
  const int cc = device_compute_capability(p.device_index);
  const int smem_optin =
      device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(p.device_index, 48 * 1024);
  return choose_kernel_family(fn, cc, smem_optin, {p.kernel_family, p.smem_cap}, sm90::fwd_built());
}

void forward(const FwdParams& in) {
  constexpr const char* kFn = "forward";
  check_common(kFn, in);
  if (in.probs != nullptr) {
    throw Unsupported(kFn, "return_probs", "no debug probabilities on CUDA (CPU backend only)",
                      "a return_probs tensor");
  }
  FwdParams p = in;
  const KernelChoice choice = resolve_kernel_family(kFn, p);
  p.smem_limit = choice.smem_limit;
  DeviceGuard guard(p.device_index);
  // A block-sparse mask: its kinds table, built on the device from the lists, after the
  // workspace of the decode path (which a block-sparse call never takes).
  if (p.bs_lists[0].cnt != nullptr && block_kinds_bytes(p) > 0) {
    const std::size_t need = block_kinds_offset(p) + block_kinds_bytes(p);
    if (p.workspace == nullptr || p.workspace_bytes < need) {
      throw Unsupported(kFn, "workspace", "at least " + std::to_string(need) + " bytes (the block-sparse kinds table)",
                        std::to_string(p.workspace_bytes) + " bytes");
    }
    auto* table = static_cast<std::uint8_t*>(p.workspace) + block_kinds_offset(p);
    build_block_kinds(p, table, p.is_varlen() ? IndexCall::kVarlenForward : IndexCall::kForward);
  }
  // fp8 (e4m3) q, k, v: the sm90 family's 8-bit kernels, or an error naming why not. A
  // KV-cache call with fp8 q (over an fp8 cache) takes the decode kernel below, on every
  // family.
  if (p.q_dtype == DType::kFloat8E4M3 && p.cache_seqlens == nullptr) {
    const char* why = choice.family != KernelFamily::kSm90
                          ? "the sm80 family (the fp8 forward runs on the sm90 family: H100 / H200)"
                          : sm90::fwd_unsupported(p);
    if (why != nullptr) {
      throw Unsupported(kFn, "q", "float8_e4m3 q, k, v within the sm90 family's fp8 forward", why);
    }
    const std::size_t need = fp8_vt_offset(p) + sm90::fp8_vt_bytes(p);
    if (p.workspace == nullptr || p.workspace_bytes < need) {
      throw Unsupported(kFn, "workspace", "at least " + std::to_string(need) + " bytes (the fp8 forward's V^T)",
                        std::to_string(p.workspace_bytes) + " bytes");
    }
    sm90::run_fwd(p, static_cast<std::uint8_t*>(p.workspace) + fp8_vt_offset(p));
    write_unused_query_rows(p);
    return;
  }
  // MLA: the sm90 MLA kernel where it takes the call, else the sm80 family's.
  if (p.qv != nullptr) {
    if (choice.family == KernelFamily::kSm90) {
      const char* why = sm90::mla_unsupported(p);
      if (why == nullptr) {
        sm90::run_mla(p);
        write_unused_query_rows(p);
        return;
      }
      if (debug_log()) std::fprintf(stderr, "flashattn: forward: sm90 MLA kernel declined (%s), running sm80\n", why);
    }
    sm80::forward(p);
    write_unused_query_rows(p);
    return;
  }
  // Decoding (a few query rows against a long cache) is memory-bound: the decode kernel
  // (split-KV, fp8, draft trees) serves it on every family.
  if (choice.family == KernelFamily::kSm90 && !sm80::plan_decode(p).use) {
    const char* why = sm90::fwd_unsupported(p);
    if (why == nullptr) {
      sm90::run_fwd(p);
      write_unused_query_rows(p);
      return;
    }
    if (debug_log()) std::fprintf(stderr, "flashattn: forward: sm90 family declined (%s), running sm80\n", why);
  }
  sm80::forward(p);
  write_unused_query_rows(p);
}

// KV-cache calls on the decode path with splits > 1 need the fp32 partials (O, lse);
// computed from shapes and upper bounds only (the same during CUDA graph capture). The
// decode plan (route, configuration, split count) depends on the shared-memory limit:
// resolved here as forward resolves it, so that the size is that of the call's plan. A
// KV-cache append that the device index check may stop ends with the check's verdict
// (append_check_bytes; kvcache_forward finds it at the end of this size).
std::size_t forward_workspace_size(const FwdParams& in) {
  FwdParams p = in;
  if (p.cache_seqlens != nullptr) p.smem_limit = resolve_kernel_family("forward", p).smem_limit;
  if (p.q_dtype == DType::kFloat8E4M3 && p.cache_seqlens == nullptr) return fp8_vt_offset(p) + sm90::fp8_vt_bytes(p);
  const std::size_t bytes = block_kinds_offset(p) + block_kinds_bytes(p);
  const std::size_t verdict = append_check_bytes(p);
  return verdict > 0 ? ((bytes + 255) & ~std::size_t(255)) + verdict : bytes;
}

void backward(const BwdParams& in) {
  constexpr const char* kFn = "backward";
  check_common(kFn, in);
  if (in.batch == 0 || in.h_q == 0) {
    // No rows: d sink (when asked for) is 0; nothing else to write.
    if (in.dsink != nullptr && in.h_q > 0) {
      DeviceGuard guard(in.device_index);
      FLASHATTN_CUDA_CHECK(cudaMemsetAsync(in.dsink, 0, sizeof(float) * std::size_t(in.h_q),
                                           static_cast<cudaStream_t>(in.stream)));
    }
    return;
  }
  BwdParams p = in;
  const KernelChoice choice = resolve_kernel_family(kFn, p);
  p.smem_limit = choice.smem_limit;
  DeviceGuard guard(p.device_index);
  if (choice.family == KernelFamily::kSm90) {
    const char* why = sm90::bwd_unsupported(p);
    if (why == nullptr) {
      sm80::backward(p, &sm90::run_bwd_main);
      return;
    }
    if (debug_log()) std::fprintf(stderr, "flashattn: backward: sm90 family declined (%s), running sm80\n", why);
  }
  sm80::backward(p);
}

std::size_t backward_workspace_size(const BwdParams& p) { return sm80::backward_workspace_size(p); }

// The decode path is the one forward above takes for a KV-cache call (no qv) whose decode
// plan, under the same resolved shared-memory limit, uses the decode kernel.
namespace {
sm80::DecodePlan forward_decode_plan(const FwdParams& in) {
  FwdParams p = in;
  p.smem_limit = resolve_kernel_family("forward", p).smem_limit;
  return sm80::plan_decode(p);
}
}  // namespace

CounterSpan split_counters(const FwdParams& p) {
  if (p.cache_seqlens == nullptr || p.qv != nullptr || p.workspace == nullptr) return {};
  const sm80::DecodePlan plan = forward_decode_plan(p);
  if (!plan.use || plan.splits <= 1 || plan.cluster) return {};
  return {static_cast<char*>(p.workspace) + plan.counter_offset(), plan.counter_bytes};
}

// The decode kernel checks the call's rows itself (decode_kernel.cuh: FwdParams::
// row_check_call) where its plan leaves no arrival counter to zero and the call's only
// index tensors are cache_seqlens and cache_batch_idx (what check_rows checks for it).
bool fuse_row_checks(FwdParams& p, IndexCall call) {
  if (p.cache_seqlens == nullptr || p.qv != nullptr || p.block_table != nullptr || p.seqlen_k_new > 0 ||
      p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr || p.seqused_q != nullptr) {
    return false;
  }
  const sm80::DecodePlan plan = forward_decode_plan(p);
  if (!plan.use || (plan.splits > 1 && !plan.cluster)) return false;
  index_record::IndexErrorRecord* record = nullptr;  // none yet (a captured call): nothing recorded
  index_record::record_of(p.device_index, false, &record, &p.row_check_lock);
  p.row_check_record = record;
  p.row_check_call = static_cast<int>(call);
  return true;
}

}  // namespace flashattn::detail::cuda
