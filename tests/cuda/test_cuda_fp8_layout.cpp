// The fp8 forward's transposed copy of V (src/cuda/sm90/fwd.hpp, fp8_vt.cu), host-side (no
// GPU): every sequence's rows start 16-byte aligned, and its keys with the zeros that the
// kernel's key tiles read after them (up to a multiple of kFp8VtTile) stay inside the copy
// and never reach the next sequence's rows, for dense batches and varlen packs with empty
// and uneven sequences; the copy of a varlen pack is its packed keys plus a constant per
// sequence, not batch x max_seqlen_k.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/params.hpp"
#include "cuda/sm90/fwd.hpp"

namespace flashattn::test {
namespace {

using detail::FwdParams;
using detail::cuda::sm90::fp8_vt_row0;
using detail::cuda::sm90::fp8_vt_rows;
using detail::cuda::sm90::kFp8VtTile;

std::int64_t padded(std::int64_t keys) { return (keys + kFp8VtTile - 1) / kFp8VtTile * kFp8VtTile; }

// Checks the rows of sequences 0 .. batch - 1 with `len(b)` keys each.
template <class Len>
void expect_disjoint_rows(const FwdParams& p, Len len) {
  const std::int64_t rows = fp8_vt_rows(p);
  EXPECT_EQ(rows % 16, 0);
  std::int64_t prev_end = 0;
  for (int b = 0; b < p.batch; ++b) {
    const std::int64_t r0 = fp8_vt_row0(p, b);
    EXPECT_EQ(r0 % 16, 0) << "sequence " << b;
    EXPECT_GE(r0, prev_end) << "sequence " << b << " starts inside sequence " << b - 1 << "'s rows";
    prev_end = r0 + padded(len(b));
    EXPECT_LE(prev_end, rows) << "sequence " << b << " ends past the copy";
  }
}

TEST(CudaFp8Layout, DenseBatchesOwnDisjointAlignedRows) {
  for (int batch : {1, 2, 7, 32})
    for (int s : {1, 77, 128, 300, 1000, 16384}) {
      FwdParams p;
      p.batch = batch;
      p.seqlen_k = s;
      expect_disjoint_rows(p, [&](int) { return std::int64_t(s); });
      EXPECT_LE(fp8_vt_rows(p), std::int64_t(batch) * (s + kFp8VtTile + 16) + kFp8VtTile + 16);
    }
}

TEST(CudaFp8Layout, VarlenPacksOwnDisjointAlignedRows) {
  std::mt19937 rng(20261205);
  for (int trial = 0; trial < 200; ++trial) {
    const int batch = 1 + int(rng() % 9);
    std::vector<int> len(batch), cu(batch + 1, 0);
    for (int b = 0; b < batch; ++b) {
      len[b] = rng() % 4 == 0 ? 0 : int(rng() % 2000);
      cu[b + 1] = cu[b] + len[b];
    }
    FwdParams p;
    p.batch = batch;
    p.cu_seqlens_k = cu.data();
    p.total_k = cu[batch];
    p.seqlen_k = std::max(1, *std::max_element(len.begin(), len.end()));  // max_seqlen_k
    expect_disjoint_rows(p, [&](int b) { return std::int64_t(len[b]); });
    // Packed keys plus a constant per sequence: one long sequence among short ones costs its
    // own keys, not batch x its length.
    EXPECT_LE(fp8_vt_rows(p), std::int64_t(cu[batch]) + std::int64_t(batch) * (kFp8VtTile + 16) + kFp8VtTile + 16);
  }
}

}  // namespace
}  // namespace flashattn::test
