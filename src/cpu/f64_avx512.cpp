// The AVX-512 fp64 decode kernels of cpu/f64_kernels.hpp. This translation unit alone is
// compiled with -mavx512f -mavx512vl -mavx512dq (CMakeLists.txt), and includes no header with
// inline functions shared with the baseline units (see bf16_avx512.cpp): only <cstdint>,
// <cstdlib>, <immintrin.h> and the declarations.
#include "cpu/f64_kernels.hpp"

#include <cstdlib>

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

// Loops over registers unrolled before GCC's scalar replacement, so that the accumulator
// arrays stay in registers (otherwise it stores them to the stack on every key).
#define FA_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define FA_UNROLL FA_PRAGMA(unroll)
#else
#define FA_UNROLL FA_PRAGMA(GCC unroll 16)
#endif

namespace flashattn::detail::cpu::f64x {
namespace {

inline __mmask8 lanes(int count) {
  return count >= 8 ? __mmask8(0xFF) : count <= 0 ? __mmask8(0) : __mmask8((1u << count) - 1);
}

// Eight key rows of eight fp32 values (dims c0 .. c0 + 8, `dims` of them read, the rest 0;
// keys with kmask 0 read nothing and are 0) widened to fp64 and transposed: x[c] holds dim c0
// + c of the eight keys.
inline void load_transposed(const float* const* rows, int c0, __mmask8 dmask, const __mmask8 kmask[8],
                            __m512d x[8]) {
  __m512d r[8];
  FA_UNROLL
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(dmask & kmask[i], rows[i] + c0));
  __m512d t[8], u[8];
  FA_UNROLL
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);      // dims 0 2 4 6 of keys i, i + 1
    t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]);  // dims 1 3 5 7
  }
  FA_UNROLL
  for (int g = 0; g < 8; g += 4) {
    u[g] = _mm512_shuffle_f64x2(t[g], t[g + 2], 0x88);      // dims 0, 4 of keys g .. g + 3
    u[g + 1] = _mm512_shuffle_f64x2(t[g], t[g + 2], 0xDD);  // dims 2, 6
    u[g + 2] = _mm512_shuffle_f64x2(t[g + 1], t[g + 3], 0x88);  // dims 1, 5
    u[g + 3] = _mm512_shuffle_f64x2(t[g + 1], t[g + 3], 0xDD);  // dims 3, 7
  }
  x[0] = _mm512_shuffle_f64x2(u[0], u[4], 0x88);
  x[4] = _mm512_shuffle_f64x2(u[0], u[4], 0xDD);
  x[2] = _mm512_shuffle_f64x2(u[1], u[5], 0x88);
  x[6] = _mm512_shuffle_f64x2(u[1], u[5], 0xDD);
  x[1] = _mm512_shuffle_f64x2(u[2], u[6], 0x88);
  x[5] = _mm512_shuffle_f64x2(u[2], u[6], 0xDD);
  x[3] = _mm512_shuffle_f64x2(u[3], u[7], 0x88);
  x[7] = _mm512_shuffle_f64x2(u[3], u[7], 0xDD);
}

// Scores of R rows against kG groups of 8 keys from key j0: one accumulator per (group,
// row), keys in lanes, the head dim walked in order.
template <int R, int kG>
inline void scores_groups(int d, const double* q, std::int64_t ldq, const float* const* krows, int n,
                          int j0, double* s, std::int64_t lds) {
  __m512d acc[kG][R];
  __mmask8 kmask[kG][8];
  const float* rows[kG][8];
  FA_UNROLL
  for (int g = 0; g < kG; ++g) {
    FA_UNROLL
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_pd();
    FA_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int j = j0 + 8 * g + i;
      kmask[g][i] = j < n ? __mmask8(0xFF) : __mmask8(0);
      rows[g][i] = j < n ? krows[j] : krows[0];
    }
  }
  for (int c0 = 0; c0 < d; c0 += 8) {
    const int dc = d - c0 < 8 ? d - c0 : 8;
    const __mmask8 dmask = lanes(dc);
    FA_UNROLL
    for (int g = 0; g < kG; ++g) {
      __m512d x[8];
      load_transposed(rows[g], c0, dmask, kmask[g], x);
      if (dc == 8) {
        FA_UNROLL
        for (int c = 0; c < 8; ++c)
          FA_UNROLL
          for (int r = 0; r < R; ++r)
            acc[g][r] = _mm512_fmadd_pd(_mm512_set1_pd(q[r * ldq + c0 + c]), x[c], acc[g][r]);
      } else {
        FA_UNROLL
        for (int c = 0; c < dc; ++c)
          FA_UNROLL
          for (int r = 0; r < R; ++r)
            acc[g][r] = _mm512_fmadd_pd(_mm512_set1_pd(q[r * ldq + c0 + c]), x[c], acc[g][r]);
      }
    }
  }
  FA_UNROLL
  for (int g = 0; g < kG; ++g)
    FA_UNROLL
    for (int r = 0; r < R; ++r) _mm512_storeu_pd(s + r * lds + j0 + 8 * g, acc[g][r]);
}

