// The CUDA backend's index checks on the device: the check kernels (cu_seqlens, seqused,
// cache lengths and rows, block tables, KV-cache append conflicts) and the block-sparse
// kinds table, which write what they find into the device's error record
// (index_record.hpp; index_errors.cu keeps the records and raises them). The host's
// validation copy (used where these are off) is in runtime.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/backend.hpp"
#include "cuda/arch/pdl.cuh"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_guard.hpp"
#include "cuda/runtime/index_record.hpp"
#include "cuda/collective/index_report.cuh"

namespace flashattn::detail::cuda {

// ------------------------------------------------------------------ device index checks

namespace {

using namespace index_record;  // the record the checks write (index_record.hpp)

// The check's grid: one block per kWalkChunk block-table columns of a sequence (or per
// kWalkChunk sequences), at most kMaxCheckBlocks (each block then walks more of the
// table). 32-bit index arithmetic (no 64-bit division subroutine in the kernel): a chunk
// covers 8 KiB of the table, so the chunk count fits; append targets are fewer than 2^32
// (check_indices_on_device).
constexpr int kCheckThreads = 256;
constexpr int kWalkChunk = 2048;
constexpr int kMaxCheckBlocks = 64;
// Append targets are checked for conflicts through an open-addressing hash table in shared
// memory (block or cache row -> the entry appending there), kHashWindow targets at a time.
constexpr int kHashBits = 11;
constexpr int kHashSlots = 1 << kHashBits;
constexpr int kHashWindow = kHashSlots / 2;

struct IndexCheckArgs {
  Reporter rep;
  int batch;
  const int* cu_q;
  const int* cu_k;
  const int* seqused_k;
  const int* seqused_q;
  long long total_q, total_k;
  int max_q, max_k;
  const int* cache_seqlens;
  int s_new;
  long long capacity;
  const int* cache_batch_idx;
  int cache_rows;
  const int* block_table;
  long long table_stride;
  int max_blocks, block_size;
  unsigned walk_chunks;  // chunks of kWalkChunk columns per sequence (0 without a table)
  // The append's targets, checked for conflicts when append_per_seq > 0: append_per_seq
  // per sequence (paged: block-table columns from cache_seqlens[b] / block_size on; dense
  // with cache_batch_idx: its cache row). Each block writes append_flags[blockIdx.x]: 1 if
  // it found a conflict (append_kv then writes nothing), else 0.
  int append_per_seq;
  int* append_flags;
  // The decode path's split-merge arrival counters, zeroed here (FwdParams::zeroed_counters);
  // null / 0: none.
  unsigned* zero_words;
  unsigned zero_count;
};

// Every check kernel starts here: it waits for the kernel before it (a no-op unless it was
// launched as a programmatic dependent), lets the call's next kernel launch (the decode
// kernel, launched as a programmatic dependent on sm90, then runs its prologue while this
// check runs and waits for the check's completion before its first global access), and
// zeroes the decode path's arrival counters.
__device__ void check_prologue(const IndexCheckArgs& a) {
  griddep_wait();
  griddep_launch_dependents();
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < a.zero_count; i += gridDim.x * blockDim.x) {
    a.zero_words[i] = 0u;
  }
}

// cu_seqlens[b] for b in [0, batch]: [0] == 0, non-decreasing, the last <= total, and no
// sequence longer than max_seqlen (the host's check_cu_seqlens).
__device__ void check_cu(const IndexCheckArgs& a, int* claim, const int* cu, long long total, int max_len,
                         int arg, int max_arg, int b) {
  const long long v = cu[b];
  if (b == 0) {
    if (v != 0) report(a.rep, claim, {.argument = arg, .entry = 0, .value = v});
    return;
  }
  const long long prev = cu[b - 1];
  if (v < prev || v > total) {
    report(a.rep, claim, {.argument = arg, .entry = b, .value = v, .lo = prev, .hi = total});
  } else if (v - prev > max_len) {
    report(a.rep, claim, {.argument = max_arg, .entry = b - 1, .value = max_len, .lo = v - prev, .hi = INT_MAX});
  }
}

// cache_seqlens[b] as the attention reads it: clamped to [0, capacity - s_new].
__device__ long long clamped_len(const IndexCheckArgs& a, int b) {
  const long long len = a.cache_seqlens[b];
  return len < 0 ? 0 : len > a.capacity - a.s_new ? a.capacity - a.s_new : len;
}

// The slots [lo, hi) that sequence b appends to through block-table column t (paged) or in
// its cache row (dense, t = -1), for an append target (its length is valid).
__device__ void target_slots(const IndexCheckArgs& a, int b, int t, long long& lo, long long& hi) {
  const long long len = a.cache_seqlens[b];
  if (t < 0) {
    lo = len;
    hi = len + a.s_new;
    return;
  }
  const long long p0 = static_cast<long long>(t) * a.block_size;
  lo = (len > p0 ? len : p0) - p0;
  hi = (len + a.s_new < p0 + a.block_size ? len + a.s_new : p0 + a.block_size) - p0;
}

// Append target i of batch * append_per_seq: sequence b's k-th block-table column from its
// first new key on (paged), or its cache row (dense); key is the block or cache row, [lo,
// hi) the slots written there. False when there is no such column or the append writes
// nothing there (append_kv_kernel skips a bad length or destination).
__device__ bool append_target(const IndexCheckArgs& a, unsigned i, int& key, int& b, int& t, long long& lo,
                              long long& hi) {
  b = static_cast<int>(i / static_cast<unsigned>(a.append_per_seq));
  const int len = a.cache_seqlens[b];
  if (len < 0 || len > a.capacity - a.s_new) return false;
  if (a.block_table == nullptr) {
    const long long row = a.cache_batch_idx[b];
    if (row < 0 || row >= a.cache_rows) return false;
    key = static_cast<int>(row);
    t = -1;
    target_slots(a, b, t, lo, hi);
    return true;
  }
  const long long col = len / a.block_size + (i - static_cast<unsigned>(b) * a.append_per_seq);
  if (col * a.block_size >= static_cast<long long>(len) + a.s_new) return false;
  const long long id = a.block_table[b * a.table_stride + col];
  if (id < 0 || id >= a.cache_rows) return false;
  key = static_cast<int>(id);
  t = static_cast<int>(col);
  target_slots(a, b, t, lo, hi);
  return true;
}

struct AppendHash {
  int key[kHashSlots];  // block or cache row; -1: empty
  int seq[kHashSlots], col[kHashSlots];
};

__device__ unsigned hash_slot(int key) { return (static_cast<unsigned>(key) * 2654435769u) >> (32 - kHashBits); }

// The slot holding key, or -1.
__device__ int hash_find(const AppendHash& h, int key) {
  for (unsigned s = hash_slot(key);; s = (s + 1) & (kHashSlots - 1)) {
    const int k = h.key[s];
    if (k == key) return static_cast<int>(s);
    if (k == -1) return -1;
  }
}

// The used block-table entries of this block's chunks (sequence b, columns [k * kWalkChunk,
// (k + 1) * kWalkChunk) for the items b * walk_chunks + k = blockIdx.x, + gridDim.x, ...):
// each in range (with check_range), and, with `hash`, none a block that another entry
// appends to at or before a slot this entry reads a cached key from.
__device__ void walk_table(const IndexCheckArgs& a, int* claim, bool check_range, const AppendHash* hash,
                           bool& conflict) {
  const unsigned items = a.walk_chunks * static_cast<unsigned>(a.batch);
  for (unsigned item = blockIdx.x; item < items; item += gridDim.x) {
    const int b = static_cast<int>(item / a.walk_chunks);
    const int t0 = static_cast<int>(item - static_cast<unsigned>(b) * a.walk_chunks) * kWalkChunk;
    const long long len = clamped_len(a, b);
    // Columns a key uses: ceil((len + s_new) / block_size), len + s_new <= capacity < 2^31.
    const int used = static_cast<int>((static_cast<unsigned>(len + a.s_new) + a.block_size - 1) /
                                      static_cast<unsigned>(a.block_size));
    const int t1 = used < t0 + kWalkChunk ? used : t0 + kWalkChunk;
    for (int t = t0 + static_cast<int>(threadIdx.x); t < t1; t += blockDim.x) {
      const long long p0 = static_cast<long long>(t) * a.block_size;
      const long long id = a.block_table[b * a.table_stride + t];
      if (id < 0 || id >= a.cache_rows) {
        if (check_range) {
          report(a.rep, claim, {.argument = kBlockTable, .entry = b, .entry2 = t, .value = id, .hi = a.cache_rows - 1});
        }
        continue;
      }
      if (hash == nullptr || p0 >= len) continue;  // no cached key read here
      const int s = hash_find(*hash, static_cast<int>(id));
      if (s < 0 || (hash->seq[s] == b && hash->col[s] == t)) continue;
      const int b2 = hash->seq[s], t2 = hash->col[s];
      long long lo2, hi2;
      target_slots(a, b2, t2, lo2, hi2);
      const long long read_end = len - p0 < a.block_size ? len - p0 : a.block_size;
      if (lo2 >= read_end) continue;  // appends after the slots read here
      conflict = true;
      report(a.rep, claim,
             {.argument = kBlockTable, .kind = kAppendOverRead, .entry = b, .entry2 = t, .other = b2, .other2 = t2,
              .value = id, .lo = 0, .hi = read_end, .other_lo = lo2, .other_hi = hi2});
    }
  }
}

// Per sequence: cu_seqlens, seqused, cache_seqlens, cache_batch_idx (spread over the grid).
__device__ void check_rows(const IndexCheckArgs& a, int* claim) {
  const int threads = static_cast<int>(gridDim.x * blockDim.x);
  for (int b = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); b <= a.batch; b += threads) {
    if (a.cu_q) check_cu(a, claim, a.cu_q, a.total_q, a.max_q, kCuQ, kMaxQ, b);
    if (a.cu_k) check_cu(a, claim, a.cu_k, a.total_k, a.max_k, kCuK, kMaxK, b);
    if (b == a.batch) continue;
    if (a.seqused_k) {
      const long long len = a.cu_k ? (long long)a.cu_k[b + 1] - a.cu_k[b] : 0;
      const long long u = a.seqused_k[b];
      if (u < 0 || u > len) report(a.rep, claim, {.argument = kSequsedK, .entry = b, .value = u, .hi = len});
    }
    if (a.seqused_q) {
      const long long len = a.cu_q ? (long long)a.cu_q[b + 1] - a.cu_q[b] : 0;
      const long long u = a.seqused_q[b];
      if (u < 0 || u > len) report(a.rep, claim, {.argument = kSequsedQ, .entry = b, .value = u, .hi = len});
    }
    check_cache_row(a.rep, claim, a.cache_seqlens, a.capacity - a.s_new, a.cache_batch_idx, a.cache_rows, b);
  }
}

