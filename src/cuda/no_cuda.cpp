// The CUDA backend when the library is built without CUDA: it reports itself
// absent, and argument checking turns any CUDA call into a clear Unsupported error
// before reaching the entry points below.
#include "core/backend.hpp"
#include "flashattn/error.hpp"

namespace flashattn::detail::cuda {

namespace {
[[noreturn]] void not_built() {
  throw Unsupported("flashattn", "backend", "a library built with the CUDA backend",
                    "a build without CUDA (configure with FLASHATTN_CUDA=ON)");
}
}  // namespace

bool built() noexcept { return false; }
int device_count() noexcept { return 0; }
int compute_capability(int) noexcept { return 0; }
bool supports_head_dim(int) noexcept { return false; }
int head_dim_bucket(int) noexcept { return 0; }
bool supports_wide_head_dim(int) noexcept { return false; }
bool decode_fits(int, bool, int) noexcept { return false; }
bool kvcache_fits(int, bool, bool, int) noexcept { return false; }
bool decode_clusters_fit(int, int, bool, bool, int, int, int, int) noexcept { return false; }
void forward(const FwdParams&) { not_built(); }
std::size_t forward_workspace_size(const FwdParams&) { return 0; }
void backward(const BwdParams&) { not_built(); }
std::size_t backward_workspace_size(const BwdParams&) { return 0; }
void append_kv(const AppendParams&, AppendVerdict) { not_built(); }
bool copy_to_host_for_validation(void*, const void*, std::size_t, void*) { return false; }
AppendVerdict check_indices_on_device(const FwdParams&, IndexCall, int*) { return {}; }
bool fuse_row_checks(FwdParams&, IndexCall) { return false; }
CounterSpan split_counters(const FwdParams&) { return {}; }
std::size_t append_check_bytes(const FwdParams&) { return 0; }
std::size_t block_kinds_bytes(const FwdParams&) { return 0; }
void build_block_kinds(FwdParams&, std::uint8_t*, IndexCall) {}
void raise_index_error(int) {}
void prepare_index_checks(int, void*) {}
bool eager_index_checks_on_device() { return false; }
void set_index_check_path(IndexCheckPath) {}
void* alloc_async(std::size_t, void*) { not_built(); }
void free_async(void*, void*) {}

}  // namespace flashattn::detail::cuda
