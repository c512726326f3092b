// The index guards of FwdParams (src/core/params.hpp; docs/semantics.md, "Index tensors
// checked on the device"): the clamps every kernel read of cu_seqlens, seqused_k,
// cache_seqlens, cache_batch_idx and block_table goes through, on bad and on valid values.
// (The GPU suite, tests/cuda/test_cuda_index_guards.cpp, runs them in the kernels, eagerly
// and under graph capture; the CPU API always checks the values first.)
#include <climits>
#include <vector>

#include <gtest/gtest.h>

#include "core/params.hpp"

namespace flashattn::test {
namespace {

using detail::FwdParams;

TEST(IndexGuards, VarlenRangesClampIntoThePackedTensors) {
  // total_q = 50, total_k = 60; sequence 1 decreasing, 2 past the end, 3 starting below 0.
  const std::vector<int> cu_q = {0, 20, 10, 70, 40}, cu_k = {-5, 30, 30, 100, 60};
  const std::vector<int> used = {-3, 0, 1000, 7};
  FwdParams p;
  p.batch = 4;
  p.cu_seqlens_q = cu_q.data();
  p.cu_seqlens_k = cu_k.data();
  p.total_q = 50;
  p.total_k = 60;
  p.seqlen_q = 50;  // max_seqlen_q / _k: no bound below the totals here
  p.seqlen_k = 60;
  p.q_row_stride = 8;
  p.o_row_stride = 16;
  p.lse_head_stride = 50;
  // Starts and lengths: [0, 20), [20, 20) (10 < 20: empty), [10, 50), [50, 50) (70 > 50).
  EXPECT_EQ(p.q_start(0), 0);
  EXPECT_EQ(p.seq_len_q(0), 20);
  EXPECT_EQ(p.q_start(1), 20);
  EXPECT_EQ(p.seq_len_q(1), 0);
  EXPECT_EQ(p.q_start(2), 10);
  EXPECT_EQ(p.seq_len_q(2), 40);
  EXPECT_EQ(p.q_start(3), 50);
  EXPECT_EQ(p.seq_len_q(3), 0);
  EXPECT_EQ(p.q_offset(2), 10 * 8);
  EXPECT_EQ(p.o_offset(3), 50 * 16);
  EXPECT_EQ(p.lse_offset(2, 1), 50 + 10);
  EXPECT_EQ(p.q_row0(3), 50);
  // Keys: [0, 30) (-5 -> 0), [30, 30), [30, 60) (100 -> 60), [60, 60).
  EXPECT_EQ(p.k_start(0), 0);
  EXPECT_EQ(p.stored_len_k(0), 30);
  EXPECT_EQ(p.stored_len_k(2), 30);
  EXPECT_EQ(p.k_start(3), 60);
  EXPECT_EQ(p.stored_len_k(3), 0);
  // Without seqused_k the keys are the stored ones; with it, clamped to them.
  EXPECT_EQ(p.seq_len_k(2), 30);
  p.seqused_k = used.data();
  EXPECT_EQ(p.seq_len_k(0), 0);   // -3
  EXPECT_EQ(p.seq_len_k(1), 0);
  EXPECT_EQ(p.seq_len_k(2), 30);  // 1000
  EXPECT_EQ(p.seq_len_k(3), 0);   // 7 of 0 stored
  p.k_row_stride = 4;
  EXPECT_EQ(p.k_offset(2, 5, 0), (30 + 5) * 4);
}

TEST(IndexGuards, CacheIndicesClampIntoTheCache) {
  const std::vector<int> lens = {-4, 10, 1000, INT_MAX};
  const std::vector<int> rows = {2, -1, 7, 0};
  FwdParams p;
  p.batch = 4;
  p.cache_seqlens = lens.data();
  p.seqlen_k_new = 2;
  p.kv_cache_rows = 3;
  p.kv_cache_len = 64;  // dense: s_cache
  p.cache_batch_idx = rows.data();
  EXPECT_EQ(p.cache_capacity(), 64);
  EXPECT_EQ(p.seq_len_k(0), 2);   // -4 -> 0, plus the 2 new keys
  EXPECT_EQ(p.seq_len_k(1), 12);
  EXPECT_EQ(p.seq_len_k(2), 64);  // 1000 -> 62 + 2
  EXPECT_EQ(p.seq_len_k(3), 64);
  EXPECT_EQ(p.cache_row(0), 2);
  EXPECT_EQ(p.cache_row(1), 0);
  EXPECT_EQ(p.cache_row(2), 2);
  p.k_batch_stride = 1000;
  p.k_row_stride = 10;
  EXPECT_EQ(p.k_offset(2, 5, 0), 2 * 1000 + 5 * 10);
  EXPECT_EQ(p.kv_block(1, 0), 0);

  // Paged: 5 blocks of 16 rows, 3 table entries per sequence (capacity 48).
  const std::vector<int> table = {4, -2, 1, 9, 0, 3, 2, 2, 2, 0, 1, 2};
  p.cache_batch_idx = nullptr;
  p.block_table = table.data();
  p.block_table_batch_stride = 3;
  p.block_table_max_blocks = 3;
  p.block_size = 16;
  p.kv_cache_rows = 5;
  p.kv_cache_len = 16;
  EXPECT_EQ(p.cache_capacity(), 48);
  EXPECT_EQ(p.seq_len_k(2), 48);  // 1000 -> 46 + 2
  EXPECT_EQ(p.block_id(0, 0), 4);
  EXPECT_EQ(p.block_id(0, 1), 0);  // -2
  EXPECT_EQ(p.block_id(1, 0), 4);  // 9
  EXPECT_EQ(p.kv_block(0, 17), 0);
  EXPECT_EQ(p.k_offset(1, 35, 0), 3 * 1000 + 3 * 10);  // block_table[1][2] = 3, row 3
}

// max_seqlen_q / _k bound each sequence (start <= b * max, length <= max), so that a captured
// call's rows stay inside the backward workspace laid out by them.
TEST(IndexGuards, VarlenRangesClampToMaxSeqlen) {
  // total_q = 100, max_seqlen_q = 10: sequence 0 claims 40 rows, sequence 1 starts at 60.
  const std::vector<int> cu = {0, 40, 70, 100};
  FwdParams p;
  p.batch = 3;
  p.cu_seqlens_q = cu.data();
  p.cu_seqlens_k = cu.data();
  p.total_q = p.total_k = 100;
  p.seqlen_q = 10;
  p.seqlen_k = 35;
  EXPECT_EQ(p.q_start(0), 0);
  EXPECT_EQ(p.seq_len_q(0), 10);
  EXPECT_EQ(p.q_start(1), 10);  // 40 > 1 * 10
  EXPECT_EQ(p.seq_len_q(1), 10);
  EXPECT_EQ(p.q_start(2), 20);
  EXPECT_EQ(p.seq_len_q(2), 10);
  for (int b = 0; b < 3; ++b) EXPECT_LE(p.q_start(b) + p.seq_len_q(b), (b + 1) * p.seqlen_q);
  EXPECT_EQ(p.k_start(1), 35);  // 40 > 1 * 35
  EXPECT_EQ(p.stored_len_k(1), 35);
  EXPECT_EQ(p.k_start(2), 70);
  EXPECT_EQ(p.stored_len_k(2), 30);
}

// Valid values pass unchanged: the eager (checked) calls compute what they did.
TEST(IndexGuards, ValidValuesPassUnchanged) {
  const std::vector<int> cu = {0, 5, 5, 12}, used = {5, 0, 7};
  FwdParams p;
  p.batch = 3;
  p.cu_seqlens_q = cu.data();
  p.cu_seqlens_k = cu.data();
  p.total_q = p.total_k = 12;
  p.seqlen_q = p.seqlen_k = 7;  // the longest sequence
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(p.q_start(b), cu[b]);
    EXPECT_EQ(p.seq_len_q(b), cu[b + 1] - cu[b]);
    EXPECT_EQ(p.seq_len_k(b), cu[b + 1] - cu[b]);
  }
  p.seqused_k = used.data();
  for (int b = 0; b < 3; ++b) EXPECT_EQ(p.seq_len_k(b), used[b]);
}

}  // namespace
}  // namespace flashattn::test