// Calls without a block table or an append (dense KV-cache decode, varlen): the checks per
// sequence alone, in a kernel of their own.
__global__ void __launch_bounds__(kCheckThreads) index_check_rows_kernel(const __grid_constant__ IndexCheckArgs a) {
  check_prologue(a);
  __shared__ int claim;
  if (threadIdx.x == 0) claim = 0;
  __syncthreads();
  check_rows(a, &claim);
}

__global__ void __launch_bounds__(kCheckThreads, 1) index_check_kernel(const __grid_constant__ IndexCheckArgs a) {
  check_prologue(a);
  __shared__ int claim;
  // The append hash in dynamic shared memory, launched with it only when appends are
  // checked: a call without one (a decode step) runs with 4 bytes of shared memory.
  extern __shared__ __align__(16) unsigned char check_smem[];
  AppendHash& hash = *reinterpret_cast<AppendHash*>(check_smem);
  if (threadIdx.x == 0) claim = 0;
  __syncthreads();
  check_rows(a, &claim);
  bool conflict = false;
  const unsigned targets = static_cast<unsigned>(a.batch) * static_cast<unsigned>(a.append_per_seq);
  if (targets == 0 && a.block_table) walk_table(a, &claim, true, nullptr, conflict);
  // Append conflicts, kHashWindow targets at a time: block 0 finds two targets naming one
  // block or cache row (in the window, or one in it and one after it); every block finds
  // the entries of its share that read cached keys where a target of the window appends
  // (paged only: in a dense cache every sequence appends, so a shared row is a target twice).
  const bool hashes = blockIdx.x == 0 || a.block_table != nullptr;
  for (unsigned w0 = 0; hashes && w0 < targets; w0 += kHashWindow) {
    const unsigned w1 = targets - w0 > kHashWindow ? w0 + kHashWindow : targets;
    for (int s = threadIdx.x; s < kHashSlots; s += blockDim.x) hash.key[s] = -1;
    __syncthreads();
    for (unsigned i = w0 + threadIdx.x; i < w1; i += blockDim.x) {
      int key, b, t;
      long long lo, hi;
      if (!append_target(a, i, key, b, t, lo, hi)) continue;
      for (unsigned s = hash_slot(key);; s = (s + 1) & (kHashSlots - 1)) {
        const int prev = atomicCAS(&hash.key[s], -1, key);
        if (prev == -1) {
          hash.seq[s] = b;
          hash.col[s] = t;
        }
        if (prev == -1 || prev == key) break;  // a second target of key: found below
      }
    }
    __syncthreads();
    if (blockIdx.x == 0) {
      for (unsigned i = w0 + threadIdx.x; i < targets; i += blockDim.x) {
        int key, b, t;
        long long lo, hi;
        if (!append_target(a, i, key, b, t, lo, hi)) continue;
        const int s = hash_find(hash, key);
        if (s < 0 || (hash.seq[s] == b && hash.col[s] == t)) continue;
        conflict = true;
        long long lo2, hi2;
        target_slots(a, hash.seq[s], hash.col[s], lo2, hi2);
        report(a.rep, &claim,
               {.argument = a.block_table ? kBlockTable : kCacheBatchIdx, .kind = kAppendedTwice, .entry = b,
                .entry2 = t, .other = hash.seq[s], .other2 = hash.col[s], .value = key, .lo = lo, .hi = hi,
                .other_lo = lo2, .other_hi = hi2});
      }
    }
    if (a.block_table) walk_table(a, &claim, w0 == 0, &hash, conflict);
    __syncthreads();
  }
  if (a.append_flags != nullptr) {
    const int found = __syncthreads_or(conflict);
    if (threadIdx.x == 0) a.append_flags[blockIdx.x] = found;
  }
}

