// Reporting a bad index from the device into the device's error record
// (runtime/index_record.hpp), shared by the check kernels (runtime/index_checks.cu) and the
// attention kernels that check their own index tensors (the decode kernel's row check,
// FwdParams::row_check_call). Device code only.
#pragma once

#include "cuda/runtime/index_record.hpp"

namespace flashattn::detail::cuda::index_record {

// Where a check reports: the device pointer of the device's record and of its report lock
// (null: nothing is recorded, e.g. a captured call on a device that never ran an eager one)
// and the call.
struct Reporter {
  IndexErrorRecord* record;
  int* lock;
  int call;
};

struct Finding {
  int argument, kind = kOutOfRange, entry, entry2 = -1, other = -1, other2 = -1;
  long long value, lo = 0, hi = 0, other_lo = 0, other_hi = 0;
};

// claim: a shared-memory word that lets one report through per block (null: no claim, the
// caller reports once). The device's lock (device memory, one word per device for every
// kernel that reports) keeps two reports from interleaving their fields.
__device__ inline void report(const Reporter& rep, int* claim, const Finding& f) {
  if (rep.record == nullptr || rep.lock == nullptr) return;
  if (claim != nullptr && atomicCAS(claim, 0, 1) != 0) return;  // one report per check block
  if (atomicCAS(rep.lock, 0, 1) != 0) return;  // another block is reporting
  volatile IndexErrorRecord* r = rep.record;
  if (r->state == 0) {  // else an earlier error is still pending
    r->call = rep.call;
    r->argument = f.argument;
    r->kind = f.kind;
    r->entry = f.entry;
    r->entry2 = f.entry2;
    r->other = f.other;
    r->other2 = f.other2;
    r->value = f.value;
    r->lo = f.lo;
    r->hi = f.hi;
    r->other_lo = f.other_lo;
    r->other_hi = f.other_hi;
    __threadfence_system();
    r->state = 2;
  }
  __threadfence();
  atomicExch(rep.lock, 0);
}

// The per-sequence KV-cache rules: cache_seqlens[b] in [0, len_hi] (capacity - s_new) and,
// when given, cache_batch_idx[b] in [0, cache_rows). For the check kernels (check_rows) and
// the decode kernel's own check (FwdParams::row_check_call) alike.
__device__ inline void check_cache_row(const Reporter& rep, int* claim, const int* cache_seqlens, long long len_hi,
                                       const int* cache_batch_idx, long long cache_rows, int b) {
  if (cache_seqlens != nullptr) {
    const long long len = cache_seqlens[b];
    if (len < 0 || len > len_hi) report(rep, claim, {.argument = kCacheSeqlens, .entry = b, .value = len, .hi = len_hi});
  }
  if (cache_batch_idx != nullptr) {
    const long long r = cache_batch_idx[b];
    if (r < 0 || r >= cache_rows) {
      report(rep, claim, {.argument = kCacheBatchIdx, .entry = b, .value = r, .hi = cache_rows - 1});
    }
  }
}

}  // namespace flashattn::detail::cuda::index_record
