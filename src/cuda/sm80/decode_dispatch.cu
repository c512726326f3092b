// The KV-cache decode path on the host: which calls take it (those with d_v == d: the
// kernel has one head dim; d_v != d takes the fused forward), its configuration (the
// default, or the small one where p.smem_limit does not hold the default: 99 KiB GPUs;
// head-dim buckets up to 256 and the 512 bucket, whose warps split O's columns),
// the split count (num_splits = 0: a heuristic from the SM count and the work), the exact
// workspace need (from upper bounds and p.smem_limit only, never device memory: the same
// during CUDA graph capture), and the launch of the decode kernel (with splits, its last
// block per row chunk merges them).
#include <cuda.h>  // CUtensorMap and its enums (the encoder comes through the runtime)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <numeric>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "core/backend.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/runtime/device_attribute.hpp"
#include "cuda/sm80/decode_dispatch.hpp"
#include "cuda/sm80/decode_launch.hpp"
#include "cuda/sm80/tile_size.hpp"
#include "flashattn/error.hpp"
#include "flashattn_cuda_manifest.hpp"

namespace flashattn::detail::cuda::sm80 {

namespace {

constexpr int kMaxSplits = 256;
constexpr std::size_t kAlign = 256;
constexpr int kMinTilesPerSplit = 4;
// The cluster merge's split bounds (plan_decode; issue 23's sweep on the H100, C++ decode
// bench, dense bf16, 32 / 8 heads, d 128): batch 1 (64 blocks at 8 splits) 1k 12.6 us at 4
// cluster splits of 4 tiles, 11.0 at 8 of 2; 4k 17.7 at 8 of 8 against 19.2 at 16
// workspace splits of 4; 8k 26.8 at 8 of 16 against 26.7 at 32 of 4; 16k 44.8 at 8 of 32
// against 37.6 at 32 of 8. Batch 8 (128 blocks at 2 splits): 2k 32.1 us at 2 cluster
// splits of 16 against 34.8 at 8 workspace splits, 4k 54.1 (2 of 32) against 55.3, 8k
// 97.8 (2 of 64) against 97.8; 16k 185.7 against 180.7.
constexpr int kMinTilesPerClusterSplit = 2;
constexpr int kMaxTilesPerClusterSplit = 8;       // grids of at most half the SMs
constexpr int kMaxTilesPerClusterSplitFull = 32;  // larger ones
// Clusters above the portable 8 splits (Hopper's non-portable sizes, up to
// kMaxClusterSplits = 16; issue 23): a grid that fills more than half the SMs at one block
// per SM takes up to 16 cluster splits of kMinTilesPerWideClusterSplit ..
// kMaxTilesPerWideClusterSplit tiles where the device holds all its clusters at once.
// Measured on the H100 (C++ decode bench, batch 1, dense bf16, 32 / 8 heads, d 128, two
// rounds, one call; scripts/decode_cl16_gpu.sh), µs per step, 16 cluster splits against
// the former plan: 4k 17.1 against 18.2-18.4 (8 cluster splits of 8 tiles), 8k 23.3-23.4
// against 25.9-26.2 (32 workspace splits), 16k 34.9-35.0 against 36.8-37.9; 2k 14.1-14.2
// against 13.9 (8 cluster splits of 4 tiles: kept), 32k 57.7-58.1 against 57.5-57.6 (32
// tiles a split: the workspace plan kept).
constexpr int kMinTilesPerWideClusterSplit = 4;
constexpr int kMaxTilesPerWideClusterSplit = 16;
// The split heuristic (num_splits = 0) fills the block slots (SMs x blocks per SM) with
// (sequence, KV head, row chunk, split) blocks in one wave, with at most kMaxWaveSplits
// splits: the last split's merge of every partial grows with the count. Issue 23's sweep on
// the H100 (C++ decode bench, dense bf16, 32 / 8 heads, d 128, forced counts, one call):
// batch 1 at 32k 72.0 us at the 49 splits that fill the 396 slots, 59.8-59.9 at 24-32, 62.3
// at 16; at 128k 197.7 against 185.0-185.9. Several waves instead (more blocks than slots)
// measured slower where one wave fits (batch 32, 256 units: 7 splits 1405 us at 32k against
// 1338 for one split) and not clearly faster where it does not (batch 64: 4 splits 2688 /
// 2775 us against 2814 / 2776 in two calls); docs/performance.md, "Variants".
constexpr int kMaxWaveSplits = 32;
// GQA-packed rows up to which a KV-cache call without fp8 / tree / splits still takes the
// decode kernel (beyond: the 64/128-row forward tiles read K/V fewer times).
constexpr int kDecodeMaxRows = 128;

std::size_t round_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device, 108); }
int cc_major(int device) { return device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0); }