// One thread per (table batch, table head, query block) row: the row's N kinds from the
// two lists (partial, then full), each entry checked as the host checks it.
struct BlockKindsArgs {
  Reporter rep;  // record (null: no reports) and call
  FwdParams::BlockList lists[2];
  int heads, m_blocks, n_blocks;
  long long rows;
  unsigned char* table;
  int* list;      // [rows][n_blocks]: the row's listed blocks, highest first
  int* list_len;  // [rows]
};

__global__ void block_kinds_kernel(const __grid_constant__ BlockKindsArgs a) {
  __shared__ int claim;
  if (threadIdx.x == 0) claim = 0;
  __syncthreads();
  const long long r = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.rows) return;
  const int m = static_cast<int>(r % a.m_blocks);
  const int h = static_cast<int>((r / a.m_blocks) % a.heads);
  const int b = static_cast<int>(r / (static_cast<long long>(a.m_blocks) * a.heads));
  const int n_blocks = a.n_blocks;
  unsigned char* row = a.table + r * n_blocks;
  for (int n = 0; n < n_blocks; ++n) row[n] = semantics::kBlockSkip;
  for (int i = 0; i < 2; ++i) {
    const FwdParams::BlockList& l = a.lists[i];
    if (l.cnt == nullptr) continue;
    const int cnt_arg = i == 0 ? kMaskBlockCnt : kFullBlockCnt;
    int cnt = l.cnt[b * l.cnt_b + h * l.cnt_h + m];
    if (cnt < 0 || cnt > n_blocks) {
      report(a.rep, &claim, {.argument = cnt_arg, .entry = static_cast<int>(r), .value = cnt, .hi = n_blocks});
      cnt = cnt < 0 ? 0 : n_blocks;
    }
    const int* idx = l.idx + b * l.idx_b + h * l.idx_h + m * l.idx_m;
    for (int e = 0; e < cnt; ++e) {
      const int n = idx[e];
      if (n < 0 || n >= n_blocks) {
        report(a.rep, &claim,
               {.argument = cnt_arg + 1, .entry = static_cast<int>(r), .entry2 = e, .value = n, .hi = n_blocks - 1});
      } else if (row[n] != semantics::kBlockSkip) {
        // Listed twice: reported, the first listing kept.
        report(a.rep, &claim,
               {.argument = cnt_arg + 1, .kind = kListedTwice, .entry = static_cast<int>(r), .entry2 = e, .value = n});
      } else {
        row[n] = static_cast<unsigned char>(i == 0 ? semantics::kBlockPartial : semantics::kBlockFull);
      }
    }
  }
  int* list = a.list + r * n_blocks;
  int len = 0;
  for (int n = n_blocks - 1; n >= 0; --n)
    if (row[n] != semantics::kBlockSkip) list[len++] = n;
  a.list_len[r] = len;
}

}  // namespace

