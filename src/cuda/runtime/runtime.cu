// The CUDA backend's runtime services: device queries, supported head dims, the
// validation copy (skipped while a stream is captured), stream-ordered scratch memory
// and the in-place KV-cache append.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/backend.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_guard.hpp"
#include "flashattn_cuda_manifest.hpp"

namespace flashattn::detail::cuda {

bool built() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error (no driver / no device)
    return 0;
  }
  return n;
}

int compute_capability(int device) noexcept {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

namespace {
// The largest bucket of every sm80 kernel, and of the forward alone (its 512 bucket).
constexpr int largest_bucket() {
  int d = 0;
#define FLASHATTN_MAX_BUCKET_D(D) d = D > d ? D : d;
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_MAX_BUCKET_D)
#undef FLASHATTN_MAX_BUCKET_D
  return d;
}
constexpr int largest_forward_bucket() {
  int d = largest_bucket();
#define FLASHATTN_MAX_BUCKET_D(D) d = D > d ? D : d;
  FLASHATTN_CUDA_FOR_EACH_FWD_ONLY_HEAD_DIM(FLASHATTN_MAX_BUCKET_D)
#undef FLASHATTN_MAX_BUCKET_D
  return d;
}
}  // namespace

// Any d % 8 == 0 up to the largest compiled bucket runs in the next bucket up.
bool supports_head_dim(int d) noexcept { return d > 0 && d % 8 == 0 && d <= largest_bucket(); }
bool supports_forward_head_dim(int d) noexcept {
  return d > 0 && d % 8 == 0 && d <= largest_forward_bucket();
}

bool copy_to_host_for_validation(void* dst, const void* src, std::size_t bytes, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(s, &capture);
  if (err != cudaSuccess) {
    // The legacy stream under a global-mode capture elsewhere: no copy is allowed now.
    cudaGetLastError();
    return false;
  }
  if (capture != cudaStreamCaptureStatusNone) return false;
  if (bytes == 0) return true;
  FLASHATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  FLASHATTN_CUDA_CHECK(cudaStreamSynchronize(s));
  return true;
}

// ------------------------------------------------------------------ device index checks

