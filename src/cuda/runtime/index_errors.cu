// The device index checks on the host: each device's error record (mapped host memory,
// index_record.hpp), which path eager calls take (set_index_check_path,
// FLASHATTN_DEVICE_INDEX_CHECKS), and raising what a check recorded as an InvalidArgument.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/backend.hpp"
#include "cuda/runtime/device_guard.hpp"
#include "cuda/runtime/index_record.hpp"

namespace flashattn::detail::cuda {

namespace index_record {

namespace {

IndexErrorRecord* g_records[kMaxDevices] = {};
IndexErrorRecord* g_device_records[kMaxDevices] = {};  // their device pointers
int* g_report_locks[kMaxDevices] = {};                   // device memory, zeroed
std::mutex g_records_mutex;

}  // namespace

IndexErrorRecord* record_of(int device, bool allocate, IndexErrorRecord** device_pointer, int** device_lock) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> lock(g_records_mutex);
  if (g_records[device] == nullptr && allocate) {
    void* lock_word = nullptr;
    const int zero = 0;
    if (cudaMalloc(&lock_word, sizeof(int)) != cudaSuccess ||
        cudaMemcpy(lock_word, &zero, sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess) {
      cudaGetLastError();
      if (lock_word != nullptr) cudaFree(lock_word);
      return nullptr;
    }
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(IndexErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      cudaGetLastError();
      cudaFree(lock_word);
      return nullptr;
    }
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(host);
      cudaFree(lock_word);
      return nullptr;
    }
    *static_cast<IndexErrorRecord*>(host) = IndexErrorRecord{};
    g_records[device] = static_cast<IndexErrorRecord*>(host);
    g_device_records[device] = static_cast<IndexErrorRecord*>(dev);
    g_report_locks[device] = static_cast<int*>(lock_word);
  }
  if (device_pointer != nullptr) *device_pointer = g_device_records[device];
  if (device_lock != nullptr) *device_lock = g_report_locks[device];
  return g_records[device];
}

const char* call_name(int call) {
  switch (call) {
    case 0: return "varlen_forward";
    case 1: return "varlen_backward";
    case 3: return "forward";
    case 4: return "backward";
    default: return "kvcache_forward";
  }
}

}  // namespace index_record

using namespace index_record;

namespace {

std::atomic<int> g_check_path{static_cast<int>(IndexCheckPath::kEnvironment)};

}  // namespace

void set_index_check_path(IndexCheckPath path) { g_check_path.store(static_cast<int>(path)); }

bool eager_index_checks_on_device() {
  const auto path = static_cast<IndexCheckPath>(g_check_path.load());
  if (path != IndexCheckPath::kEnvironment) return path == IndexCheckPath::kDevice;
  static const bool host = [] {
    const char* v = std::getenv("FLASHATTN_DEVICE_INDEX_CHECKS");
    return v != nullptr && std::string(v) == "0";
  }();
  return !host;
}

void prepare_index_checks(int device, void* stream) {
  if (record_of(device, false) != nullptr) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture) != cudaSuccess) {
    cudaGetLastError();  // the legacy stream under a global-mode capture elsewhere
    return;
  }
  if (capture != cudaStreamCaptureStatusNone) return;
  DeviceGuard guard(device);
  record_of(device, true);
}

namespace {

// "sequence 0 appends to block_table[0][3] = block 5, slots 4..4", as the host's
// check_append_targets words it.
std::string describe_slots(bool paged, bool append, long long seq, long long col, long long target, long long lo,
                           long long hi) {
  std::string where = paged ? "block_table[" + std::to_string(seq) + "][" + std::to_string(col) + "] = block " +
                                  std::to_string(target)
                            : "cache row " + std::to_string(target);
  return "sequence " + std::to_string(seq) + (append ? " appends to " : " reads ") + where + ", slots " +
         std::to_string(lo) + ".." + std::to_string(hi - 1);
}

}  // namespace

void raise_index_error(int device) {
  for (int d = device < 0 ? 0 : device; d < (device < 0 ? kMaxDevices : device + 1) && d < kMaxDevices; ++d) {
    IndexErrorRecord* r = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_records_mutex);
      r = g_records[d];
    }
    if (r == nullptr) continue;
    volatile IndexErrorRecord* v = r;
    if (v->state != 2) continue;
    const IndexErrorRecord e{2,       v->call,  v->argument, v->kind,  v->entry,    v->entry2, v->other,
                             v->other2, v->value, v->lo,      v->hi,    v->other_lo, v->other_hi};
    v->state = 0;
    static const char* const names[] = {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        "seqused_k",    "cache_seqlens", "cache_batch_idx", "block_table",
                                        "opts.block_sparse.mask_block_cnt", "opts.block_sparse.mask_block_idx",
                                        "opts.block_sparse.full_block_cnt", "opts.block_sparse.full_block_idx",
                                        "seqused_q"};
    const std::string name = names[e.argument];
    std::string where = " (found on cuda:";
    where += std::to_string(d);
    where += " by the device check of an earlier ";
    where += call_name(e.call);
    where += " call)";
    if (e.kind == kAppendedTwice || e.kind == kAppendOverRead) {
      // The other entry appends; this one appends too (kAppendedTwice) or reads.
      const bool paged = e.argument == kBlockTable;
      throw InvalidArgument(
          call_name(e.call), name,
          std::string("append targets that no other append and no cached key use (sequence i appends to "
                      "positions cache_seqlens[i] .. cache_seqlens[i] + s_new - 1; ") +
              (paged ? "blocks" : "cache rows") + " may be shared for reading only)",
          describe_slots(paged, true, e.other, e.other2, e.value, e.other_lo, e.other_hi) + ", and " +
              describe_slots(paged, e.kind == kAppendedTwice, e.entry, e.entry2, e.value, e.lo, e.hi) +
              "; the append wrote nothing" + where);
    }
    std::string at = name;
    at += '[';
    at += std::to_string(e.entry);
    at += ']';
    if (e.argument == kBlockTable) {
      at += '[';
      at += std::to_string(e.entry2);
      at += ']';
    }
    if (e.argument >= kMaskBlockCnt && e.argument <= kFullBlockIdx) {
      // Block lists: entry is the flat (b, h, m) row of the table (b * H + h) * M + m, entry2
      // the list position (-1 for a count).
      std::string at_row = name + " at (b, h, m) row " + std::to_string(e.entry);
      if (e.entry2 >= 0) at_row += ", position " + std::to_string(e.entry2);
      if (e.kind == kListedTwice) {
        throw InvalidArgument(call_name(e.call), name,
                              "each key block listed at most once per query block (in mask_block_idx "
                              "and full_block_idx together)",
                              "key block " + std::to_string(e.value) + " listed again" + " (" + at_row + ")" +
                                  where);
      }
      throw InvalidArgument(call_name(e.call), name,
                            "values in [" + std::to_string(e.lo) + ", " + std::to_string(e.hi) + "] (" +
                                at_row + ")",
                            std::to_string(e.value) + where);
    }
    if (e.argument == kMaxQ || e.argument == kMaxK) {
      throw InvalidArgument(call_name(e.call), name,
                            ">= " + std::to_string(e.lo) + " (the length of sequence " + std::to_string(e.entry) +
                                " in cu_seqlens_" + (e.argument == kMaxQ ? "q" : "k") + ")",
                            std::to_string(e.value) + where);
    }
    throw InvalidArgument(call_name(e.call), name,
                          at + " in [" + std::to_string(e.lo) + ", " + std::to_string(e.hi) + "]",
                          at + " = " + std::to_string(e.value) + where);
  }
}

}  // namespace flashattn::detail::cuda
