// The CPU backward's task schedule (backward.cpp).
//
//   kKeyGroups  one task per (sequence, KV head): P and dS of each tile are computed once
//               and feed dV, dK and dQ (five products a tile); the row blocks of the KV
//               head's query heads and their dQ accumulators are held for the whole task
//               (memory per thread ~ h_q / h_k * seqlen_q * (head dims) * 12 bytes).
//   kTwoPasses  pass 1 per (sequence, KV head, key block) accumulates dK and dV, pass 2
//               per (sequence, query head, query block) dQ, and both recompute P and dS
//               (seven products a tile); more, smaller tasks.
// Both sum every gradient in the same order with the same kernels: the results are
// bit-identical, so the choice (from the shape and the thread count) never changes them.
// The backward uses kKeyGroups when there is no block-sparse mask, there are at least two
// key-group tasks per thread (or one thread) and the held rows fit kKeyGroupBytes; else
// kTwoPasses.
#pragma once

#include <cstddef>
#include <optional>

namespace flashattn::detail::cpu {

enum class BwdSchedule { kKeyGroups, kTwoPasses };

// The most bytes of row blocks and dQ accumulators a key-group task may hold per thread.
inline constexpr std::size_t kKeyGroupBytes = std::size_t(64) << 20;

// Tests: forces the schedule of later backward calls where it can run (kKeyGroups never
// runs with a block-sparse mask); std::nullopt: back to the automatic choice. Not for
// concurrent calls.
void set_backward_schedule_override(std::optional<BwdSchedule> schedule);

}  // namespace flashattn::detail::cpu