namespace {

// The first bad index a device check found on a device, in mapped (zero-copy) host memory:
// a check kernel (one block) lets one of its threads report (a shared-memory claim), which
// writes the fields of a record in state 0 and then publishes state 2; the host reads a
// record in state 2 and resets it to 0. No atomics on the mapped memory (they would not be
// atomic for the host); two check kernels racing on two streams could mix their fields.
struct IndexErrorRecord {
  int state;
  int call;      // IndexCall
  int argument;  // IndexArg
  int entry, entry2;
  long long value, lo, hi;
};

enum IndexArg : int {
  kCuQ, kCuK, kMaxQ, kMaxK, kSequsedK, kCacheSeqlens, kCacheBatchIdx, kBlockTable,
  kMaskBlockCnt, kMaskBlockIdx, kFullBlockCnt, kFullBlockIdx,  // block-sparse lists
  kSequsedQ
};

constexpr int kMaxDevices = 64;
IndexErrorRecord* g_records[kMaxDevices] = {};
std::mutex g_records_mutex;

// The record of a device; with `allocate`, allocated if missing (nullptr if that fails).
// Allocation happens only outside stream capture (prepare_index_checks): under a global-mode
// capture the allocation would invalidate the capture. A captured call on a device that
// never ran an eager call goes unchecked (its kernels still clamp).
IndexErrorRecord* record_of(int device, bool allocate) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> lock(g_records_mutex);
  if (g_records[device] == nullptr && allocate) {
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(IndexErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    *static_cast<IndexErrorRecord*>(host) = IndexErrorRecord{};
    g_records[device] = static_cast<IndexErrorRecord*>(host);
  }
  return g_records[device];
}

struct IndexCheckArgs {
  IndexErrorRecord* record;  // device pointer of the mapped record
  int call, batch;
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
};

__device__ void report(const IndexCheckArgs& a, int* claim, int argument, int entry, int entry2,
                       long long value, long long lo, long long hi) {
  if (atomicCAS(claim, 0, 1) != 0) return;  // one report per check kernel
  volatile IndexErrorRecord* r = a.record;
  if (r->state != 0) return;  // an earlier error is still pending
  r->call = a.call;
  r->argument = argument;
  r->entry = entry;
  r->entry2 = entry2;
  r->value = value;
  r->lo = lo;
  r->hi = hi;
  __threadfence_system();
  r->state = 2;
}

// cu_seqlens[b] for b in [0, batch]: [0] == 0, non-decreasing, the last <= total, and no
// sequence longer than max_seqlen (the host's check_cu_seqlens).
__device__ void check_cu(const IndexCheckArgs& a, int* claim, const int* cu, long long total, int max_len,
                         int arg, int max_arg, int b) {
  const long long v = cu[b];
  if (b == 0) {
    if (v != 0) report(a, claim, arg, 0, -1, v, 0, 0);
    return;
  }
  const long long prev = cu[b - 1];
  if (v < prev || v > total) {
    report(a, claim, arg, b, -1, v, prev, total);
  } else if (v - prev > max_len) {
    report(a, claim, max_arg, b - 1, -1, max_len, v - prev, INT_MAX);
  }
}

__global__ void index_check_kernel(const __grid_constant__ IndexCheckArgs a) {
  __shared__ int claim;
  if (threadIdx.x == 0) claim = 0;
  __syncthreads();
  for (int b = threadIdx.x; b <= a.batch; b += blockDim.x) {
    if (a.cu_q) check_cu(a, &claim, a.cu_q, a.total_q, a.max_q, kCuQ, kMaxQ, b);
    if (a.cu_k) check_cu(a, &claim, a.cu_k, a.total_k, a.max_k, kCuK, kMaxK, b);
    if (b == a.batch) continue;
    if (a.seqused_k) {
      const long long len = a.cu_k ? (long long)a.cu_k[b + 1] - a.cu_k[b] : 0;
      const long long u = a.seqused_k[b];
      if (u < 0 || u > len) report(a, &claim, kSequsedK, b, -1, u, 0, len);
    }
    if (a.seqused_q) {
      const long long len = a.cu_q ? (long long)a.cu_q[b + 1] - a.cu_q[b] : 0;
      const long long u = a.seqused_q[b];
      if (u < 0 || u > len) report(a, &claim, kSequsedQ, b, -1, u, 0, len);
    }
    if (a.cache_seqlens) {
      const long long len = a.cache_seqlens[b];
      if (len < 0 || len > a.capacity - a.s_new) report(a, &claim, kCacheSeqlens, b, -1, len, 0, a.capacity - a.s_new);
    }
    if (a.cache_batch_idx) {
      const long long r = a.cache_batch_idx[b];
      if (r < 0 || r >= a.cache_rows) report(a, &claim, kCacheBatchIdx, b, -1, r, 0, a.cache_rows - 1);
    }
  }
  if (a.block_table) {
    const long long entries = (long long)a.batch * a.max_blocks;
    for (long long e = threadIdx.x; e < entries; e += blockDim.x) {
      const int b = static_cast<int>(e / a.max_blocks), t = static_cast<int>(e % a.max_blocks);
      long long keys = (long long)a.cache_seqlens[b];
      keys = (keys < 0 ? 0 : keys > a.capacity - a.s_new ? a.capacity - a.s_new : keys) + a.s_new;
      if ((long long)t * a.block_size >= keys) continue;  // an entry no key uses
      const long long id = a.block_table[b * a.table_stride + t];
      if (id < 0 || id >= a.cache_rows) report(a, &claim, kBlockTable, b, t, id, 0, a.cache_rows - 1);
    }
  }
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

// One thread per (table batch, table head, query block) row: the row's N kinds from the
// two lists (partial, then full), each entry checked as the host checks it.
struct BlockKindsArgs {
  IndexCheckArgs chk;  // record (null: no reports) and call
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
      if (a.chk.record) report(a.chk, &claim, cnt_arg, static_cast<int>(r), -1, cnt, 0, n_blocks);
      cnt = cnt < 0 ? 0 : n_blocks;
    }
    const int* idx = l.idx + b * l.idx_b + h * l.idx_h + m * l.idx_m;
    for (int e = 0; e < cnt; ++e) {
      const int n = idx[e];
      if (n < 0 || n >= n_blocks) {
        if (a.chk.record) report(a.chk, &claim, cnt_arg + 1, static_cast<int>(r), e, n, 0, n_blocks - 1);
      } else if (row[n] != semantics::kBlockSkip) {
        // Listed twice: reported with an empty range (lo > hi), the first listing kept.
        if (a.chk.record) report(a.chk, &claim, cnt_arg + 1, static_cast<int>(r), e, n, 1, 0);
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

bool device_index_checks_only() {
  static const bool only = [] {
    const char* v = std::getenv("FLASHATTN_DEVICE_INDEX_CHECKS");
    return v != nullptr && std::string(v) == "1";
  }();
  return only;
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

bool check_indices_on_device(const FwdParams& p, IndexCall call) {
  DeviceGuard guard(p.device_index);
  IndexErrorRecord* host = record_of(p.device_index, false);
  if (host == nullptr) return false;
  IndexCheckArgs a{};
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  a.record = static_cast<IndexErrorRecord*>(dev);
  a.call = static_cast<int>(call);
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
  index_check_kernel<<<1, 256, 0, static_cast<cudaStream_t>(p.stream)>>>(a);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
  return true;
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
  a.chk.call = static_cast<int>(call);
  if (IndexErrorRecord* host = record_of(p.device_index, false)) {
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess) {
      a.chk.record = static_cast<IndexErrorRecord*>(dev);
    } else {
      cudaGetLastError();
    }
  }
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
    const IndexErrorRecord e{2, v->call, v->argument, v->entry, v->entry2, v->value, v->lo, v->hi};
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
      // the list position (-1 for a count); lo > hi marks a block listed twice.
      std::string at_row = name + " at (b, h, m) row " + std::to_string(e.entry);
      if (e.entry2 >= 0) at_row += ", position " + std::to_string(e.entry2);
      if (e.lo > e.hi) {
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

void* alloc_async(std::size_t bytes, void* stream) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  FLASHATTN_CUDA_CHECK(cudaMallocAsync(&ptr, bytes, static_cast<cudaStream_t>(stream)));
  return ptr;
}

void free_async(void* ptr, void* stream) {
  if (ptr != nullptr) cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));
}

namespace {

// One thread per 16-byte chunk of a new (sequence, row, KV head) row of k_new and v_new;
// the destination row is cache position cache_seqlens[b] + r through the cache layout
// (dense with cache_batch_idx, or paged through the block table). kSplitWidths: v has its
// own head dim (d_v != d): the chunks span the wider of the two rows, K's copied where
// col < d, V's where col < d_v (the instantiation without it, d_v == d, is the kernel as
// it was before d_v != d: the same SASS).
template <bool kSplitWidths>
__global__ void append_kv_kernel(const __grid_constant__ AppendParams p) {
  const int b = blockIdx.y;
  const int chunks_per_row = (kSplitWidths ? max(p.d, p.d_v) : p.d) / 8;
  const std::int64_t idx = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t total = std::int64_t(p.seqlen_new) * p.h_k * chunks_per_row;
  if (idx >= total) return;
  const int chunk = static_cast<int>(idx % chunks_per_row);
  const int head = static_cast<int>((idx / chunks_per_row) % p.h_k);
  const int r = static_cast<int>(idx / (std::int64_t(chunks_per_row) * p.h_k));
  // Index guards (params.hpp; the host checks them except under graph capture): a
  // destination outside the cache (cache_seqlens[b] < 0 or past capacity - s_new, a
  // cache_batch_idx or block id out of range) is not written; the attention then reads
  // the clamped positions (docs/semantics.md).
  const std::int64_t len = p.cache.cache_seqlens[b];
  if (len < 0 || len > p.cache.cache_capacity() - p.seqlen_new) return;
  const std::int64_t j = len + r;
  if (p.cache.cache_batch_idx != nullptr) {
    const int row = p.cache.cache_batch_idx[b];
    if (row < 0 || row >= p.cache.kv_cache_rows) return;
  }
  if (p.cache.block_table != nullptr) {
    const int blk = p.cache.block_table[std::int64_t(b) * p.cache.block_table_batch_stride + j / p.cache.block_size];
    if (blk < 0 || blk >= p.cache.kv_cache_rows) return;
  }
  const int col = chunk * 8;
  const bool k_col = !kSplitWidths || col < p.d, v_col = !kSplitWidths || col < p.d_v;
  const auto* kn = static_cast<const std::uint16_t*>(p.k_new) + std::int64_t(b) * p.kn_batch_stride +
                   std::int64_t(r) * p.kn_row_stride + std::int64_t(head) * p.kn_head_stride + col;
  const auto* vn = static_cast<const std::uint16_t*>(p.v_new) + std::int64_t(b) * p.vn_batch_stride +
                   std::int64_t(r) * p.vn_row_stride + std::int64_t(head) * p.vn_head_stride + col;
  if (p.cache.kv_dtype == DType::kFloat8E4M3) {
    // e4m3(x / scale), round to nearest even, saturating at +-448 (KVCacheArgs).
    const std::int64_t at = p.cache.kv_block(b, j) * p.cache.scale_block_stride + head;
    const float ks = p.cache.k_scale[at], vs = p.cache.v_scale[at];
    const bool bf16 = p.dtype == DType::kBFloat16;
    auto quantize = [bf16](const std::uint16_t* src, float scale) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      std::uint32_t outw[2] = {0u, 0u};
      for (int e = 0; e < 8; ++e) {
        const std::uint16_t bits = static_cast<std::uint16_t>(w[e / 2] >> (16 * (e % 2)));
        float x;
        if (bf16) {
          x = __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
        } else {
          __half_raw hr;
          hr.x = bits;
          x = __half2float(__half(hr));
        }
        const std::uint32_t q = __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3);
        outw[e / 4] |= (q & 0xffu) << (8 * (e % 4));
      }
      return make_uint2(outw[0], outw[1]);
    };
    auto* kc = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p.cache.k)) +
               p.cache.k_offset(b, j, head) + col;
    auto* vc = const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p.cache.v)) +
               p.cache.v_offset(b, j, head) + col;
    if (k_col) *reinterpret_cast<uint2*>(kc) = quantize(kn, ks);
    if (v_col) *reinterpret_cast<uint2*>(vc) = quantize(vn, vs);
    return;
  }
  auto* kc = const_cast<std::uint16_t*>(static_cast<const std::uint16_t*>(p.cache.k)) +
             p.cache.k_offset(b, j, head) + col;
  auto* vc = const_cast<std::uint16_t*>(static_cast<const std::uint16_t*>(p.cache.v)) +
             p.cache.v_offset(b, j, head) + col;
  if (k_col) *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
  if (v_col) *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
}

}  // namespace

void append_kv(const AppendParams& p) {
  if (p.batch == 0 || p.seqlen_new == 0 || p.h_k == 0) return;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Unsupported("flashattn::kvcache_forward", "k_new", "dtype float16 or bfloat16 on CUDA",
                      dtype_name(p.dtype));
  }
  if (p.d % 8 != 0) {
    throw Unsupported("flashattn::kvcache_forward", "k_new", "head dim d % 8 == 0 on CUDA",
                      std::to_string(p.d));
  }
  if (p.d_v % 8 != 0 || p.d_v <= 0) {
    throw Unsupported("flashattn::kvcache_forward", "v_new", "head dim d_v % 8 == 0 on CUDA",
                      std::to_string(p.d_v));
  }
  DeviceGuard guard(p.device_index);
  constexpr int kThreads = 256;
  const bool split = p.d_v != p.d;
  const std::int64_t total = std::int64_t(p.seqlen_new) * p.h_k * (std::max(p.d, p.d_v) / 8);
  const dim3 grid(static_cast<unsigned>((total + kThreads - 1) / kThreads),
                  static_cast<unsigned>(p.batch));
  const auto kernel = split ? append_kv_kernel<true> : append_kv_kernel<false>;
  kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  FLASHATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashattn::detail::cuda
