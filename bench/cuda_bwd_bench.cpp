// Backward benchmark of the CUDA backend on the standard grid: bf16, batch * seqlen =
// 16384 tokens, model dim 2048 (heads = 2048 / hdim), hdim 64 / 128 / 256, causal and
// not, seqlen 512 .. 16k. FLOPs = 2.5 * 4 * b * h * s^2 * d (halved when causal).
// Timing: CUDA events around each call, 3 warm-up calls, median of 15; two input sets
// alternate so the 50 MB L2 does not hold a call's inputs from the previous one. The
// caller-given workspace keeps allocation out of the timing.
//
//   flashattn_cuda_bwd_bench            the grid, one line per cell: "bwd d causal s ms tflops"
//   flashattn_cuda_bwd_bench --one D C S one cell (hdim D, causal C, seqlen S); each may be a
//                                       comma list (--one 256,512 0,1 2048,8192: the cells of
//                                       their product, in one process)
//   ... --deterministic                 (last argument) the same in deterministic mode
//   flashattn_cuda_bwd_bench --memory   forward + backward at seqlen 128k (b 1, h 16, d 128):
//                                       the device memory the calls add beyond their tensors
//   flashattn_cuda_bwd_bench --sparse D S   block-sparse masks of 128 x 128 blocks (random
//                                       lists per head and query block, half of the listed
//                                       blocks full; the forward bench's generator) at
//                                       densities 10 / 50 / 100 %, against the same call
//                                       without a mask: one line each, "sparse-bwd d s density
//                                       visited ms ratio", all on the sm80 family (which runs
//                                       block-sparse masks; density 0.00: no mask)
// BENCH_SINK=1 (grid and --one): a learnable sink of -1000 per head and its gradient on
// every call (the sink's code paths and the d sink kernel run; the sink's share of the
// softmax is 0, so the check holds): the cost of a sink against the same grid without one.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "flashattn/half.hpp"
#include "block_lists.hpp"

namespace {

#define CHECK_CUDA(expr)                                                               \
  do {                                                                                 \
    const cudaError_t e_ = (expr);                                                     \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_));          \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

using flashattn::DType;
using flashattn::Tensor;

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

// Normal-ish values (sum of uniforms) in bf16, from a fixed LCG: reproducible inputs.
// Every cell of the grid has the same element count (16k tokens x model dim), so the host
// values of a seed are generated once and copied for each cell (generating them per cell
// took ~2 s of host time per cell).
void fill_random_bf16(void* dev, std::size_t n, std::uint64_t seed, float stddev) {
  static std::map<std::tuple<std::uint64_t, std::size_t, float>, std::vector<std::uint16_t>> cache;
  std::vector<std::uint16_t>& h = cache[{seed, n, stddev}];
  if (h.size() != n) {
    h.resize(n);
    std::uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (std::size_t i = 0; i < n; ++i) {
      float acc = 0.0f;
      for (int k = 0; k < 4; ++k) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        acc += static_cast<float>((s >> 40) & 0xffffff) / 16777216.0f - 0.5f;
      }
      h[i] = flashattn::float_to_bf16(acc * 1.7320508f * stddev);
    }
  }
  CHECK_CUDA(cudaMemcpy(dev, h.data(), n * 2, cudaMemcpyHostToDevice));
}

struct Problem {
  int b, s, h, d;
  Tensor q, k, v, out, dout, lse, dq, dk, dv;
  std::vector<void*> owned;

  Problem(int b_, int s_, int h_, int d_, std::uint64_t seed) : b(b_), s(s_), h(h_), d(d_) {
    const std::size_t n = std::size_t(b) * s * h * d;
    auto make = [&](bool random, std::uint64_t sd) {
      void* p = device_alloc(n * 2);
      owned.push_back(p);
      if (random) fill_random_bf16(p, n, sd, 1.0f);
      return Tensor::contiguous(p, DType::kBFloat16, {b, s, h, d}, flashattn::Device::cuda(0));
    };
    q = make(true, seed);
    k = make(true, seed + 1);
    v = make(true, seed + 2);
    dout = make(true, seed + 3);
    out = make(false, 0);
    dq = make(false, 0);
    dk = make(false, 0);
    dv = make(false, 0);
    void* l = device_alloc(std::size_t(b) * h * s * 4);
    owned.push_back(l);
    lse = Tensor::contiguous(l, DType::kFloat32, {b, h, s}, flashattn::Device::cuda(0));
  }
  ~Problem() {
    for (void* p : owned) cudaFree(p);
  }
};

