// flashattn public API: the entry points.
//
// All tensors are caller-allocated views (tensor.hpp). All tensors of one call
// live on one device; the backend follows from it (CPU tensors run on the CPU
// backend, CUDA tensors on the best CUDA path built for that GPU). CUDA calls
// are ordered on `Options::stream` and return without synchronising.
//
// Shapes (b = batch, s = sequence length, h = heads, d = head dim of q and k, d_v = head
// dim of v, which may differ from d as in FlashAttention-3, e.g. DeepSeek-V3's (192, 128)):
//   q   [b, s_q, h_q, d]      k [b, s_k, h_k, d]      v [b, s_k, h_k, d_v]
//   out [b, s_q, h_q, d_v]    (dout, dv have d_v; dq, dk have d)
//   lse [b, h_q, s_q] fp32, natural log of the softmax denominator
// Head dims: the CPU backend takes any d, d_v in [1, 512]; the CUDA kernels need d % 8 == 0
// and d_v % 8 == 0, each at most 512 within the compiled head-dim buckets (else
// Unsupported, naming q or v; a KV-cache call with an fp8 cache or a draft-tree mask needs
// d_v == d, docs/semantics.md).
// The semantics (visibility, order of operations, empty rows, dropout) are in
// semantics.hpp and docs/semantics.md; every backend computes that function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

#include "flashattn/error.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

enum class Backend : std::uint8_t {
  kAuto,  // from the tensors' device
  kCPU,
  kCUDA,
};

// The CUDA kernel family a call runs on. kAuto takes the best one built for the GPU
// (sm90 on Hopper where it supports the call, else sm80, which runs on every GPU from
// Ampere on, Hopper and newer included). Forcing a family the GPU cannot run is an
// Unsupported error. A tuning knob: it changes speed, never results.
enum class KernelFamily : std::uint8_t {
  kAuto,
  kSm80,  // mma.sync, ldmatrix, cp.async: compute capability 8.0 and newer
  kSm90,  // sm90a (TMA, wgmma): compute capability 9.0 only
};

// Block-sparse attention mask (FlashAttention-4's BlockSparseTensors, FlexAttention's
// BlockMask), for the dense and varlen entry points (forward, backward, varlen_forward,
// varlen_backward) on the CPU backend, and the forward (forward, varlen_forward) on CUDA,
// where the blocks must hold whole tiles of the kernel (block_size_q a multiple of 128 and
// block_size_k of 128 serve every head dim; smaller blocks fit some tiles, and which tile
// runs can depend on the lengths: else Unsupported naming opts.block_sparse, with the
// multiples). The KV-cache entry point, and the CUDA backward, decline it (Unsupported
// naming opts.block_sparse).
// The (query, key) plane of each (batch, query head) is tiled into blocks of
// block_size_q x block_size_k elements; M = ceil(s_q / block_size_q) query blocks and
// N = ceil(s_k / block_size_k) key blocks (the last ones may be short). Varlen: positions
// within each sequence, on the grid of M = ceil(max_seqlen_q / block_size_q) by
// N = ceil(max_seqlen_k / block_size_k) (blocks past a sequence's end hold nothing). For query block m,
// the key blocks to visit are listed in two lists:
//   mask_block_cnt int32 [B, H, M],  mask_block_idx int32 [B, H, M, N]: the partial blocks,
//     the first mask_block_cnt[.., m] entries of mask_block_idx[.., m, :] (the rest unread);
//   full_block_cnt / full_block_idx (optional, same layout): the full blocks.
// B is 1 (broadcast) or b, H is 1 (broadcast) or h_q, per pair. Counts lie in [0, N];
// listed indices in [0, N), no block listed twice in one row (in either list or both).
// Query i sees key j only when j's block is listed in i's block row:
//   full block:    every element (no element rule, not even causal / window);
//   partial block: the element rule: (the call's causal / window rule holds, or
//                  j < prefix_keys[b]) and, when doc ids are given,
//                  q_doc_ids[b][i] == k_doc_ids[b][j].
// Keys of unlisted blocks are masked and never read. Rows that see nothing follow the
// empty-row rule. All-partial lists with no prefix / doc ids are the plain call.
//   q_doc_ids int32 [b, s_q], k_doc_ids int32 [b, s_k] (varlen: [total_q], [total_k], one
//     per packed row) (optional, both or neither): document ids, for document masking
//     within a packed batch;
//   prefix_keys int32 [b] or [1] (optional, >= 0): keys always visible in partial blocks
//     (the prefix of a prefix-LM, the sink tokens of sliding window + sinks).
// Builders for common patterns are in python/flashattn/block_sparse.py.
struct BlockSparseTensors {
  Tensor mask_block_cnt, mask_block_idx;
  Tensor full_block_cnt, full_block_idx;
  int block_size_q = 128;
  int block_size_k = 128;
  Tensor q_doc_ids, k_doc_ids;
  Tensor prefix_keys;
  bool defined() const noexcept { return mask_block_cnt.defined() || mask_block_idx.defined() ||
                                         full_block_cnt.defined() || full_block_idx.defined(); }
};

