// seqused_q (varlen): of sequence b's stored query rows, only the first seq_len_q(b) are
// computed by the kernels (every family reads the count from FwdParams / BwdParams). The
// rest are written here as rows that see no key, as the CPU backend writes them: out 0 and
// lse -inf in the forward (one small launch after the family's kernel, so that it holds
// whatever that kernel left in a tile's tail rows); the backward's dq conversion writes
// those rows' dq as 0 itself.
#pragma once

#include "core/params.hpp"

namespace flashattn::detail::cuda {

// No launch without seqused_q.
void write_unused_query_rows(const FwdParams& p);

}  // namespace flashattn::detail::cuda
