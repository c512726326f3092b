// The device index checks' error record: written from the device by the check kernels
// (index_checks.cu), read and raised on the host (index_errors.cu).
#pragma once

namespace flashattn::detail::cuda::index_record {

// The first bad index a device check found on a device, in mapped (zero-copy) host memory.
// A check block lets one of its threads report (a shared-memory claim); that thread takes
// the device's report lock (one word of device memory per device, allocated with the
// record, which every reporting kernel uses: collective/index_report.cuh), writes the fields of a record
// in state 0 and then publishes state 2, and releases the lock; a block that finds the lock
// taken drops its report (another one is being recorded). The host reads a record in state
// 2 and resets it to 0. No atomics on the mapped memory (they would not be atomic for the
// host).
struct IndexErrorRecord {
  int state;
  int call;      // IndexCall
  int argument;  // IndexArg
  int kind;      // ErrorKind
  int entry, entry2;  // the bad entry: [b] or [b][t] (block lists: table row, list position)
  int other, other2;  // append conflicts: the other entry (sequence, block-table column)
  long long value, lo, hi;  // the value and the expected range; append conflicts: the block
                            // or cache row, and the slots [lo, hi) the entry uses
  long long other_lo, other_hi;  // append conflicts: the slots [other_lo, other_hi) the other appends to
};

enum IndexArg : int {
  kCuQ, kCuK, kMaxQ, kMaxK, kSequsedK, kCacheSeqlens, kCacheBatchIdx, kBlockTable,
  kMaskBlockCnt, kMaskBlockIdx, kFullBlockCnt, kFullBlockIdx,  // block-sparse lists
  kSequsedQ
};

enum ErrorKind : int {
  kOutOfRange = 0,      // value outside [lo, hi]
  kListedTwice = 1,     // a block-sparse list names a key block again
  kAppendedTwice = 2,   // two append targets name one block or cache row
  kAppendOverRead = 3,  // an append target is a block another entry reads cached keys from
};

inline constexpr int kMaxDevices = 64;

// The record of a device; with `allocate`, allocated if missing (nullptr if that fails),
// with its report lock. Allocation happens only outside stream capture
// (prepare_index_checks): under a global-mode capture the allocation would invalidate the
// capture. A captured call on a device that never ran an eager call records nothing (its
// check still guards the append, and its kernels still clamp). device_pointer: the record's
// address on the device; device_lock: the report lock's.
IndexErrorRecord* record_of(int device, bool allocate, IndexErrorRecord** device_pointer = nullptr,
                            int** device_lock = nullptr);

// The public function whose call an IndexCall names.
const char* call_name(int call);

}  // namespace flashattn::detail::cuda::index_record
