// Random block-sparse lists for the CUDA benches' density sweeps (`--sparse`): for each of
// `rows` (head, query block) rows, every key block is listed with probability `density`,
// half of them as partial blocks (list 0) and half as full ones (list 1), the same draw in
// the forward and backward benches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

struct RandomBlockLists {
  std::vector<int> cnt[2];  // [rows]
  std::vector<int> idx[2];  // [rows, blocks]
  long long listed = 0;     // listed blocks of both lists
};

inline RandomBlockLists random_block_lists(int rows, int blocks, double density) {
  RandomBlockLists r;
  for (int l = 0; l < 2; ++l) {
    r.cnt[l].assign(std::size_t(rows), 0);
    r.idx[l].assign(std::size_t(rows) * blocks, 0);
  }
  std::uint32_t state = 12345u;
  for (int row = 0; row < rows; ++row)
    for (int n = 0; n < blocks; ++n) {
      state ^= state << 13;
      state ^= state >> 17;
      state ^= state << 5;
      if (double(state % 100000u) / 100000.0 >= density) continue;
      const int l = (state >> 20) & 1;
      r.idx[l][std::size_t(row) * blocks + r.cnt[l][row]++] = n;
      ++r.listed;
    }
  return r;
}