// The configuration of the decode kernel a call takes within a shared-memory limit: the
// default where it fits, else the small one (fewer stages; the same kernel where their
// stage counts agree); `fits` false when neither does (smem then is the small one's need).
struct TileFacts {
  int block_n = 64;
  int smem = 0;        // dynamic shared memory per block
  int seg_elems = 64;  // elements per 128-byte segment of a key row (the TMA box width)
  int segs = 2;        // 128-byte segments of the bucket's key row
  bool small = false;
  bool fits = true;
};

// The decode kernel's static shared memory (the split merge's flag, padded to the dynamic
// buffer's 128-byte alignment; ptxas -v), which the device's limit per block counts too.
constexpr int kDecodeStaticSmem = 128;

template <class Tr>
TileFacts facts_of(bool small, int limit) {
  return {Tr::kBlockN, Tr::kSmemBytes, Tr::kSegElems, Tr::kSegs, small, Tr::kSmemBytes + kDecodeStaticSmem <= limit};
}
template <int D, bool kFp8, bool kT8>
TileFacts facts_within(int limit) {
  using Default = DecodeTraits<D, kFp8, kT8>;
  using Small = DecodeTraits<D, kFp8, kT8, true>;
  // What the 99 KiB GPUs rely on: fp8 K/V fit at every head dim up to 256, 16-bit K/V up
  // to 128 (beyond, KV-cache calls without a tree mask take the fused forward), both in the
  // 512 bucket (its 16-key tiles; the fused forward has no 99 KiB tile there).
  constexpr int kSmallNeed = Small::kSmemBytes + kDecodeStaticSmem;
  static_assert(D > 256 || !kFp8 || kSmallNeed <= kDecodeSmallSmemBytes, "fp8 decode above 99 KiB");
  static_assert(D > 128 || kSmallNeed <= kDecodeSmallSmemBytes, "16-bit decode above 99 KiB");
  static_assert(D <= 256 || kSmallNeed <= kDecodeSmallSmemBytes, "512 decode above 99 KiB");
  if (Default::kSmemBytes + kDecodeStaticSmem <= limit) return facts_of<Default>(false, limit);
  return facts_of<Small>(kDecodeHasSmall<D, kFp8, kT8>, limit);
}
template <int D>
TileFacts facts_for(bool fp8, bool t8, int limit) {
  if (fp8) return t8 ? facts_within<D, true, true>(limit) : facts_within<D, true, false>(limit);
  return t8 ? facts_within<D, false, true>(limit) : facts_within<D, false, false>(limit);
}

// At most 8 GQA-packed rows per KV head: the transposed kernel (decode_kernel.cuh: kT8).
bool use_t8(const FwdParams& p) { return std::int64_t(p.seqlen_q) * p.h_ratio <= 8; }

// cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link); null
// where the driver does not offer it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The tensor map of a K or V cache, boxes of box_rows rows with 128-byte swizzle:
// rank 5 (segment elements, rows of a cache row or block, 128-byte segments of d, h_k,
// cache rows or blocks), a box covering a row's segments, where d is a whole number of
// segments (segs of them); else rank 4 (d, rows, h_k, cache rows or blocks), a box per
// segment, the last one's columns past d zero-filled. 0 when the layout does not meet
// TMA's rules (16-byte aligned base and strides) or encoding fails.
// L2 promotion of the copies: 128 B, a segment. 256 B (the next segment too) doubled the
// L2 traffic (2.17 GB of L2 bytes for 1.07 GB read from DRAM, against the peers' 1.62 GB)
// and cost 10% at 32k-128k (docs/performance.md); none measures the same as 128 B.
constexpr auto kL2Promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
int encode_kv_map(const FwdParams& p, const void* base, std::int64_t row_stride, std::int64_t head_stride,
                  std::int64_t batch_stride, int elem, int seg_elems, int segs, int box_rows, TensorMapBytes& out) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || p.d < seg_elems) return 0;
  if (reinterpret_cast<std::uintptr_t>(base) % 16 != 0) return 0;
  const std::int64_t strides[3] = {row_stride * elem, head_stride * elem, batch_stride * elem};
  for (std::int64_t st : strides) {
    if (st <= 0 || st % 16 != 0 || st >= (std::int64_t(1) << 40)) return 0;
  }
  static_assert(sizeof(CUtensorMap) == sizeof(TensorMapBytes), "CUtensorMap size");
  const auto dtype = elem == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
  const cuuint32_t estrides[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  if (p.d == seg_elems * segs) {
    const cuuint64_t dims[5] = {cuuint64_t(seg_elems), cuuint64_t(p.kv_cache_len), cuuint64_t(segs),
                                cuuint64_t(p.h_k), cuuint64_t(p.kv_cache_rows)};
    const cuuint64_t gstrides[4] = {cuuint64_t(strides[0]), 128, cuuint64_t(strides[1]), cuuint64_t(strides[2])};
    const cuuint32_t box[5] = {cuuint32_t(seg_elems), cuuint32_t(box_rows), cuuint32_t(segs), 1, 1};
    if (encode(&map, dtype, 5, const_cast<void*>(base), dims, gstrides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, kL2Promotion,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS) {
      std::memcpy(out.bytes, &map, sizeof(map));
      return 5;
    }
  }
  const cuuint64_t dims[4] = {cuuint64_t(p.d), cuuint64_t(p.kv_cache_len), cuuint64_t(p.h_k),
                              cuuint64_t(p.kv_cache_rows)};
  const cuuint64_t gstrides[3] = {cuuint64_t(strides[0]), cuuint64_t(strides[1]), cuuint64_t(strides[2])};
  const cuuint32_t box[4] = {cuuint32_t(seg_elems), cuuint32_t(box_rows), 1, 1};
  if (encode(&map, dtype, 4, const_cast<void*>(base), dims, gstrides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, kL2Promotion,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return 0;
  }
  std::memcpy(out.bytes, &map, sizeof(map));
  return 4;
}

// sm90 tensor copies for this call, when the cache layout allows them: a dense cache in
// boxes of a whole tile, a paged one in boxes of gcd(block_size, tile) >= 8 rows (a box
// never crosses a block).
void plan_tma(const FwdParams& p, const TileFacts& tf, DecodeArgs& a) {
  a.tma = false;
  if (cc_major(p.device_index) < 9 || p.kv_cache_rows <= 0 || p.kv_cache_len <= 0) return;
  const int box_rows = p.block_table ? std::gcd(p.block_size, tf.block_n) : tf.block_n;
  if (box_rows < 8) return;
  const int elem = p.kv_dtype == DType::kFloat8E4M3 ? 1 : 2;
  // A 128-byte segment of the bucket's key rows wholly past d (d <= 448 in the 512 bucket's
  // 8 segments, or a d whose own bucket this build lacks): cp.async, which zero-fills it,
  // rather than a tensor copy of a box that lies wholly outside the map.
  if (p.d * elem <= (tf.segs - 1) * 128) return;
  a.box_rows = box_rows;
  const int rk = encode_kv_map(p, p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride, elem, tf.seg_elems,
                               tf.segs, box_rows, a.k_map);
  const int rv = rk == 0 ? 0
                         : encode_kv_map(p, p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride, elem,
                                         tf.seg_elems, tf.segs, box_rows, a.v_map);
  if (rk != 0 && rk == rv) {
    a.tma = true;
    a.map_rank = rk;
  }
}

// Whether `clusters` clusters of `splits` blocks of the call's decode kernel (t8, small)
// can all be resident at once: the portable sizes (<= 8) always (the plan keeps a block per
// SM), 9..kMaxClusterSplits by the device's answer (decode_max_active_clusters: cached per
// device, kernel and size; no device work, safe under graph capture).
bool clusters_fit(const FwdParams& p, bool t8, bool small, std::int64_t splits, std::int64_t clusters) {
  if (splits <= kMaxPortableClusterSplits) return true;
  if (splits > kMaxClusterSplits) return false;
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  const bool bf16 = p.dtype == DType::kBFloat16;
  const int n = static_cast<int>(splits);
  const int dev = p.device_index;
#define FLASHATTN_DECODE_CLUSTERS(D)                                                   \
  if (p.d <= D) {                                                                      \
    const int active = fp8    ? decode_fp8_max_active_clusters<D>(dev, t8, small, n)  \
                       : bf16 ? decode_max_active_clusters<D, __nv_bfloat16>(dev, t8, small, n) \
                              : decode_max_active_clusters<D, __half>(dev, t8, small, n);       \
    return active >= clusters;                                                         \
  }
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_DECODE_CLUSTERS)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_DECODE_CLUSTERS)
#undef FLASHATTN_DECODE_CLUSTERS
  return false;
}

