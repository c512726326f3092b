// TEMPORARY placeholder so the library links while the CPU backend is written.
// The CPU backend helper deletes this file when src/cpu/ implements core/backend.hpp.
#include "core/backend.hpp"
#include "flashattn/error.hpp"
namespace flashattn::detail::cpu {
void forward(const FwdParams&) { throw Error("cpu::forward not yet implemented"); }
std::size_t forward_workspace_size(const FwdParams&) { return 0; }
void backward(const BwdParams&) { throw Error("cpu::backward not yet implemented"); }
std::size_t backward_workspace_size(const BwdParams&) { return 0; }
void append_kv(const AppendParams&) { throw Error("cpu::append_kv not yet implemented"); }
}  // namespace flashattn::detail::cpu
