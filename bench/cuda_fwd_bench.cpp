// Forward throughput of the CUDA backend on the standard grid of the FlashAttention
// papers: bf16, batch x seqlen = 16384 tokens, model dim 2048 (heads = 2048 / hdim),
// hdim 64 / 128 / 256 (and 512 where the build has its bucket), causal and not, seqlen
// 512 .. 16k. FLOPs = 4 b h s^2 d, halved when causal (at hdim 512 the kernel computes
// Q K^T once per 256-column slice of V, twice: 1.5x these FLOPs, not counted). Each configuration is timed with CUDA events per call (median of the
// repeats, after warm-up), alternating between two input sets so the L2 cache does not
// carry one call's inputs into the next.
//
//   flashattn_cuda_fwd_bench [csv path|-] [hdim causal seqlen]
// prints a table (and writes CSV when a path is given); hdim causal seqlen pick the cells
// (0: every value; hdim may list several, e.g. 256,512 to time hdim 512 against 256 in one call).
//   flashattn_cuda_fwd_bench --sparse hdim seqlen
// block-sparse masks of 128 x 128 blocks (random lists per head and query block, half of the
// listed blocks full) at densities 10 / 50 / 100 %, against the same call without a mask:
// one line each, "sparse d s density visited ms ratio" (all on the sm80 family, which runs
// block-sparse masks; density 0.00 is the call without a mask).
// BENCH_FP8=1: e4m3 q, k, v (random codes of magnitude 2^-6 .. 1.875, descales omitted = 1),
// bf16 out, on the sm90 fp8 forward; the time includes its V^T copy (fp8_vt.cu); checked
// against fp64 over the decoded values.
// BENCH_SINK=1: every call has a learnable sink of -1000 per head (the sink's code path
// runs; its term exp(-1000 - m) is 0, so the check against the naive result still holds):
// the cost of a sink against the same grid without one.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/params.hpp"
#include "cuda/sm90/fwd.hpp"
#include "block_lists.hpp"

namespace {

#define BENCH_CHECK(expr)                                                             \
  do {                                                                                \
    const cudaError_t e_ = (expr);                                                    \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_));         \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// One step of a small xorshift generator (state odd, never 0).
std::uint32_t xorshift_next(std::uint32_t& state) {
  state ^= state << 13;
  state ^= state >> 17;
  state ^= state << 5;
  return state;
}

// bf16 bits of values uniform in [-1, 1), from xorshift_next.
std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint16_t> x(n);
  std::uint32_t state = seed | 1u;
  for (std::size_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(xorshift_next(state) >> 8) / 8388608.0f - 1.0f;
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    x[i] = static_cast<std::uint16_t>(u >> 16);
  }
  return x;
}

// e4m3 codes: random sign, exponent field 1..7, mantissa 0..7 (|x| in [2^-6, 1.875]).
std::vector<std::uint8_t> random_e4m3(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> x(n);
  std::uint32_t state = seed | 1u;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t r = xorshift_next(state) >> 8;
    x[i] = static_cast<std::uint8_t>(((r & 1u) << 7) | ((1u + (r >> 1) % 7u) << 3) | ((r >> 4) & 7u));
  }
  return x;
}

float e4m3_to_float(std::uint8_t x) {
  const int e = (x >> 3) & 15, m = x & 7;
  const float mag = e == 0 ? std::ldexp(float(m) / 8.0f, -6) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (x & 0x80) ? -mag : mag;
}

struct Buffers {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  void* q8 = nullptr;  // BENCH_FP8: e4m3 q, k, v and the workspace (V^T)
  void* k8 = nullptr;
  void* v8 = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
};

bool fp8_mode() { return std::getenv("BENCH_FP8") != nullptr; }

float bf16_to_float(std::uint16_t x) {
  const std::uint32_t u = std::uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Correctness of one cell: rows of (batch 0, head 0) and (last batch, last head) against an
// fp64 softmax of the same bf16 inputs; returns max |out - ref| / max |ref| (NaN if any
// output is NaN). BENCH_FP8: the inputs are the decoded e4m3 values, and it returns the
// largest ratio of |out - ref| to the fp8 forward's bound for that element: P rounded to
// e4m3 (relative 2^-4, subnormals 2^-10 absolute, both relative to a reference max >= the
// row's), scores from fp8 products in fp32 (2^-12 of sum |q_c k_c| per score, generous
// for the tensor cores' accumulation), out rounded to bf16 (2^-8):
//   sum_j (2^-4 p_j + 2^-10 + 2 p_j ds_j) |v_j| / l + 2^-8 |ref|.
double check_cell(const Buffers& in, int b, int h, int d, int s, bool causal, float scale) {
  double worst = 0.0, ref_max = 0.0;
  for (int which = 0; which < 2; ++which) {
    const int bb = which ? b - 1 : 0, hh = which ? h - 1 : 0;
    auto fetch = [&](const void* base) {  // [s, d] of (bb, hh) from [b, s, h, d], as floats
      std::vector<float> x(std::size_t(s) * d);
      if (fp8_mode() && base != in.out) {
        std::vector<std::uint8_t> raw(x.size());
        const char* src = static_cast<const char*>(base) + ((std::size_t(bb) * s * h + hh) * d);
        BENCH_CHECK(cudaMemcpy2D(raw.data(), d, src, std::size_t(h) * d, d, s, cudaMemcpyDeviceToHost));
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = e4m3_to_float(raw[i]);
        return x;
      }
      std::vector<std::uint16_t> raw(x.size());
      const char* src = static_cast<const char*>(base) + 2 * ((std::size_t(bb) * s * h + hh) * d);
      BENCH_CHECK(cudaMemcpy2D(raw.data(), 2 * d, src, 2 * std::size_t(h) * d, 2 * d, s, cudaMemcpyDeviceToHost));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(raw[i]);
      return x;
    };
    const bool f8 = fp8_mode();
    const auto q = fetch(f8 ? in.q8 : in.q), k = fetch(f8 ? in.k8 : in.k), v = fetch(f8 ? in.v8 : in.v),
               o = fetch(in.out);
    for (int i : {0, 1, s / 3, s / 2 + 7, s - 2, s - 1}) {
      const int end = causal ? i + 1 : s;
      std::vector<double> sc(end), ds(end);
      double mx = -1e300;
      for (int j = 0; j < end; ++j) {
        double acc = 0, mag = 0;
        for (int c = 0; c < d; ++c) {
          const double t = double(q[std::size_t(i) * d + c]) * k[std::size_t(j) * d + c];
          acc += t;
          mag += std::fabs(t);
        }
        sc[j] = acc * scale;
        ds[j] = std::ldexp(mag * scale, -12);
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (int j = 0; j < end; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
      for (int c = 0; c < d; ++c) {
        double ref = 0, bound = 0;
        for (int j = 0; j < end; ++j) {
          const double vj = v[std::size_t(j) * d + c];
          ref += sc[j] * vj;
          bound += (sc[j] * (0.0625 + 2 * ds[j]) + std::ldexp(1.0, -10)) * std::fabs(vj);
        }
        ref /= sum;
        bound = bound / sum + std::ldexp(std::fabs(ref), -8) + 1e-7;
        const double e = std::fabs(ref - o[std::size_t(i) * d + c]);
        const double r = f8 ? e / bound : e;
        if (!(r <= worst)) worst = r;  // NaN propagates
        ref_max = std::max(ref_max, std::fabs(ref));
      }
    }
  }
  return fp8_mode() ? worst : worst / std::max(ref_max, 1e-30);
}

// The dense [b, s, h, d] bf16 call of the grid on one input set.
flashattn::detail::FwdParams grid_params(const Buffers& in, int b, int h, int d, int s, bool causal) {
  flashattn::detail::FwdParams p;
  p.dtype = p.q_dtype = p.kv_dtype = flashattn::DType::kBFloat16;
  p.batch = b;
  p.h_q = p.h_k = h;
  p.d = p.d_v = d;
  p.h_ratio = 1;
  p.seqlen_q = p.seqlen_k = s;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = std::int64_t(h) * d;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = std::int64_t(s) * h * d;
  p.lse_head_stride = s;
  p.lse_batch_stride = std::int64_t(h) * s;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.mask = flashattn::semantics::Mask::make(causal, -1, -1);
  p.q = in.q;
  p.k = in.k;
  p.v = in.v;
  p.out = in.out;
  p.lse = in.lse;
  if (fp8_mode()) {
    p.q_dtype = p.kv_dtype = flashattn::DType::kFloat8E4M3;
    p.q = in.q8;
    p.k = in.k8;
    p.v = in.v8;
    p.scale_block_stride = h;
    p.scale_by_sequence = true;
    p.workspace = in.ws;
    p.workspace_bytes = in.ws_bytes;
  }
  return p;
}

// One forward call between two events, in ms.
float timed_forward(const flashattn::detail::FwdParams& p, cudaEvent_t start, cudaEvent_t stop) {
  BENCH_CHECK(cudaEventRecord(start));
  flashattn::detail::cuda::forward(p);
  BENCH_CHECK(cudaEventRecord(stop));
  BENCH_CHECK(cudaEventSynchronize(stop));
  float t = 0;
  BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
  return t;
}

double median_of(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int sparse_sweep(const Buffers* sets, int d, int s, cudaEvent_t start, cudaEvent_t stop) {
  constexpr int kTokens = 16384, kModelDim = 2048, kBlock = 128, kWarmup = 3, kRepeats = 15;
  const int b = kTokens / s, h = kModelDim / d, blocks = (s + kBlock - 1) / kBlock;
  double dense_ms = 0;
  for (double density : {0.0, 0.1, 0.5, 1.0}) {  // 0: no mask (the dense call)
    const RandomBlockLists bl = random_block_lists(h * blocks, blocks, density);
    int* dev[4] = {};
    void* ws = nullptr;
    flashattn::detail::FwdParams p = grid_params(sets[0], b, h, d, s, false);
    if (density > 0) {
      for (int l = 0; l < 2; ++l) {
        BENCH_CHECK(cudaMalloc(&dev[2 * l], bl.cnt[l].size() * sizeof(int)));
        BENCH_CHECK(cudaMalloc(&dev[2 * l + 1], bl.idx[l].size() * sizeof(int)));
        BENCH_CHECK(cudaMemcpy(dev[2 * l], bl.cnt[l].data(), bl.cnt[l].size() * sizeof(int), cudaMemcpyHostToDevice));
        BENCH_CHECK(cudaMemcpy(dev[2 * l + 1], bl.idx[l].data(), bl.idx[l].size() * sizeof(int), cudaMemcpyHostToDevice));
      }
    }
    std::vector<float> ms;
    for (int r = 0; r < kWarmup + kRepeats; ++r) {
      p = grid_params(sets[r % 2], b, h, d, s, false);
      p.kernel_family = flashattn::KernelFamily::kSm80;  // the family that runs block-sparse masks
      if (density > 0) {
        for (int l = 0; l < 2; ++l) {
          auto& bl = p.bs_lists[l];
          bl.cnt = dev[2 * l];
          bl.idx = dev[2 * l + 1];
          bl.cnt_h = blocks;
          bl.idx_h = std::int64_t(blocks) * blocks;
          bl.idx_m = blocks;
        }
        p.bs_table_batch = 1;
        p.bs_table_heads = h;
        p.bs_block_q = p.bs_block_k = kBlock;
        p.bs_blocks_q = p.bs_blocks_k = blocks;
        p.bs_head_stride = std::int64_t(blocks) * blocks;
        if (ws == nullptr) BENCH_CHECK(cudaMalloc(&ws, flashattn::detail::cuda::forward_workspace_size(p)));
        p.workspace = ws;
        p.workspace_bytes = flashattn::detail::cuda::forward_workspace_size(p);
      }
      const float t = timed_forward(p, start, stop);
      if (r >= kWarmup) ms.push_back(t);
    }
    const double median = median_of(ms);
    if (density == 0) dense_ms = median;
    const double visited = density > 0 ? double(bl.listed) / (double(h) * blocks * blocks) : 1.0;
    std::printf("sparse %d %d %.2f %.3f %.4f %.3f\n", d, s, density, visited, median, median / dense_ms);
    for (int* x : dev) cudaFree(x);
    cudaFree(ws);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using flashattn::detail::FwdParams;
  constexpr int kTokens = 16384, kModelDim = 2048, kSets = 2, kWarmup = 3, kRepeats = 15;
  const std::size_t elems = std::size_t(kTokens) * kModelDim;
  Buffers sets[kSets];
  for (Buffers& s : sets) {
    BENCH_CHECK(cudaMalloc(&s.q, elems * 2));
    BENCH_CHECK(cudaMalloc(&s.k, elems * 2));
    BENCH_CHECK(cudaMalloc(&s.v, elems * 2));
    BENCH_CHECK(cudaMalloc(&s.out, elems * 2));
    BENCH_CHECK(cudaMalloc(&s.lse, sizeof(float) * kTokens * 64));
    if (fp8_mode()) {
      BENCH_CHECK(cudaMalloc(&s.q8, elems));
      BENCH_CHECK(cudaMalloc(&s.k8, elems));
      BENCH_CHECK(cudaMalloc(&s.v8, elems));
      s.ws_bytes = elems + (std::size_t(64) << 20);  // V^T: 16k keys + 272 per sequence, per KV head and column
      BENCH_CHECK(cudaMalloc(&s.ws, s.ws_bytes));
    }
  }
  {
    std::uint32_t seed = 1;
    for (Buffers& s : sets)
      for (void* p : {s.q, s.k, s.v}) {
        const std::vector<std::uint16_t> host = random_bf16(elems, seed++ * 7919u);
        BENCH_CHECK(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice));
      }
    if (fp8_mode()) {
      for (Buffers& s : sets)
        for (void* p : {s.q8, s.k8, s.v8}) {
          const std::vector<std::uint8_t> host = random_e4m3(elems, seed++ * 7919u);
          BENCH_CHECK(cudaMemcpy(p, host.data(), elems, cudaMemcpyHostToDevice));
        }
      std::printf("# BENCH_FP8: e4m3 q, k, v, bf16 out (sm90 fp8 forward, V^T copy included)\n");
    }
  }
  float* sink = nullptr;  // BENCH_SINK: [64] logits of -1000 (heads <= 2048 / 64 = 32)
  if (std::getenv("BENCH_SINK") != nullptr) {
    const std::vector<float> host(64, -1000.0f);
    BENCH_CHECK(cudaMalloc(&sink, host.size() * sizeof(float)));
    BENCH_CHECK(cudaMemcpy(sink, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    std::printf("# BENCH_SINK: a learnable sink (-1000) on every call\n");
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));

  if (argc == 4 && std::string(argv[1]) == "--sparse") {
    return sparse_sweep(sets, std::atoi(argv[2]), std::atoi(argv[3]), start, stop);
  }
  FILE* csv = argc > 1 && std::string(argv[1]) != "-" ? std::fopen(argv[1], "w") : nullptr;
  std::vector<int> only_d;  // empty: every hdim
  if (argc > 4) {
    for (const char* c = argv[2]; *c != '\0';) {
      char* end = nullptr;
      const long x = std::strtol(c, &end, 10);
      if (end == c) break;
      if (x != 0) only_d.push_back(static_cast<int>(x));
      c = *end == ',' ? end + 1 : end;
    }
  }
  const int only_causal = argc > 4 ? std::atoi(argv[3]) : -1;
  const int only_s = argc > 4 ? std::atoi(argv[4]) : 0;
  if (csv) std::fprintf(csv, "hdim,causal,seqlen,batch,heads,ms,tflops\n");
  std::printf("%5s %6s %6s %5s %5s %9s %8s\n", "hdim", "causal", "seqlen", "batch", "heads", "ms",
              "TFLOP/s");
  std::vector<int> hdims = {64, 128, 256};
  if (flashattn::detail::cuda::supports_wide_head_dim(512)) hdims.push_back(512);
  for (int d : hdims) {
    for (int causal : {0, 1}) {
      for (int s : {512, 1024, 2048, 4096, 8192, 16384}) {
        if ((!only_d.empty() && std::find(only_d.begin(), only_d.end(), d) == only_d.end()) ||
            (only_causal >= 0 && causal != only_causal) || (only_s && s != only_s))
          continue;
        const int b = kTokens / s, h = kModelDim / d;
        FwdParams p;
        std::vector<float> ms;
        for (int r = 0; r < kWarmup + kRepeats; ++r) {
          p = grid_params(sets[r % kSets], b, h, d, s, causal != 0);
          p.sink = sink;
          const float t = timed_forward(p, start, stop);
          if (r >= kWarmup) ms.push_back(t);
        }
        const double median = median_of(ms);
#if FLASHATTN_WITH_SM90
        if (fp8_mode()) {  // the V^T copy alone (fp8_vt.cu), part of the time above
          std::vector<float> vt_ms;
          for (int r = 0; r < 10; ++r) {
            BENCH_CHECK(cudaEventRecord(start));
            flashattn::detail::cuda::sm90::transpose_v_fp8(p, p.workspace);
            BENCH_CHECK(cudaEventRecord(stop));
            BENCH_CHECK(cudaEventSynchronize(stop));
            float t = 0;
            BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
            vt_ms.push_back(t);
          }
          std::printf("# fp8 V^T copy %d %d %d: %.4f ms\n", d, causal, s, median_of(vt_ms));
        }
#endif
        const double flops = 4.0 * b * h * double(s) * s * d / (causal ? 2.0 : 1.0);
        const double tflops = flops / (median * 1e-3) / 1e12;
        // Checked on the last call's inputs (check_cell): relative error FAIL above 2e-2
        // (bf16 output rounding alone is ~4e-3); fp8: FAIL above its bound (ratio > 1).
        const double err = check_cell(sets[(kWarmup + kRepeats - 1) % kSets], b, h, d, s,
                                      causal != 0, p.scale);
        const bool f8 = fp8_mode();
        std::printf("%5d %6d %6d %5d %5d %9.4f %8.1f  %s %.2e %s\n", d, causal, s, b, h, median, tflops,
                    f8 ? "err/bound" : "relerr", err, err < (f8 ? 1.0 : 2e-2) ? "ok" : "FAIL");
        if (csv) std::fprintf(csv, "%d,%d,%d,%d,%d,%.5f,%.2f\n", d, causal, s, b, h, median, tflops);
      }
    }
  }
  if (csv) std::fclose(csv);
  return 0;
}