std::size_t append_check_bytes(const FwdParams& p) {
  const bool conflicts = p.seqlen_k_new > 0 && (p.block_table != nullptr || p.cache_batch_idx != nullptr);
  static_assert(kMaxCheckBlocks * sizeof(int) == kAppendVerdictBytes, "one verdict word per check block");
  return conflicts ? kAppendVerdictBytes : 0;
}

AppendVerdict check_indices_on_device(const FwdParams& p, IndexCall call, int* append_flags) {
  DeviceGuard guard(p.device_index);
  IndexCheckArgs a{};
  record_of(p.device_index, false, &a.rep.record, &a.rep.lock);  // none yet: the check records nothing
  a.rep.call = static_cast<int>(call);
  a.batch = p.batch;
  a.cu_q = p.cu_seqlens_q;
  a.cu_k = p.cu_seqlens_k;
  a.seqused_k = p.seqused_k;
  a.seqused_q = p.seqused_q;
  a.total_q = p.total_q;
  a.total_k = p.total_k;
  a.max_q = p.seqlen_q;  // varlen: max_seqlen_q / _k
  a.max_k = p.seqlen_k;
  a.cache_seqlens = p.cache_seqlens;
  a.s_new = p.seqlen_k_new;
  a.capacity = p.cache_capacity();
  a.cache_batch_idx = p.cache_batch_idx;
  a.cache_rows = p.kv_cache_rows;
  a.block_table = p.block_table;
  a.table_stride = p.block_table_batch_stride;
  a.max_blocks = p.block_table_max_blocks;
  a.block_size = p.block_size;
  a.zero_words = static_cast<unsigned*>(const_cast<void*>(p.zeroed_counters));
  a.zero_count = p.zeroed_counters != nullptr ? static_cast<unsigned>(p.zeroed_counter_bytes / sizeof(unsigned)) : 0u;
  if (append_flags != nullptr && append_check_bytes(p) > 0 && a.capacity >= a.s_new) {
    // Paged: the columns of the s_new new keys from cache_seqlens[b] on (one more when
    // they start inside a block), within the table.
    const long long per = p.block_table == nullptr
                              ? 1
                              : std::min<long long>((static_cast<long long>(a.s_new) + a.block_size - 1) /
                                                            a.block_size + 1,
                                                    a.max_blocks);
    if (per * a.batch < (1ll << 32)) {  // always: k_new holds batch * s_new rows
      a.append_per_seq = static_cast<int>(per);
      a.append_flags = append_flags;
    }
  }
  // One block per chunk of kWalkChunk columns of a sequence's table row, or per kWalkChunk
  // sequences; 1 .. kMaxCheckBlocks (shapes only: the same under capture).
  a.walk_chunks = a.block_table ? static_cast<unsigned>((a.max_blocks + kWalkChunk - 1) / kWalkChunk) : 0;
  const long long work = std::max<long long>(static_cast<long long>(a.walk_chunks) * a.batch,
                                             (static_cast<long long>(a.batch) + kWalkChunk) / kWalkChunk);
  const int blocks = static_cast<int>(std::clamp<long long>(work, 1, kMaxCheckBlocks));
  if (a.block_table == nullptr && a.append_per_seq == 0) {
    index_check_rows_kernel<<<blocks, kCheckThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(a);
  } else {
    const std::size_t smem = a.append_per_seq > 0 ? sizeof(AppendHash) : 0;
    index_check_kernel<<<blocks, kCheckThreads, smem, static_cast<cudaStream_t>(p.stream)>>>(a);
  }
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
  if (a.append_flags == nullptr) return {};
  return {a.append_flags, blocks};
}