struct Options {
  // Scale applied to q·k, finite; unset (the default) means 1/sqrt(d) with d the head dim
  // of q and k (not of v); with qv, 1/sqrt(d + d_v) (FlashAttention-3).
  std::optional<float> softmax_scale;
  // Causal masking, aligned to the bottom-right corner: the same as window (-1, 0).
  bool causal = false;
  // Sliding window (left, right); -1 is unbounded. Query i sees key j when
  //   i + s_k - s_q - left <= j <= i + s_k - s_q + right.
  int window_left = -1;
  int window_right = -1;
  // scores become softcap * tanh(scores / softcap); 0 turns it off.
  float softcap = 0.0f;
  // fp32 ALiBi slopes, [h_q] or [b, h_q]; undefined = none.
  // The bias added to score (i, j) is -slope * |i + s_k - s_q - j|.
  Tensor alibi_slopes;
  // Dropout on the attention probabilities, with a counter-based Philox RNG:
  // the kept set is a pure function of (seed, offset, batch, head, i, j).
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  // Make the backward bit-identical across runs and thread counts.
  bool deterministic = false;
  Backend backend = Backend::kAuto;
  // cudaStream_t for CUDA calls (nullptr = the legacy default stream).
  void* stream = nullptr;
  // CPU backend threads; 0 = the OpenMP default (omp_get_max_threads()). The forward and
  // the KV-cache append run on the calling thread plus helpers of a process-wide pool
  // (src/cpu/pool.hpp; helpers poll for work between calls as OMP_WAIT_POLICY says) and
  // return when their tasks are done, without waiting for helpers that woke too late to
  // take one; the backward uses OpenMP teams. Results do not depend on the thread count,
  // except through the automatic split-KV count (num_splits = 0), which follows it. (The
  // CPU backend's instruction-set path is chosen once per process by cpuid, or by
  // FLASHATTN_CPU_ISA = avx2 | avx512bf16; on avx512bf16, bf16 calls round P and dS to bf16
  // before their products as the CUDA kernels do: docs/semantics.md, "CPU backend:
  // instruction-set paths".)
  int num_threads = 0;
  // CUDA: the kernel family (kAuto: the environment variable FLASHATTN_KERNEL_FAMILY =
  // auto | sm80 | sm90 if set, else the best for the GPU).
  KernelFamily kernel_family = KernelFamily::kAuto;
  // CUDA: the most shared memory per block, in bytes, that a kernel configuration may use;
  // 0 = the device's opt-in limit (or FLASHATTN_SMEM_CAP if set), else at least 101376
  // (99 KiB, the smallest limit of a supported GPU: sm86 / sm89). Lets one GPU run the
  // configurations of a smaller one.
  int smem_cap = 0;
  // Learnable attention sinks (FlashAttention-4's learnable_sink, gpt-oss): fp32 [h_q], one
  // extra logit per query head, on q's device, contiguous. It joins every row's softmax
  // denominator and contributes no value: with m the row max over the visible scores and
  // the sink,
  //   out_i = sum_j exp(s_ij - m) v_j / (exp(sink_h - m) + sum_j exp(s_ij - m)),
  // and lse includes it (lse_i = log(exp(sink_h) + sum_j exp(s_ij))). A row that sees no
  // key then has out 0 and lse sink_h. A sink of -inf is no sink. Undefined = none.
  Tensor learnable_sink;
  // Block-sparse mask (see BlockSparseTensors); undefined (no lists) = dense.
  BlockSparseTensors block_sparse;
  // Backward only (backward, varlen_backward): fp32 [h_q] output on q's device, overwritten
  // with d loss / d learnable_sink = -sum over every row i of every sequence of
  //   exp(sink_h - lse_i) * rowsum(dout_i * out_i).
  // Needs learnable_sink. Undefined = not computed (dq, dk, dv do not depend on it).
  Tensor learnable_sink_grad;
  // Debug output for small problems: fp32 [b, h_q, s_q, s_k] (varlen: [h_q, total_q,
  // max_seqlen_k]), written with the attention probabilities after dropout and before
  // the 1/(1-p) scaling: a dropped element is 0, a kept one is P(i, j). Undefined = off.
  Tensor return_probs;
  // Multi-head latent attention (MLA), FlashAttention-3's qv: [b, s_q, h_q, d_v] (varlen:
  // [total_q, h_q, d_v]), q's dtype and device, last dim contiguous; forward entry points
  // only (forward, varlen_forward, kvcache_forward). The score of query i and key j becomes
  //   softmax_scale * (q_i . k_j + qv_i . v_j)
  // (then softcap, ALiBi, masks as usual) and the output stays sum_j P_ij v_j: v holds one
  // latent per token that serves both the score and the value. DeepSeek-V3's decode:
  // k_cache holds the rope keys (d = 64), v_cache the latent (d_v = 512), h_k = 1 under
  // many query heads, paged. The default scale is then 1/sqrt(d + d_v). There is no
  // backward with qv (as in FlashAttention-3): backward / varlen_backward reject it
  // (Unsupported). CUDA: the sm80 family's MLA kernel on every GPU with 160 KB of shared
  // memory per block (A100, H100, H200; src/cuda/sm80/mla_kernel.cuh): float16 / bfloat16,
  // d <= 64 and d_v <= 512 (multiples of 8), no dropout, no block_sparse; KV-cache calls
  // with dense or paged 16-bit caches (no fp8 cache, no tree_mask). Anything else is
  // Unsupported naming the argument. On an H100 / H200 in the sm90 family the sm90 MLA
  // kernel (src/cuda/sm90/mla_kernel.cuh: wgmma, TMA) runs the calls it covers (K / V
  // 16-byte aligned; paged blocks with gcd(block_size, 64) >= 8), the sm80 one the rest.
  // Undefined = none.
  Tensor qv;
  // fp8 forward (FlashAttention-3's q_descale, k_descale, v_descale): with q, k, v all of
  // dtype float8_e4m3, the value of an element is float(e4m3) * descale[b, g], g the KV
  // head of the element (for q: the KV head of its query head's group, h / (h_q / h_k)).
  // Each is fp32 [b, h_k] (varlen: b sequences), on q's device, last dim contiguous (CUDA:
  // the whole [b, h_k] contiguous, stride[0] == h_k, as the kernel reads it on the device);
  // undefined = 1. Must be undefined unless q is float8_e4m3. With fp8 q, k, v, `out` is
  // bfloat16 or float16 (the caller's out tensor picks; FlashAttention-3 defaults to
  // bfloat16) and lse fp32; the CPU backend dequantizes while loading tiles, computes in
  // fp32 and rounds the output once. Forward entry points forward, varlen_forward and
  // kvcache_forward (fp8 q over an fp8 cache: see KVCacheArgs); backward / varlen_backward
  // (no fp8 backward, as in FlashAttention-3) decline fp8 q with Unsupported naming q; no qv
  // with fp8 q. CUDA tensors: forward and varlen_forward run the sm90 (Hopper) fp8 kernel
  // (docs/fp8.md: it rounds P to e4m3 for the P V product); there dropout_p > 0,
  // return_probs and block_sparse are Unsupported naming the option, as are GPUs other than
  // sm90 and head dims the kernel lacks; kvcache_forward with fp8 q runs on CUDA in the
  // KV-cache decode kernel (every sm80+ GPU; see KVCacheArgs).
  Tensor q_descale, k_descale, v_descale;
};