// Correctness of one cell's gradients: dQ rows and dK / dV rows of (batch 0, head 0) and
// (last batch, last head) against fp64 sums over the same bf16 inputs and the forward's
// O and lse (natural log). Returns max |grad - ref| / max |ref| over the checked values.
double check_cell(const Problem& p, bool causal) {
  const int s = p.s, h = p.h, d = p.d;
  const double scale = 1.0 / std::sqrt(double(d));
  double worst = 0.0, ref_max = 0.0;
  for (int which = 0; which < 2; ++which) {
    const int bb = which ? p.b - 1 : 0, hh = which ? h - 1 : 0;
    auto fetch = [&](const Tensor& t) {  // [s, d] of (bb, hh) from [b, s, h, d]
      std::vector<std::uint16_t> x(std::size_t(s) * d);
      const char* src = static_cast<const char*>(t.data) + 2 * ((std::size_t(bb) * s * h + hh) * d);
      CHECK_CUDA(cudaMemcpy2D(x.data(), 2 * d, src, 2 * std::size_t(h) * d, 2 * d, s,
                              cudaMemcpyDeviceToHost));
      std::vector<double> y(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = flashattn::bf16_to_float(x[i]);
      return y;
    };
    const auto q = fetch(p.q), k = fetch(p.k), v = fetch(p.v), o = fetch(p.out),
               dout = fetch(p.dout), dq = fetch(p.dq), dk = fetch(p.dk), dv = fetch(p.dv);
    std::vector<float> lse(s);
    CHECK_CUDA(cudaMemcpy(lse.data(),
                          static_cast<const float*>(p.lse.data) + (std::size_t(bb) * h + hh) * s,
                          4 * std::size_t(s), cudaMemcpyDeviceToHost));
    auto dot = [&](const std::vector<double>& a, int i, const std::vector<double>& b2, int j) {
      double acc = 0;
      for (int c = 0; c < d; ++c) acc += a[std::size_t(i) * d + c] * b2[std::size_t(j) * d + c];
      return acc;
    };
    std::vector<double> D(s);
    for (int i = 0; i < s; ++i) D[i] = dot(dout, i, o, i);
    auto compare = [&](const std::vector<double>& ref, const std::vector<double>& got, int row) {
      for (int c = 0; c < d; ++c) {
        ref_max = std::max(ref_max, std::fabs(ref[c]));
        const double e = std::fabs(ref[c] - got[std::size_t(row) * d + c]);
        if (!(e <= worst)) worst = e;  // NaN propagates
      }
    };
    const int rows[] = {0, 1, s / 3, s / 2 + 7, s - 2, s - 1};
    for (int i : rows) {  // dQ_i = scale sum_j P_ij (dP_ij - D_i) K_j
      std::vector<double> ref(d, 0.0);
      for (int j = 0; j < (causal ? i + 1 : s); ++j) {
        const double pij = std::exp(scale * dot(q, i, k, j) - lse[i]);
        const double ds = pij * (dot(dout, i, v, j) - D[i]);
        for (int c = 0; c < d; ++c) ref[c] += scale * ds * k[std::size_t(j) * d + c];
      }
      compare(ref, dq, i);
    }
    for (int j : rows) {  // dK_j = scale sum_i dS_ij Q_i, dV_j = sum_i P_ij dO_i
      std::vector<double> rk(d, 0.0), rv(d, 0.0);
      for (int i = causal ? j : 0; i < s; ++i) {
        const double pij = std::exp(scale * dot(q, i, k, j) - lse[i]);
        const double ds = pij * (dot(dout, i, v, j) - D[i]);
        for (int c = 0; c < d; ++c) {
          rk[c] += scale * ds * q[std::size_t(i) * d + c];
          rv[c] += pij * dout[std::size_t(i) * d + c];
        }
      }
      compare(rk, dk, j);
      compare(rv, dv, j);
    }
  }
  return worst / std::max(ref_max, 1e-30);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The backward of one cell: 3 warm-up calls, then the median of 15 timed by CUDA events,
// alternating the two input sets (the last timed call runs on sets[0]).
template <class Call>
double time_backward(Call&& call, Problem (&sets)[2]) {
  for (int w = 0; w < 3; ++w) call(sets[w & 1]);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int r = 0; r < 15; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    call(sets[r & 1]);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(ms);
}

// --deterministic: the grid in deterministic mode (dQ added in key-tile order).
bool g_deterministic = false;

void run_grid(const std::vector<int>& dims, const std::vector<int>& causals,
              const std::vector<int>& lens) {
  std::printf("# ours: flashattn CUDA backward, bf16, 16k tokens, model dim 2048\n");
  std::printf("# bwd hdim causal seqlen ms tflops\n");
  for (int d : dims) {
    for (int causal : causals) {
      for (int s : lens) {
        const int b = 16384 / s, h = 2048 / d;
        Problem sets[2] = {Problem(b, s, h, d, 11), Problem(b, s, h, d, 23)};
        flashattn::Options opts;
        opts.causal = causal != 0;
        opts.deterministic = g_deterministic;
        void* sink_mem = nullptr;
        if (std::getenv("BENCH_SINK") != nullptr) {
          const std::vector<float> host(std::size_t(2) * h, -1000.0f);  // sink, then d sink
          sink_mem = device_alloc(host.size() * sizeof(float));
          CHECK_CUDA(cudaMemcpy(sink_mem, host.data(), host.size() * sizeof(float),
                                cudaMemcpyHostToDevice));
          const flashattn::Device dev = flashattn::Device::cuda(0);
          opts.learnable_sink =
              flashattn::Tensor::contiguous(sink_mem, flashattn::DType::kFloat32, {h}, dev);
          opts.learnable_sink_grad = flashattn::Tensor::contiguous(
              static_cast<float*>(sink_mem) + h, flashattn::DType::kFloat32, {h}, dev);
        }
        const std::size_t ws_bytes =
            flashattn::backward_workspace_size(sets[0].q, sets[0].k, sets[0].v, opts);
        void* ws = ws_bytes ? device_alloc(ws_bytes) : nullptr;
        try {
          for (Problem& p : sets) flashattn::forward(p.q, p.k, p.v, p.out, p.lse, opts);
        } catch (const flashattn::Error& e) {
          std::printf("# d %d causal %d s %d: forward failed (%s)\n", d, causal, s, e.what());
          if (ws) cudaFree(ws);
          if (sink_mem) cudaFree(sink_mem);
          continue;
        }
        CHECK_CUDA(cudaDeviceSynchronize());
        auto call = [&](Problem& p) {
          flashattn::backward(p.dout, p.q, p.k, p.v, p.out, p.lse, p.dq, p.dk, p.dv, opts,
                              flashattn::Workspace{ws, ws_bytes});
        };
        const double t = time_backward(call, sets);
        const double flops = 2.5 * 4.0 * b * h * double(s) * s * d / (causal ? 2.0 : 1.0);
        // The last timed call ran on sets[0] (r = 14); relative error FAIL above 2e-2.
        const double err = check_cell(sets[0], causal != 0);
        std::printf("bwd %d %d %d %.4f %.1f relerr %.2e %s\n", d, causal, s, t,
                    flops / (t * 1e-3) / 1e12, err, err < 2e-2 ? "ok" : "FAIL");
        std::fflush(stdout);
        if (ws) cudaFree(ws);
        if (sink_mem) cudaFree(sink_mem);
      }
    }
  }
}

// Forward + backward at seqlen 128k: the calls' own allocations (the backward's
// stream-ordered workspace) measured by the default pool's high-water mark, and the
// free device memory before the tensors, after them and after the calls.
void run_memory() {
  const int b = 1, s = 131072, h = 16, d = 128;
  std::size_t free0 = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free0, &total));
  Problem p(b, s, h, d, 5);
  std::size_t free1 = 0;
  CHECK_CUDA(cudaMemGetInfo(&free1, &total));
  cudaMemPool_t pool;
  CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, 0));
  std::uint64_t keep = UINT64_MAX;  // keep freed pool memory reserved so it can be measured
  CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  flashattn::Options opts;
  opts.causal = true;
  flashattn::forward(p.q, p.k, p.v, p.out, p.lse, opts);
  flashattn::backward(p.dout, p.q, p.k, p.v, p.out, p.lse, p.dq, p.dk, p.dv, opts);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::size_t free2 = 0;
  CHECK_CUDA(cudaMemGetInfo(&free2, &total));
  std::uint64_t high = 0;
  CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &high));
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double tensors = double(free0 - free1) / gib;
  std::printf("memory: seqlen %d, b %d, h %d, d %d, causal, bf16\n", s, b, h, d);
  std::printf("memory: tensors (q k v out dout dq dk dv lse) %.3f GiB\n", tensors);
  std::printf("memory: workspace high-water (stream-ordered pool) %.3f GiB\n", double(high) / gib);
  std::printf("memory: device memory in use after fwd+bwd beyond the tensors %.3f GiB\n",
              double(free1 - free2) / gib);
  std::printf("memory: peak fwd+bwd total %.3f GiB (a materialised S would be %.0f GiB)\n",
              tensors + double(high) / gib, double(s) * s * h * 2 / gib);
}

// --sparse: the backward's time against the density of a block mask (non-causal, bf16,
// 16k tokens, model dim 2048), on the sm80 family for every density, the dense call too.
void run_sparse(int d, int s) {
  constexpr int kBlock = 128;
  const int b = 16384 / s, h = 2048 / d, blocks = (s + kBlock - 1) / kBlock;
  const flashattn::Device dev = flashattn::Device::cuda(0);
  Problem sets[2] = {Problem(b, s, h, d, 11), Problem(b, s, h, d, 23)};
  double dense_ms = 0;
  for (double density : {0.0, 0.1, 0.5, 1.0}) {  // 0: no mask (the dense call)
    const RandomBlockLists bl = random_block_lists(h * blocks, blocks, density);
    flashattn::Options opts;
    opts.kernel_family = flashattn::KernelFamily::kSm80;
    std::vector<void*> lists;
    if (density > 0) {
      Tensor t[4];
      for (int l = 0; l < 2; ++l) {
        void* c = device_alloc(bl.cnt[l].size() * sizeof(int));
        void* x = device_alloc(bl.idx[l].size() * sizeof(int));
        lists.push_back(c);
        lists.push_back(x);
        CHECK_CUDA(cudaMemcpy(c, bl.cnt[l].data(), bl.cnt[l].size() * sizeof(int), cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(x, bl.idx[l].data(), bl.idx[l].size() * sizeof(int), cudaMemcpyHostToDevice));
        t[2 * l] = Tensor::contiguous(c, DType::kInt32, {1, h, blocks}, dev);
        t[2 * l + 1] = Tensor::contiguous(x, DType::kInt32, {1, h, blocks, blocks}, dev);
      }
      flashattn::BlockSparseTensors& bs = opts.block_sparse;
      bs.block_size_q = bs.block_size_k = kBlock;
      bs.mask_block_cnt = t[0];
      bs.mask_block_idx = t[1];
      bs.full_block_cnt = t[2];
      bs.full_block_idx = t[3];
    }
    const std::size_t ws_bytes = flashattn::backward_workspace_size(sets[0].q, sets[0].k, sets[0].v, opts);
    void* ws = ws_bytes ? device_alloc(ws_bytes) : nullptr;
    try {
      for (Problem& p : sets) flashattn::forward(p.q, p.k, p.v, p.out, p.lse, opts);
      auto call = [&](Problem& p) {
        flashattn::backward(p.dout, p.q, p.k, p.v, p.out, p.lse, p.dq, p.dk, p.dv, opts,
                            flashattn::Workspace{ws, ws_bytes});
      };
      const double t = time_backward(call, sets);
      if (density == 0) dense_ms = t;
      const double visited = density > 0 ? double(bl.listed) / (double(h) * blocks * blocks) : 1.0;
      std::printf("sparse-bwd %d %d %.2f %.3f %.4f %.3f\n", d, s, density, visited, t, t / dense_ms);
      std::fflush(stdout);
    } catch (const flashattn::Error& e) {
      std::printf("# sparse-bwd d %d s %d density %.2f: failed (%s)\n", d, s, density, e.what());
    }
    if (ws) cudaFree(ws);
    for (void* x : lists) cudaFree(x);
  }
}

}  // namespace

// "256,512" -> {256, 512}.
std::vector<int> int_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    v.push_back(static_cast<int>(std::strtol(p, &end, 10)));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p != '\0') break;  // not a number: stop
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[argc - 1], "--deterministic") == 0) {
    g_deterministic = true;
    --argc;
  }
  if (argc > 1 && std::strcmp(argv[1], "--memory") == 0) {
    run_memory();
  } else if (argc == 4 && std::strcmp(argv[1], "--sparse") == 0) {
    run_sparse(std::atoi(argv[2]), std::atoi(argv[3]));
  } else if (argc == 5 && std::strcmp(argv[1], "--one") == 0) {
    run_grid(int_list(argv[2]), int_list(argv[3]), int_list(argv[4]));
  } else {
    run_grid({64, 128, 256}, {0, 1}, {512, 1024, 2048, 4096, 8192, 16384});
  }
  return 0;
}