template <int R>
void scores_rows(int d, const double* q, std::int64_t ldq, const float* const* krows, int n,
                 double* s, std::int64_t lds) {
  constexpr int kG = R <= 4 ? 2 : 1;  // independent accumulators: at least 8 with few rows
  for (int j0 = 0; j0 < kKeys; j0 += 8 * kG) {
    if (j0 >= n) {  // whole groups past the block's keys: +0, as the zero-padded block gives
      FA_UNROLL
      for (int r = 0; r < R; ++r)
        FA_UNROLL
        for (int g = 0; g < kG; ++g) _mm512_storeu_pd(s + r * lds + j0 + 8 * g, _mm512_setzero_pd());
      continue;
    }
    scores_groups<R, kG>(d, q, ldq, krows, n, j0, s, lds);
  }
}

// P V for R rows on kX vectors of 8 columns from column c0.
template <int R, int kX>
inline void pv_columns(int n, const double* p, std::int64_t ldp, const float* const* vrows, int dv,
                       int c0, double* acc, std::int64_t ldacc) {
  __m512d a[R][kX];
  __mmask8 m[kX];
  FA_UNROLL
  for (int x = 0; x < kX; ++x) m[x] = lanes(dv - (c0 + 8 * x));
  FA_UNROLL
  for (int r = 0; r < R; ++r)
    FA_UNROLL
    for (int x = 0; x < kX; ++x) a[r][x] = _mm512_loadu_pd(acc + r * ldacc + c0 + 8 * x);
  for (int j = 0; j < n; ++j) {
    const float* v = vrows[j] + c0;
    __m512d vx[kX];
    FA_UNROLL
    for (int x = 0; x < kX; ++x) vx[x] = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m[x], v + 8 * x));
    FA_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512d pr = _mm512_set1_pd(p[r * ldp + j]);
      FA_UNROLL
      for (int x = 0; x < kX; ++x) a[r][x] = _mm512_fmadd_pd(pr, vx[x], a[r][x]);
    }
  }
  FA_UNROLL
  for (int r = 0; r < R; ++r)
    FA_UNROLL
    for (int x = 0; x < kX; ++x) _mm512_storeu_pd(acc + r * ldacc + c0 + 8 * x, a[r][x]);
}

template <int R>
void pv_rows(int n, const double* p, std::int64_t ldp, const float* const* vrows, int dv, int cols,
             double* acc, std::int64_t ldacc) {
  constexpr int kX = R <= 4 ? 4 : 2;  // R * kX accumulators of 32
  int c0 = 0;
  for (; c0 + 8 * kX <= cols; c0 += 8 * kX) pv_columns<R, kX>(n, p, ldp, vrows, dv, c0, acc, ldacc);
  for (; c0 < cols; c0 += 8) pv_columns<R, 1>(n, p, ldp, vrows, dv, c0, acc, ldacc);
}

}  // namespace

bool built() noexcept { return true; }

void scores(int rows, int d, const double* q, std::int64_t ldq, const float* const* krows, int n,
            double* s, std::int64_t lds) {
  switch (rows) {
    case 1: scores_rows<1>(d, q, ldq, krows, n, s, lds); return;
    case 2: scores_rows<2>(d, q, ldq, krows, n, s, lds); return;
    case 3: scores_rows<3>(d, q, ldq, krows, n, s, lds); return;
    case 4: scores_rows<4>(d, q, ldq, krows, n, s, lds); return;
    case 5: scores_rows<5>(d, q, ldq, krows, n, s, lds); return;
    case 6: scores_rows<6>(d, q, ldq, krows, n, s, lds); return;
    case 7: scores_rows<7>(d, q, ldq, krows, n, s, lds); return;
    case 8: scores_rows<8>(d, q, ldq, krows, n, s, lds); return;
    default: std::abort();
  }
}

void pv(int rows, int n, const double* p, std::int64_t ldp, const float* const* vrows, int dv,
        int cols, double* acc, std::int64_t ldacc) {
  switch (rows) {
    case 1: pv_rows<1>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 2: pv_rows<2>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 3: pv_rows<3>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 4: pv_rows<4>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 5: pv_rows<5>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 6: pv_rows<6>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 7: pv_rows<7>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    case 8: pv_rows<8>(n, p, ldp, vrows, dv, cols, acc, ldacc); return;
    default: std::abort();
  }
}

}  // namespace flashattn::detail::cpu::f64x

#else  // no AVX-512 here: stubs (never called: active_isa() is then kAvx2)

namespace flashattn::detail::cpu::f64x {
bool built() noexcept { return false; }
void scores(int, int, const double*, std::int64_t, const float* const*, int, double*, std::int64_t) {
  std::abort();
}
void pv(int, int, const double*, std::int64_t, const float* const*, int, int, double*, std::int64_t) {
  std::abort();
}
}  // namespace flashattn::detail::cpu::f64x

#endif