// Optional caller-provided scratch memory on the call's device. When absent
// (size 0) and the call needs scratch, the library allocates it stream-ordered. Its
// contents before a call do not matter (nothing needs zeroing, also between replays of a
// captured call); calls that share one workspace must not run concurrently.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// ---------------------------------------------------------------- dense batch

// out = softmax(mask(alibi(softcap(scale * q k^T)))) v, with dropout; lse optional.
void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
             const Tensor& lse, const Options& opts = {});

// Gradients of forward. `out` and `lse` are forward's outputs for the same
// arguments. dk and dv are summed over the query heads of each GQA group.
void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
              const Tensor& dv, const Options& opts = {}, Workspace workspace = {});

// Bytes of scratch backward wants (fp32 accumulators); 0 if none.
std::size_t backward_workspace_size(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Options& opts = {});

// ------------------------------------------------------- variable length (packed)

// q [total_q, h_q, d], k [total_k, h_k, d], v [total_k, h_k, d_v], out [total_q, h_q, d_v],
// lse [h_q, total_q].
// cu_seqlens_q/_k: int32 [b + 1], non-decreasing, starting at 0, ending at most at the
// tensor's first dimension. seqused_k (optional, int32 [b]): keys used per sequence
// (the first seqused_k[i] keys of sequence i), at most its length.
// seqused_q (optional, int32 [b]; every backend): of sequence i's query slots
// only the first seqused_q[i] are real, at most its length; the sequence then has
// s_q = seqused_q[i] queries (the visibility rule's s_q), and the rows past them are not
// computed: their out and dq are 0 and their lse is -inf.
struct VarlenArgs {
  Tensor q, k, v;
  Tensor cu_seqlens_q, cu_seqlens_k;
  Tensor seqused_k;
  Tensor seqused_q;
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;
};