// smem_limit <= 0: not resolved (no limit; the dispatch always resolves it).
TileFacts tile_facts(int d, bool fp8, bool t8, int smem_limit) {
  const int limit = smem_limit > 0 ? smem_limit : std::numeric_limits<int>::max();
#define FLASHATTN_DECODE_FACTS(D) \
  if (d <= D) return facts_for<D>(fp8, t8, limit);
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_DECODE_FACTS)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_DECODE_FACTS)
#undef FLASHATTN_DECODE_FACTS
  return {};
}

// The shared memory per block the fused forward needs at least for head dims up to d_max
// (max(d, d_v)), which takes the KV-cache calls the decode kernel leaves (tile_size.hpp):
// up to 256 its 99 KiB tiles, within every limit a GPU of the family grants (0 here);
// above, the 512 bucket's one tile (112 KiB: none on a 99 KiB GPU).
int fused_forward_need(int d_max) { return d_max <= 256 ? 0 : fwd_smem_bytes(fwd_tile_small(512), 512); }
bool fused_forward_fits(int d_max, int smem_limit) {
  return smem_limit <= 0 || smem_limit >= fused_forward_need(d_max);
}

}  // namespace

DecodePlan plan_decode(const FwdParams& p) {
  DecodePlan plan;
  if (p.cache_seqlens == nullptr) return plan;  // not a KV-cache call
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  if (p.d_v != p.d) {
    // v with its own head dim: the decode kernel has one (d); the fused forward serves
    // the call (sm80 in the bucket of max(d, d_v), or sm90 where it takes the call;
    // num_splits, a speed hint, is not used there). fp8 caches and draft-tree masks only
    // the decode kernel runs: the API rejects them naming v_cache before the append
    // (api/dispatch.hpp: check_kvcache_head_dim_v); here for any other caller. Above 256
    // the fused forward's tile needs 112 KiB: on a 99 KiB GPU an error naming v_cache (the
    // decode kernel, which fits, would take d_v == d), before the call appends.
    if (!fp8 && p.tree_mask == nullptr) {
      const int d_max = std::max(p.d, p.d_v);
      if (!fused_forward_fits(d_max, p.smem_limit)) {
        throw Unsupported("kvcache_forward", "v_cache",
                          "head dim d_v == d = " + std::to_string(p.d) + " (the decode kernel) or at least " +
                              std::to_string(fused_forward_need(d_max)) +
                              " bytes of shared memory per block for the fused forward, which runs KV-cache calls "
                              "with d_v != d, at head dims above 256",
                          "d_v = " + std::to_string(p.d_v) + " with " + std::to_string(p.smem_limit) +
                              " bytes (the device's limit or opts.smem_cap)");
      }
      return plan;
    }
    throw Unsupported("kvcache_forward", "v_cache",
                      "head dim d_v == d = " + std::to_string(p.d) +
                          (fp8 ? " with a float8_e4m3 cache" : " with a draft-tree mask") +
                          " (the decode kernel, which alone runs them, has one head dim)",
                      "d_v = " + std::to_string(p.d_v));
  }
  const std::int64_t rows = std::int64_t(p.seqlen_q) * p.h_ratio;
  // Above 256 on a 99 KiB GPU the fused forward has no tile: the decode kernel takes every
  // row count there.
  const bool fused = fused_forward_fits(p.d, p.smem_limit);
  if (!(fp8 || p.tree_mask != nullptr || p.num_splits > 1 || rows <= kDecodeMaxRows) && fused) return plan;
  const TileFacts tf = tile_facts(p.d, fp8, use_t8(p), p.smem_limit);
  if (!tf.fits) {
    // No decode configuration within p.smem_limit (16-bit K/V at d >= 160 on a 99 KiB
    // GPU): the fused forward serves the call as it serves those with more packed rows
    // (num_splits, a speed hint, is not used there). fp8 caches and draft-tree masks only
    // the decode kernel runs: an error here, before the call appends to the caches (as for
    // a limit that neither holds: none a GPU grants, the 512 bucket's decode kernel fitting
    // in 99 KiB).
    if (!fp8 && p.tree_mask == nullptr && fused) return plan;
    throw Unsupported("kvcache_forward", p.tree_mask != nullptr ? "tree_mask" : fp8 ? "k_cache" : "q",
                      "at least " + std::to_string(tf.smem + kDecodeStaticSmem) +
                          " bytes of shared memory per block for the decode kernel of head dim " +
                          std::to_string(p.d) + (fp8 ? " (fp8 K/V)" : " (16-bit K/V)") +
                          (p.tree_mask != nullptr ? ", which draft-tree masks need (the fused forward serves "
                                                    "KV-cache calls without one)"
                           : fp8                  ? ", which fp8 caches need"
                                                  : " (the fused forward needs " +
                                                        std::to_string(fused_forward_need(p.d)) + ")"),
                      std::to_string(p.smem_limit) + " bytes (the device's limit or opts.smem_cap)");
  }
  plan.use = true;
  plan.small = tf.small;
  plan.row_chunks = static_cast<int>((rows + 15) / 16);
  const std::int64_t max_tiles = (std::int64_t(p.seqlen_k) + tf.block_n - 1) / tf.block_n;
  const std::int64_t units = std::max<std::int64_t>(1, std::int64_t(p.batch) * p.h_k * plan.row_chunks);
  const std::int64_t sms = sm_count(p.device_index);
  const bool clusters = cc_major(p.device_index) >= 9;
  int splits = p.num_splits;
  if (splits == 0) {
    const int per_sm = std::max(1, std::min(16, (228 * 1024) / (tf.smem + 1024)));
    const std::int64_t slots = sms * per_sm;
    std::int64_t s = std::min<std::int64_t>(slots / units, kMaxWaveSplits);
    s = std::min<std::int64_t>(s, std::max<std::int64_t>(1, max_tiles / kMinTilesPerSplit));
    splits = static_cast<int>(std::clamp<std::int64_t>(s, 1, kMaxSplits));
    // A small grid on sm90 with few key tiles: as many cluster splits (of at least
    // kMinTilesPerClusterSplit tiles, at most 8) as one block per SM allows, where each split then
    // has at most kMaxTilesPerClusterSplit tiles (the long cap where the grid fills more
    // than half the SMs); the cluster merge costs less than the workspace's, so splits of
    // two tiles pay.
    // Before it, a grid filling more than half the SMs takes more than 8 (up to 16) cluster
    // splits of kMinTilesPerWideClusterSplit .. kMaxTilesPerWideClusterSplit tiles where
    // the device holds its clusters (batch 1 at 4k .. 16k).
    if (clusters) {
      const std::int64_t s_cl = std::min<std::int64_t>({std::int64_t{kMaxPortableClusterSplits}, sms / units,
                                                        std::max<std::int64_t>(1, max_tiles / kMinTilesPerClusterSplit)});
      const std::int64_t cap = 2 * units * s_cl > sms ? kMaxTilesPerClusterSplitFull : kMaxTilesPerClusterSplit;
      const std::int64_t s_wide = std::min<std::int64_t>({std::int64_t{kMaxClusterSplits}, sms / units,
                                                          std::max<std::int64_t>(1, max_tiles / kMinTilesPerWideClusterSplit)});
      if (s_wide > kMaxPortableClusterSplits && 2 * units * s_wide > sms &&
          max_tiles <= kMaxTilesPerWideClusterSplit * s_wide && clusters_fit(p, use_t8(p), tf.small, s_wide, units)) {
        splits = static_cast<int>(s_wide);
      } else if (s_cl >= 2 && max_tiles <= cap * s_cl) {
        splits = static_cast<int>(s_cl);
      }
    }
  }
  plan.splits = std::max(1, splits);
  // The cluster merge where every block of the grid can have an SM of its own (a cluster's
  // blocks run on one GPC together; a grid that does not fit so measured slower with
  // clusters on the H100: batch 8, 6 splits, 1610 against 1398 us at 128k), above 8 splits
  // where the device also holds all the grid's clusters (units of them) at once.
  plan.cluster = clusters && plan.splits >= 2 && plan.splits <= kMaxClusterSplits &&
                 units * plan.splits <= sms && clusters_fit(p, use_t8(p), tf.small, plan.splits, units);
  if (plan.splits > 1 && !plan.cluster) {
    const std::size_t partial_rows =
        std::size_t(plan.splits) * std::size_t(p.batch) * std::size_t(p.h_q) * std::size_t(p.seqlen_q);
    const std::size_t words = std::size_t(p.batch) * std::size_t(p.h_k) * std::size_t(plan.row_chunks);
    plan.o_bytes = round_up(partial_rows * std::size_t(p.d) * sizeof(float));
    plan.lse_bytes = round_up(partial_rows * sizeof(float));
    plan.counter_bytes = words * sizeof(unsigned int);
    plan.workspace_bytes = plan.o_bytes + plan.lse_bytes + round_up(plan.counter_bytes);
  }
  return plan;
}

