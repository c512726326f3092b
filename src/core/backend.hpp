// Internal: what each backend provides. Argument checking (src/api) has already
// validated everything; a backend may assume well-formed parameters.
#pragma once

#include <cstddef>

#include "core/params.hpp"

namespace flashattn::detail {

namespace cpu {
// Forward over dense, varlen or KV-cache parameters; honours num_splits (> 1 uses
// p.workspace, at least forward_workspace_size(p) bytes).
void forward(const FwdParams& p);
std::size_t forward_workspace_size(const FwdParams& p);
// Backward; uses p.workspace (at least backward_workspace_size(p) bytes) if it needs one.
void backward(const BwdParams& p);
std::size_t backward_workspace_size(const BwdParams& p);
// In-place KV-cache append.
void append_kv(const AppendParams& p);
}  // namespace cpu

namespace cuda {
// True when the CUDA backend was compiled in.
bool built() noexcept;
// Number of visible CUDA devices (0 without the backend or without a GPU).
int device_count() noexcept;
// Compute capability (major * 10 + minor) of a device; 0 if none.
int compute_capability(int device) noexcept;
// Whether head dim d (d % 8 == 0) lies within the compiled buckets up to 256, which every
// CUDA kernel of the sm80 family has (and the sm90 family's range).
bool supports_head_dim(int d) noexcept;
// The compiled sm80 bucket head dim d runs in (the smallest one >= d, 512 included), or 0
// when there is none: tests of one bucket's configurations skip builds whose head-dim list
// puts d in a larger bucket (FLASHATTN_HEAD_DIMS).
int head_dim_bucket(int d) noexcept;
// The same up to the largest compiled bucket, 512 included (sm80 alone: the forward and
// backward, dense and varlen, and KV-cache calls; supports_head_dim's limit without it):
// the head dims CUDA calls take (for clear errors).
bool supports_wide_head_dim(int d) noexcept;
// Whether the KV-cache decode kernel (sm80 family, every GPU) has a configuration for head
// dim d (a compiled bucket, 512 included) with a 16-bit or an fp8 cache within smem_limit
// bytes of shared memory per block (the device's opt-in limit or Options::smem_cap; <= 0:
// no limit), for every query-row count: within 99 KiB (sm86 / sm89) fp8 caches at every
// head dim, 16-bit ones up to d = 128 and in the 512 bucket (d 264 .. 512).
bool decode_fits(int d, bool fp8_cache, int smem_limit) noexcept;
// Whether a KV-cache call of head dim d (d_v == d) runs within smem_limit: on the decode
// kernel where it fits, else, without an fp8 cache or a draft-tree mask, on the fused
// forward. False: the call is Unsupported (naming tree_mask), e.g. a tree mask over a
// 16-bit cache at d >= 160 (up to 256) on a 99 KiB GPU; tests skip those cases by it.
bool kvcache_fits(int d, bool fp8_cache, bool tree_mask, int smem_limit) noexcept;
// Whether the KV-cache decode on `device` can hold `clusters` thread-block clusters of
// `splits` blocks of its kernel for head dim d (bf16 or fp16 out, an fp8 cache or not,
// packed_rows = s_q * h_q / h_k GQA-packed query rows, the configuration that smem_limit
// selects) at once: true for 2..8 splits on sm90 and newer (portable sizes), 9..16 by the
// device's cluster occupancy; false below sm90. The decode plan's condition for the
// cluster split merge above 8 splits, beside units * splits <= SMs (tests ask it).
bool decode_clusters_fit(int device, int d, bool bf16, bool fp8_cache, int packed_rows, int splits, int clusters,
                         int smem_limit) noexcept;
void forward(const FwdParams& p);
std::size_t forward_workspace_size(const FwdParams& p);
void backward(const BwdParams& p);
std::size_t backward_workspace_size(const BwdParams& p);
// The device index check's verdict on a KV-cache append (check_indices_on_device): `count`
// words at `flags`, one per check block, nonzero when that block found an append conflict;
// append_kv then writes nothing. Empty: no verdict (the host checked, or nothing to check).
struct AppendVerdict {
  const int* flags = nullptr;
  int count = 0;
};
void append_kv(const AppendParams& p, AppendVerdict verdict = {});
// Copies device memory to the host for argument validation (cu_seqlens, block tables,
// cache lengths), ordered on the stream and synchronising it. Returns false, copying
// nothing, when the stream is being captured into a CUDA graph: validation of index
// contents is then skipped and the kernels must stay in bounds on their own.
bool copy_to_host_for_validation(void* dst, const void* src, std::size_t bytes, void* stream);
// Device-side index checks, for the calls whose index tensors the host did not read: every
// eager call by default, and every call whose stream is captured (FLASHATTN_DEVICE_INDEX_CHECKS=0
// makes eager calls copy them to the host and synchronise instead). A small kernel, in
// stream order before the call's kernels, checks cu_seqlens_q / _k (and max_seqlen_q / _k),
// seqused_k, seqused_q, cache_seqlens, cache_batch_idx and the used block_table entries as
// the host would, and records the first bad value per device in mapped host memory; the
// kernels clamp the values meanwhile (params.hpp). With `append_flags` (a KV-cache call
// that appends, append_check_bytes(p) bytes of its workspace) it also finds the append
// conflicts the host's check_append_targets rejects (a block or cache row that two append
// targets name, or that one appends to where another entry reads cached keys), records
// them as errors of block_table / cache_batch_idx, and returns the verdict for append_kv.
enum class IndexCall : int { kVarlenForward = 0, kVarlenBackward = 1, kKVCacheForward = 2, kForward = 3, kBackward = 4 };
// Enqueues the check of p's index tensors on p.stream. Without the device's error record (a
// captured call on a device no eager call has run on) it runs but records nothing.
// With p.zeroed_counters (set from split_counters) the check kernel also zeroes those
// p.zeroed_counter_bytes, and lets the call's next kernel launch early (programmatic
// dependent launch: the decode kernel waits for the check's completion before its first
// global access).
AppendVerdict check_indices_on_device(const FwdParams& p, IndexCall call, int* append_flags = nullptr);
// The arrival counters of the decode path's split merge in p.workspace for this KV-cache
// call (the decode kernel with splits > 1), else {nullptr, 0}: a pure function of p's
// shapes, its workspace and the shared-memory limit the forward resolves (the same plan
// as the forward's). kvcache_forward hands them to the device index check to zero.
struct CounterSpan {
  void* data = nullptr;
  std::size_t bytes = 0;
};
CounterSpan split_counters(const FwdParams& p);
// Whether the decode kernel checks this KV-cache call's index tensors itself (a call that
// the decode kernel runs with no append, no block table and no split counters to zero:
// its only index tensors are cache_seqlens and cache_batch_idx); if so, sets p's row_check_*
// for `call` and the call enqueues no check kernel (one graph node fewer per decode step).
bool fuse_row_checks(FwdParams& p, IndexCall call);
// Bytes of the verdict at the end of a KV-cache call's forward workspace (included in
// forward_workspace_size): kAppendVerdictBytes for an append (s_new > 0) to a paged cache or
// through cache_batch_idx, else 0.
inline constexpr std::size_t kAppendVerdictBytes = 256;
std::size_t append_check_bytes(const FwdParams& p);
// Block-sparse masks on CUDA: the bytes of the kinds table (FwdParams::block_kinds) and
// its rows' lists (block_list, block_list_len) that build_block_kinds writes (0 without
// p.bs_lists), and the build: one small kernel on p.stream writes them from p.bs_lists at
// `table`, checking the lists as the host does (counts in [0, N], indices in [0, N), no
// block listed twice in a row) and recording the first bad entry as the index checks do
// (it is then skipped); p's block_kinds, block_list and block_list_len then point there.
std::size_t block_kinds_bytes(const FwdParams& p);
void build_block_kinds(FwdParams& p, std::uint8_t* table, IndexCall call);
// Raises, as InvalidArgument naming the tensor, entry, expected range and value, the bad
// index a device check recorded on `device` (-1: every device) and clears it. Does not
// synchronise: it sees the checks that have run by now.
void raise_index_error(int device);
// Allocates the device's error record if it is missing and `stream` is not being captured
// (every CUDA call does this first; a captured call cannot allocate).
void prepare_index_checks(int device, void* stream);
// Whether eager calls (outside graph capture) check their index tensors on the device, with
// no host copy and no synchronisation: yes unless FLASHATTN_DEVICE_INDEX_CHECKS=0 (read
// once), or as set_index_check_path says.
bool eager_index_checks_on_device();
// Test hook: kHost / kDevice override the environment for every later eager call of the
// process; kEnvironment restores it.
enum class IndexCheckPath : int { kEnvironment = 0, kHost = 1, kDevice = 2 };
void set_index_check_path(IndexCheckPath path);
// Stream-ordered scratch allocation for calls given no workspace.
void* alloc_async(std::size_t bytes, void* stream);
void free_async(void* ptr, void* stream);
}  // namespace cuda

}  // namespace flashattn::detail
