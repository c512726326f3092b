// The naive computation the main job compares against, and the few GPU services the
// main job needs (kept out of main.cpp so that it builds without CUDA).
#pragma once

#include <cstddef>
#include <functional>

#include "flashattn/tensor.hpp"

namespace bench {

// out = softmax(scale * Q K^T) V with S and P materialised for all heads at once,
// in fp32 (inputs converted from their storage type). Returns the bytes of S and P.
std::size_t naive_attention_cpu(const void* q, const void* k, const void* v, void* out,
                                flashattn::DType dt, int batch, int seqlen, int heads,
                                int head_dim, bool causal);

// GPU side (bench/gpu.cu when CUDA is built; otherwise these report no GPU).
bool gpu_built();
void* gpu_alloc(std::size_t bytes);  // nullptr when out of memory
void gpu_free(void* p);
void gpu_upload(void* dst, const void* src, std::size_t bytes);
void gpu_download(void* dst, const void* src, std::size_t bytes);
// Median time in milliseconds of fn() over `repeats` runs after a warm-up, by CUDA events.
double gpu_time_ms(const std::function<void()>& fn, int repeats);
// The naive computation on the GPU, as PyTorch's math path does it: cuBLAS batched GEMM
// for S (fp32), a row softmax writing P in the input type, cuBLAS GEMM for PV.
// Returns the bytes of S and P, or 0 when they could not be allocated.
std::size_t naive_attention_gpu(const void* q, const void* k, const void* v, void* out,
                                flashattn::DType dt, int batch, int seqlen, int heads,
                                int head_dim, bool causal);

}  // namespace bench