void varlen_forward(const VarlenArgs& args, const Tensor& out, const Tensor& lse,
                    const Options& opts = {});

void varlen_backward(const VarlenArgs& args, const Tensor& dout, const Tensor& out,
                     const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                     const Options& opts = {}, Workspace workspace = {});

std::size_t varlen_backward_workspace_size(const VarlenArgs& args, const Options& opts = {});

// ------------------------------------------------------------------ KV cache

// Inference against a KV cache.
//   q [b, s_q, h_q, d]; out [b, s_q, h_q, d_v]; v_cache and v_new have d_v, k_cache and
//                 k_new d (d_v == d unless v_cache says otherwise; on CUDA d_v != d runs
//                 the fused forward, not the split-KV decode kernel, so num_splits is unused
//                 there, and an fp8 cache or a tree_mask with d_v != d is Unsupported
//                 naming v_cache)
//   dense cache:  k_cache, v_cache [b_cache, s_cache, h_k, d]
//   paged cache:  k_cache, v_cache [num_blocks, block_size, h_k, d] and
//                 block_table int32 [b, max_blocks_per_seq]; key t of sequence i lives in
//                 block block_table[i][t / block_size], row t % block_size.
//   cache_seqlens int32 [b]: keys already in the cache for each sequence.
//   cache_batch_idx int32 [b] (optional, dense caches only): cache row of each sequence.
//   k_new, v_new [b, s_new, h_k, d] (optional): written into the cache in place at
//                 positions cache_seqlens[i] .. cache_seqlens[i] + s_new - 1 before attending.
// No slot is appended to twice or both appended to and read as a cached key (blocks or
// rows may be shared for reading), and k_cache, v_cache are apart. Order: every argument
// check (those of the attention too) runs before the append; after it only a backend
// failure (CudaError, out of memory) can stop the attention, and the cache then already
// holds the new keys. Sequence i then attends to s_k = cache_seqlens[i] + s_new keys.
// cache_seqlens is not updated: the caller advances it. num_splits splits the keys for split-KV decoding
// (1 = no split, 0 = heuristic); partial results are merged by their log-sum-exp.
//
// Quantized cache: k_cache / v_cache both of dtype float8_e4m3 (q, k_new, v_new, out keep
// q's dtype: float16 / bfloat16, also float32 / float64 on the CPU). The value of a cached
// element is float(e4m3) * scale, with fp32 scales on q's device, last dim contiguous,
//   k_scale, v_scale  [h_k]             one scale per KV head, or
//                     [cache_rows, h_k] one per (block, KV head); cache_rows = k_cache.shape[0]
//                                       (num_blocks when paged, b_cache when dense),
// both of one layout. Scales are required for an fp8 cache under 16-bit q and must be
// undefined otherwise.
//
// fp8 q (FlashAttention-3's fp8 decode): q, k_cache, v_cache (and k_new, v_new) all
// float8_e4m3, dequantized by Options::q_descale / k_descale / v_descale fp32 [b, h_k]
// (undefined = 1): key j of sequence i, KV head g is float(e4m3) * k_descale[i][g]
// whatever block or cache row holds it (a block shared by two sequences is read under each
// one's descale); k_new / v_new are appended as bytes. k_scale / v_scale must be undefined,
// a 16-bit cache is an InvalidArgument naming k_cache; out bfloat16 / float16. Both
// backends; CUDA runs it in the KV-cache decode kernel (f16 MMAs over the exactly converted
// e4m3 q, k, v, fp32 accumulation, P rounded to f16; q_descale * k_descale scale the
// scores, v_descale the output), dense and paged, with cache_batch_idx, masks, softcap,
// ALiBi, sinks, draft trees and splits; there d_v != d is Unsupported naming v_cache and
// cache_leftpad Unsupported as for every CUDA call, and each descale given must be
// contiguous [b, h_k] (stride[0] == h_k). Under 16-bit q, k_new / v_new are quantized into
// the cache on append with the scale of the destination (block, head): e4m3(float(x) /
// scale), fp32 quotient, round to nearest even, saturating at +-448 (NaN -> 0x7F); see
// semantics::quantize_e4m3.
//
// Speculative decoding with a draft tree: tree_mask int32 [b, s_q, ceil(s_q / 32)].
// The last s_q keys of each sequence are the draft tokens; query i sees draft t (key
// s_k - s_q + t) only when bit t % 32 of tree_mask[b][i][t / 32] is set (bits t >= s_q
// are ignored). Earlier keys follow the other masks only; the tree rule is and-ed with
// causal / window. On q's device; the last dim contiguous, other strides free.
//
// MLA decode (Options::qv, FlashAttention-3's qv [b, s_q, h_q, d_v]): k_cache holds the
// rope keys, v_cache the latent, which serves both the score (q . k + qv . v) and the
// value; an fp8 cache dequantizes v with v_scale in both uses (CPU backend; on CUDA the MLA
// kernel reads 16-bit caches: an fp8 cache or a tree_mask with qv is Unsupported naming it,
// before the append).
//
// Left-padded cache (flash_attn's cache_leftpad): cache_leftpad int32 [b] (optional,
// dense caches only; 0 <= cache_leftpad[i] <= cache_seqlens[i]). Sequence i's cached keys
// are then rows cache_leftpad[i] .. cache_seqlens[i] - 1 of its cache row (the rows
// before are padding, never read); k_new / v_new are still written at cache_seqlens[i]
// .., and the sequence has s_k = cache_seqlens[i] + s_new - cache_leftpad[i] keys: key j
// is cache row cache_leftpad[i] + j, and causal / window / ALiBi / tree masks use this
// s_k and j. CPU backend only for now (CUDA: Unsupported naming cache_leftpad).
struct KVCacheArgs {
  Tensor q;
  Tensor k_cache, v_cache;
  Tensor cache_seqlens;
  Tensor block_table;
  Tensor cache_batch_idx;
  Tensor k_new, v_new;
  int num_splits = 0;
  Tensor k_scale, v_scale;  // fp8 cache only
  Tensor tree_mask;         // optional
  Tensor cache_leftpad;     // optional, int32 [b], dense caches only
};

