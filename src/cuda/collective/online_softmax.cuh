// Online softmax over the key tiles of one query tile, in registers, on the m16n8
// accumulator layout: a thread holds, for each of its kMTiles 16-row tiles, rows g and
// g + 8 (g = lane / 4) at columns 2t, 2t + 1 (t = lane % 4) of every 8-column tile, so a
// row is spread over the 4 threads of a quad and reduced with two xor-shuffles.
//
// Scores arrive in any unit; `to_log2` turns them into log2 units (scale * log2(e) when
// the raw dot products come in, log2(e) when they are already scaled), so each
// probability is one FFMA and one ex2; to_log2 must be > 0. A row whose scores so far are
// all -inf keeps max -inf; its exponent base is taken as 0 so that exp2(-inf - base) = 0,
// never NaN. Non-finite scores (docs/semantics.md): fmaxf skips a NaN score, whose
// exp2 then makes the row's sum NaN; a +inf score makes exp2(inf - inf) = NaN; either way
// finalize gives NaN out and lse. The sum, once NaN, stays NaN (NaN * correction).
//
// A learnable sink (semantics.hpp) joins only at finalize(): one more term exp2(sink_log2)
// in each row's sum and max, outside the key loop, so the loop is the same with or
// without one.
#pragma once

#include <cmath>

#include "cuda/arch/sm80.cuh"

namespace flashattn::detail::cuda {

template <int kMTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows held per thread: (mt, half)
  float row_max[kRows];                      // max in score units (update_lazy: a reference <= it)
  float row_sum[kRows];                      // this thread's partial sum (quad-reduced at the end)

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  }

  __device__ __forceinline__ static float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  }
  __device__ __forceinline__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  }

  // Folds the tile s[kMTiles][kNTiles][4] into the running max and sum: rescales the
  // output accumulator o[kMTiles][kOTiles][4] and the sums by exp2(old max - new max)
  // and replaces s by the unnormalised probabilities exp2(s * to_log2 - max * to_log2).
  // The reference is always the true max; no branch, the fewest live registers.
  template <int kNTiles, int kOTiles>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4],
                                         float (&o)[kMTiles][kOTiles][4], float to_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        float m = row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          m = fmaxf(m, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        }
        m = quad_max(m);
        const float base = m == -INFINITY ? 0.0f : m * to_log2;
        // exp2(-inf) = 0 when the row had no visible key before: o and the sum are 0 then.
        const float correction = sm80::fast_exp2(row_max[r] * to_log2 - base);
        row_sum[r] *= correction;
#pragma unroll
        for (int ot = 0; ot < kOTiles; ++ot) {
          o[mt][ot][2 * half] *= correction;
          o[mt][ot][2 * half + 1] *= correction;
        }
        row_max[r] = m;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const float p0 = sm80::fast_exp2(s[mt][nt][2 * half] * to_log2 - base);
          const float p1 = sm80::fast_exp2(s[mt][nt][2 * half + 1] * to_log2 - base);
          s[mt][nt][2 * half] = p0;
          s[mt][nt][2 * half + 1] = p1;
          sum += p0 + p1;
        }
        row_sum[r] += sum;
      }
    }
  }

  // The reference max of a row moves only when the row's max exceeds it by more than
  // kRescaleLog2 (log2 units): probabilities are then at most 2^kRescaleLog2 = 256, far
  // inside fp32 / fp16 / bf16 range and with the same relative rounding as values <= 1,
  // and the sum and lse use the same reference, so the result is the same softmax. On
  // most tiles no row of a warp moves, and the rescale of o (one FMUL per accumulator
  // element, as many as the tile's MMAs) is skipped by a warp vote.
  static constexpr float kRescaleLog2 = 8.0f;

  // update_lazy folds the tile s[kMTiles][kNTiles][4] into the running reference max and
  // sum: where a row's reference moves, rescales its o[kMTiles][kOTiles][4] and sum by
  // exp2(old - new); replaces s by the unnormalised probabilities
  // exp2(s * to_log2 - reference * to_log2). The vote is warp-uniform: every lane of the
  // warp calls update_lazy() together.
  template <int kNTiles, int kOTiles>
  __device__ __forceinline__ void update_lazy(float (&s)[kMTiles][kNTiles][4],
                                              float (&o)[kMTiles][kOTiles][4], float to_log2) {
    float correction[kRows], base[kRows];
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        float m = row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          m = fmaxf(m, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        }
        m = quad_max(m);
        // -inf - -inf is NaN and compares false: a row that saw no key yet keeps -inf.
        // The first finite max moves the reference; o and the sum are 0 then.
        const bool move = (m - row_max[r]) * to_log2 > kRescaleLog2;
        const float old_base = row_max[r] * to_log2;
        if (move) row_max[r] = m;
        base[r] = row_max[r] == -INFINITY ? 0.0f : row_max[r] * to_log2;
        correction[r] = move ? sm80::fast_exp2(old_base - base[r]) : 1.0f;
        rescale = rescale || move;
        row_sum[r] *= correction[r];
      }
    }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][ot][e] *= correction[2 * mt + (e >> 1)];
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const float p0 = sm80::fast_exp2(s[mt][nt][2 * half] * to_log2 - base[r]);
          const float p1 = sm80::fast_exp2(s[mt][nt][2 * half + 1] * to_log2 - base[r]);
          s[mt][nt][2 * half] = p0;
          s[mt][nt][2 * half + 1] = p1;
          sum += p0 + p1;
        }
        row_sum[r] += sum;
      }
    }
  }

  // After the last tile: the full row sums, and per row the factor the output is
  // multiplied by (out_scale / sum, 0 for a row that saw no key) and the natural-log
  // lse (-inf for such a row). `to_natural` = ln(2) * to_log2 turns the max into score units.
  // sink_log2: the row's learnable sink in log2 units (sink * log2(e)), -inf for none; it
  // joins the max and the sum here (a row that saw no key: factor 0, lse = the sink).
  __device__ __forceinline__ void finalize(float out_scale, float to_log2, float (&inv)[kRows],
                                           float (&lse)[kRows], float sink_log2 = -INFINITY) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      // Empty means sum 0 only: a row whose scores were all NaN keeps max -inf (fmaxf skips
      // NaN) but has a NaN sum, and must give NaN out and lse, not the empty row's 0 / -inf.
      const bool empty = sum == 0.0f;
      if (sink_log2 != -INFINITY) {  // uniform: one sink per (block, head)
        // The base moves to max(row max, sink) so that neither term overflows. A NaN sum
        // stays NaN through keys and total (NaN out and lse).
        const float base = empty ? -INFINITY : row_max[r] * to_log2;
        const float top = fmaxf(base, sink_log2);
        const float keys = empty ? 0.0f : sum * sm80::fast_exp2(base - top);
        const float total = keys + sm80::fast_exp2(sink_log2 - top);
        inv[r] = empty ? 0.0f : out_scale * sm80::fast_exp2(base - top) / total;
        lse[r] = (top + log2f(total)) * 0.6931471805599453f;
        continue;
      }
      inv[r] = empty ? 0.0f : out_scale / sum;
      // lse = max (natural) + ln(sum) with max (natural) = max * to_log2 * ln 2
      lse[r] = empty ? -INFINITY : (row_max[r] * to_log2 + log2f(sum)) * 0.6931471805599453f;
    }
  }
};

}  // namespace flashattn::detail::cuda
