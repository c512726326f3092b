// GPU services of the main job in a build without CUDA: there is no GPU to use.
#include <cstdio>
#include <cstdlib>

#include "naive.hpp"

namespace bench {
namespace {
[[noreturn]] void no_gpu() {
  std::fprintf(stderr, "this build has no CUDA backend\n");
  std::exit(1);
}
}  // namespace
bool gpu_built() { return false; }
void* gpu_alloc(std::size_t) { no_gpu(); }
void gpu_free(void*) {}
void gpu_upload(void*, const void*, std::size_t) { no_gpu(); }
void gpu_download(void*, const void*, std::size_t) { no_gpu(); }
double gpu_time_ms(const std::function<void()>&, int) { no_gpu(); }
std::size_t naive_attention_gpu(const void*, const void*, const void*, void*, flashattn::DType, int,
                                int, int, int, bool) {
  no_gpu();
}
}  // namespace bench