void kvcache_forward(const KVCacheArgs& args, const Tensor& out, const Tensor& lse,
                     const Options& opts = {}, Workspace workspace = {});

// Bytes of workspace kvcache_forward needs for these arguments: from shapes only (the
// index tensors' contents of a CUDA call are not read, so no host copy or synchronisation;
// kvcache_forward checks them).
std::size_t kvcache_workspace_size(const KVCacheArgs& args, const Options& opts = {});

// ------------------------------------------------------------------ utilities

// True when this build has the CUDA backend and a CUDA device is visible.
bool cuda_available() noexcept;

// CUDA index tensors are checked on the device. A CUDA varlen, KV-cache or block-sparse
// call does not copy its index tensors (cu_seqlens_q / _k, seqused_k, seqused_q,
// cache_seqlens, cache_batch_idx, block_table, the block-sparse lists) to the host and
// never synchronises: a small kernel checks them in stream order before the call's kernels
// (also inside a captured CUDA graph, at every replay), the kernels clamp bad values
// (docs/semantics.md, "Index tensors checked on the device"), and a KV-cache append whose
// targets conflict (a block or cache row written twice, or written where another
// sequence reads cached keys) writes nothing. The first bad value found on a device is
// raised as an InvalidArgumentError, naming the tensor, entry, expected range and value,
// by the next CUDA call on that device or by check_errors(). check_errors raises it for
// `device` (-1: any device) and clears it; it does not synchronise, so synchronise the
// stream first to see the checks of the calls on it. Without CUDA it does nothing.
// FLASHATTN_DEVICE_INDEX_CHECKS=0 in the environment restores the host check of eager
// calls: a copy to the host and a stream synchronisation per index tensor, and the error
// raised by the call itself (captured calls still check on the device).
void check_errors(int device = -1);

// Library version, e.g. "0.1.0".
const char* version() noexcept;

}  // namespace flashattn