void run_decode_path(const FwdParams& p, const DecodePlan& plan) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.h_q == 0) return;
  DecodeArgs a;
  a.splits = plan.splits;
  a.cluster = plan.cluster;
  a.row_chunks = plan.row_chunks;
  a.t8 = use_t8(p);
  a.q_bf16 = p.dtype == DType::kBFloat16;  // fp8 q: out's dtype (p.dtype)
  a.q_fp8 = p.q_dtype == DType::kFloat8E4M3;
  // Interleaved and contiguous split ranges measured the same on the H200 (3.58 / 3.57 TB/s
  // at 32k); interleaved keeps a sequence's blocks in one region of the cache.
  a.interleave = true;
  // Programmatic dependent launch on sm90: the kernel's launch and start overlap the end
  // of the kernel before it in the stream (it waits for that kernel's results before its
  // first global access), and the next kernel's those of this one.
  a.pdl = cc_major(p.device_index) >= 9;
  if (plan.splits > 1 && !plan.cluster) {
    a.ws_o = static_cast<float*>(p.workspace);
    a.ws_lse = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.o_bytes);
    a.ws_count = reinterpret_cast<unsigned int*>(static_cast<char*>(p.workspace) + plan.counter_offset());
    // The arrival counters start at zero whatever the workspace held (compute-sanitizer
    // initcheck: the tagged words they replace read the caller's uninitialised memory):
    // zeroed by the call's device index check (kvcache_forward, p.zeroed_counters: no node
    // of its own between the check and this launch), else here.
    if (p.zeroed_counters != a.ws_count || p.zeroed_counter_bytes != plan.counter_bytes) {
      FLASHATTN_CUDA_CHECK(cudaMemsetAsync(a.ws_count, 0, plan.counter_bytes, static_cast<cudaStream_t>(p.stream)));
    }
  }
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3;
  const bool bf16 = p.dtype == DType::kBFloat16;
  // plan_decode's configuration (it declines or rejects the calls that none fits); its
  // tile geometry is the same in both.
  const TileFacts tf = tile_facts(p.d, fp8, a.t8, p.smem_limit);
  const bool small = plan.small;
  plan_tma(p, tf, a);
  // fp8 q: its descales, per (sequence, KV head), fold into the kernel like per-head scales
  // (DecodeArgs::q_fp8); p.scale_block_stride != 0 selects the kernel's per-key scale path,
  // which is for the per-(block, head) scales of an fp8 cache under 16-bit q. (A test of
  // a.q_fp8 in the kernel's per-key choice instead changed the registers of the fp8 kernels
  // for the 16-bit-q modes.)
  FwdParams pk = p;
  if (a.q_fp8) pk.scale_block_stride = 0;
#define FLASHATTN_DECODE_BUCKET(D)                               \
  if (p.d <= D) {                                                \
    if (fp8) run_decode_fp8<D>(pk, a, small);                    \
    else if (bf16) run_decode<D, __nv_bfloat16>(p, a, small);    \
    else run_decode<D, __half>(p, a, small);                     \
    return;                                                      \
  }
  FLASHATTN_CUDA_FOR_EACH_HEAD_DIM(FLASHATTN_DECODE_BUCKET)
  FLASHATTN_CUDA_FOR_EACH_WIDE_HEAD_DIM(FLASHATTN_DECODE_BUCKET)
#undef FLASHATTN_DECODE_BUCKET
}

}  // namespace flashattn::detail::cuda::sm80

namespace flashattn::detail::cuda {

bool decode_fits(int d, bool fp8_cache, int smem_limit) noexcept {
  if (!supports_wide_head_dim(d)) return false;
  return sm80::tile_facts(d, fp8_cache, false, smem_limit).fits && sm80::tile_facts(d, fp8_cache, true, smem_limit).fits;
}

bool kvcache_fits(int d, bool fp8_cache, bool tree_mask, int smem_limit) noexcept {
  if (!supports_wide_head_dim(d)) return false;
  return decode_fits(d, fp8_cache, smem_limit) ||
         (!fp8_cache && !tree_mask && sm80::fused_forward_fits(d, smem_limit));
}

bool decode_clusters_fit(int device, int d, bool bf16, bool fp8_cache, int packed_rows, int splits, int clusters,
                         int smem_limit) noexcept {
  if (!supports_wide_head_dim(d) || splits < 2 || splits > sm80::kMaxClusterSplits) return false;
  if (sm80::cc_major(device) < 9) return false;
  try {
    FwdParams p;
    p.d = p.d_v = d;
    p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat16;
    p.kv_dtype = fp8_cache ? DType::kFloat8E4M3 : p.dtype;
    p.seqlen_q = 1;
    p.h_ratio = packed_rows;
    p.device_index = device;
    const bool t8 = sm80::use_t8(p);
    const sm80::TileFacts tf = sm80::tile_facts(d, fp8_cache, t8, smem_limit);
    return tf.fits && sm80::clusters_fit(p, t8, tf.small, splits, clusters);
  } catch (...) {
    return false;
  }
}

}  // namespace flashattn::detail::cuda