namespace {
std::size_t round256(std::size_t bytes) { return (bytes + 255) & ~std::size_t(255); }
std::size_t block_kinds_rows(const FwdParams& p) {
  return std::size_t(p.bs_table_batch) * std::size_t(p.bs_table_heads) * std::size_t(p.bs_blocks_q);
}
}  // namespace

// The kinds (one byte per block), then each row's listed key blocks (int) and their count.
std::size_t block_kinds_bytes(const FwdParams& p) {
  const std::size_t entries = p.bs_table_bytes();
  if (entries == 0) return 0;
  return round256(entries) + round256(entries * sizeof(int)) + round256(block_kinds_rows(p) * sizeof(int));
}

void build_block_kinds(FwdParams& p, std::uint8_t* table, IndexCall call) {
  BlockKindsArgs a{};
  a.rep.call = static_cast<int>(call);
  record_of(p.device_index, false, &a.rep.record, &a.rep.lock);
  a.lists[0] = p.bs_lists[0];
  a.lists[1] = p.bs_lists[1];
  a.heads = p.bs_table_heads;
  a.m_blocks = p.bs_blocks_q;
  a.n_blocks = p.bs_blocks_k;
  a.rows = static_cast<long long>(p.bs_table_batch) * p.bs_table_heads * p.bs_blocks_q;
  a.table = table;
  const std::size_t entries = block_kinds_rows(p) * std::size_t(p.bs_blocks_k);
  a.list = reinterpret_cast<int*>(table + round256(entries));
  a.list_len = reinterpret_cast<int*>(table + round256(entries) + round256(entries * sizeof(int)));
  p.block_kinds = table;
  p.block_list = a.list;
  p.block_list_len = a.list_len;
  if (a.rows == 0 || a.n_blocks == 0) return;
  constexpr int kThreads = 128;
  const long long blocks = (a.rows + kThreads - 1) / kThreads;
  block_kinds_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(a);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda
