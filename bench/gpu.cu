// GPU services of the main job: memory, event timing and the naive computation
// (cuBLAS GEMMs around a materialised S and P, as an unfused framework computes it).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "naive.hpp"

namespace bench {
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS error %d in %s\n", int(s), what);
    std::exit(1);
  }
}

// One block per row of S: P = softmax(S row) in the storage type, causal keys beyond i dropped.
template <typename T>
__global__ void softmax_rows(const float* s, T* p, int seqlen, bool causal) {
  const long long row = blockIdx.x;
  const int i = int(row % seqlen);
  const float* in = s + row * seqlen;
  T* out = p + row * seqlen;
  const int kend = causal ? i + 1 : seqlen;
  __shared__ float red[32];
  float m = -INFINITY;
  for (int j = threadIdx.x; j < kend; j += blockDim.x) m = fmaxf(m, in[j]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = -INFINITY;
  for (int w = 0; w < int(blockDim.x / 32); ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  float sum = 0.0f;
  for (int j = threadIdx.x; j < kend; j += blockDim.x) sum += __expf(in[j] - m);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) sum += red[w];
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < seqlen; j += blockDim.x)
    out[j] = T(j < kend ? __expf(in[j] - m) * inv : 0.0f);
}

cublasHandle_t handle() {
  static cublasHandle_t h = [] {
    cublasHandle_t x;
    check(cublasCreate(&x), "cublasCreate");
    return x;
  }();
  return h;
}
}  // namespace

bool gpu_built() { return true; }

void* gpu_alloc(std::size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}
void gpu_free(void* p) { check(cudaFree(p), "cudaFree"); }
void gpu_upload(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload");
}
void gpu_download(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "download");
}

double gpu_time_ms(const std::function<void()>& fn, int repeats) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  fn();  // warm-up
  check(cudaDeviceSynchronize(), "warm-up");
  std::vector<float> t;
  for (int r = 0; r < repeats; ++r) {
    check(cudaEventRecord(a), "record");
    fn();
    check(cudaEventRecord(b), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(ms);
  }
  check(cudaGetLastError(), "timed work");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::size_t naive_attention_gpu(const void* q, const void* k, const void* v, void* out,
                                flashattn::DType dt, int batch, int seqlen, int heads,
                                int head_dim, bool causal) {
  const long long s = seqlen, h = heads, d = head_dim;
  const std::size_t s_bytes = std::size_t(batch) * h * s * s * sizeof(float);
  const std::size_t p_bytes = std::size_t(batch) * h * s * s * 2;
  float* sm = static_cast<float*>(gpu_alloc(s_bytes));
  void* pm = gpu_alloc(p_bytes);
  if (!sm || !pm) {
    if (sm) gpu_free(sm);
    if (pm) gpu_free(pm);
    return 0;
  }
  const cudaDataType_t ty = dt == flashattn::DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const float scale = 1.0f / std::sqrt(float(d)), one = 1.0f, zero = 0.0f;
  const std::size_t esz = 2;
  for (int b = 0; b < batch; ++b) {
    const char* qb = static_cast<const char*>(q) + std::size_t(b) * s * h * d * esz;
    const char* kb = static_cast<const char*>(k) + std::size_t(b) * s * h * d * esz;
    const char* vb = static_cast<const char*>(v) + std::size_t(b) * s * h * d * esz;
    char* ob = static_cast<char*>(out) + std::size_t(b) * s * h * d * esz;
    float* sb = sm + std::size_t(b) * h * s * s;
    char* pb = static_cast<char*>(pm) + std::size_t(b) * h * s * s * esz;
    // Column-major S^T (s x s) = K (s x d) * Q^T: row-major S[i][j] = q_i . k_j.
    check(cublasGemmStridedBatchedEx(handle(), CUBLAS_OP_T, CUBLAS_OP_N, int(s), int(s), int(d), &scale,
                                     kb, ty, int(h * d), d, qb, ty, int(h * d), d, &zero, sb, CUDA_R_32F,
                                     int(s), s * s, int(h), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "S = QK^T");
    if (ty == CUDA_R_16BF)
      softmax_rows<<<unsigned(h * s), 256>>>(sb, reinterpret_cast<__nv_bfloat16*>(pb), seqlen, causal);
    else
      softmax_rows<<<unsigned(h * s), 256>>>(sb, reinterpret_cast<__half*>(pb), seqlen, causal);
    check(cudaGetLastError(), "softmax");
    // Column-major O^T (d x s) = V^T (d x s) * P^T (s x s).
    check(cublasGemmStridedBatchedEx(handle(), CUBLAS_OP_N, CUBLAS_OP_N, int(d), int(s), int(s), &one,
                                     vb, ty, int(h * d), d, pb, ty, int(s), s * s, &zero, ob, ty,
                                     int(h * d), d, int(h), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "O = PV");
  }
  check(cudaDeviceSynchronize(), "naive");
  gpu_free(sm);
  gpu_free(pm);
  return s_bytes + p_bytes;
}

}  // namespace bench
