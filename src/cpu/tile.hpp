// CPU backend building blocks: element types, the thread-team helper, tile loads
// with conversion to the compute type, the block GEMM micro-kernel, a vectorisable
// exp, and the dropout keep mask of a tile.
//
// Every tile lives in a contiguous thread-local buffer of the compute type (fp32 for
// fp16 / bf16 tensors, fp64 for fp32 and fp64 tensors), so the GEMM loops run over
// unit-stride memory with compile-time widths and the compiler vectorises them (AVX2 + FMA).
#pragma once

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/params.hpp"
#include "flashattn/error.hpp"
#include "flashattn/half.hpp"
#include "flashattn/semantics.hpp"

namespace flashattn::detail::cpu {

// Query rows per block and keys per block. Key blocks start at multiples of
// kBlockN within each sequence (split chunks and the dK/dV pass rely on it).
inline constexpr int kBlockM = 64;
inline constexpr int kBlockN = 64;

// ------------------------------------------------------------------ exp

// exp(x) for x <= 0 (including -inf, which gives 0), written so that it
// vectorises (always inlined: a call would keep the caller's loop scalar): Cody-Waite reduction x = n ln2 + r, a degree-7 polynomial for e^r on
// |r| <= ln2/2 (Cephes' expf coefficients, about 1 ulp), and 2^n built from the
// exponent bits. Arguments below -87.33 (where e^x leaves the normal range) give 0.
#if defined(__GNUC__)
#define FLASHATTN_CPU_INLINE inline __attribute__((always_inline))
#else
#define FLASHATTN_CPU_INLINE inline
#endif

FLASHATTN_CPU_INLINE float exp_nonpositive(float x) {
  const float xc = x < -87.33f ? -87.33f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  const float result = y * std::bit_cast<float>(bits);
  return x < -87.33f ? 0.0f : result;
}

// exp(x) for x <= 0 in fp64, also vectorisable, for fp32 tensors (computed in fp64):
// x = n ln2 + r with n rounded by the 1.5 * 2^52 shift (n then sits in the low bits of
// the shifted value, so no fp64 -> int64 conversion is needed, which AVX2 lacks), ln2
// split in fdlibm's hi / lo parts, the degree-13 Taylor polynomial of e^r on
// |r| <= ln2/2 (within about 1 fp64 ulp of std::exp on [-708, 0]) and 2^n from the
// exponent bits. Arguments below -708 (where e^x leaves the normal range) give 0.
FLASHATTN_CPU_INLINE double exp_nonpositive_fp64(double x) {
  constexpr double kShift = 0x1.8p52;
  const double xc = x < -708.0 ? -708.0 : x;
  const double shifted = xc * 1.4426950408889634074 + kShift;
  const double n = shifted - kShift;
  double r = xc - n * 6.93147180369123816490e-01;
  r = r - n * 1.90821492927058770002e-10;
  double y = 1.0 / 6227020800.0;
  y = y * r + 1.0 / 479001600.0;
  y = y * r + 1.0 / 39916800.0;
  y = y * r + 1.0 / 3628800.0;
  y = y * r + 1.0 / 362880.0;
  y = y * r + 1.0 / 40320.0;
  y = y * r + 1.0 / 5040.0;
  y = y * r + 1.0 / 720.0;
  y = y * r + 1.0 / 120.0;
  y = y * r + 1.0 / 24.0;
  y = y * r + 1.0 / 6.0;
  y = y * r + 0.5;
  y = y * r * r + r + 1.0;
  // The low 12 bits of the shifted value's bits + 1023 are n + 1023 in [2, 1023].
  const std::uint64_t bits = (std::bit_cast<std::uint64_t>(shifted) + 1023u) << 52;
  const double result = y * std::bit_cast<double>(bits);
  return x < -708.0 ? 0.0 : result;
}


// ------------------------------------------------------------------ element types

template <DType kType>
struct Elem;

template <>
struct Elem<DType::kFloat16> {
  using storage = std::uint16_t;
  using compute = float;
  static float load(storage x) { return fp16_to_float(x); }
  static storage store(float x) { return float_to_fp16(x); }
  static float exp(float x) { return exp_nonpositive(x); }
};
template <>
struct Elem<DType::kBFloat16> {
  using storage = std::uint16_t;
  using compute = float;
  static float load(storage x) { return bf16_to_float(x); }
  static storage store(float x) { return float_to_bf16(x); }
  static float exp(float x) { return exp_nonpositive(x); }
};
// fp32 tensors compute in fp64: the sums of the score dot products, of P V and of the
// softmax denominator then add no error of their own, and the result is the exact
// attention rounded once to fp32 (to within a few fp64 ulps). In fp32 those sums are
// sequential over d and over the keys, and their error is several times that of a naive
// fp32 computation with pairwise sums (tests/python test_forward_low_precision_within_twice_naive).
template <>
struct Elem<DType::kFloat32> {
  using storage = float;
  using compute = double;
  static double load(storage x) { return x; }
  static storage store(double x) { return static_cast<float>(x); }
  static double exp(double x) { return exp_nonpositive_fp64(x); }
};
template <>
struct Elem<DType::kFloat64> {
  using storage = double;
  using compute = double;
  static double load(storage x) { return x; }
  static storage store(double x) { return x; }
  static double exp(double x) { return std::exp(x); }
};

// Calls f(Elem<t>{}) for the element type of t.
template <class F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat16: f(Elem<DType::kFloat16>{}); return;
    case DType::kBFloat16: f(Elem<DType::kBFloat16>{}); return;
    case DType::kFloat32: f(Elem<DType::kFloat32>{}); return;
    case DType::kFloat64: f(Elem<DType::kFloat64>{}); return;
    default: throw Error("cpu backend: unsupported dtype (expected float16, bfloat16, float32 or float64)");
  }
}

// ------------------------------------------------------------------ threads

// Team size of one call: p.num_threads when positive, else the OpenMP default.
inline int team_size(int num_threads) {
  return num_threads > 0 ? num_threads : omp_get_max_threads();
}

// ------------------------------------------------------------------ layout helpers

// Columns per GEMM micro-tile: two AVX2 registers of the compute type.
template <class T>
inline constexpr int kVecCols = 64 / static_cast<int>(sizeof(T));

inline constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Head dim padded to a whole number of micro-tile columns.
template <class T>
inline int padded_dim(int d) {
  return round_up(d, kVecCols<T>);
}

// One row of d storage elements to the compute type, zero-padded to `padded`.
template <class E>
inline void load_row(typename E::compute* dst, const typename E::storage* src, int d, int padded) {
  for (int c = 0; c < d; ++c) dst[c] = E::load(src[c]);
  for (int c = d; c < padded; ++c) dst[c] = 0;
}

// One row of d e4m3 bytes to T, each value e4m3 * scale, zero-padded to `padded`.
template <class T>
inline void load_row_e4m3(T* dst, const std::uint8_t* src, int d, int padded, T scale) {
  for (int c = 0; c < d; ++c) dst[c] = static_cast<T>(semantics::e4m3_to_float(src[c])) * scale;
  for (int c = d; c < padded; ++c) dst[c] = 0;
}

template <class E>
inline void store_row(typename E::storage* dst, const typename E::compute* src, int d,
                      typename E::compute factor) {
  for (int c = 0; c < d; ++c) dst[c] = E::store(src[c] * factor);
}

// ------------------------------------------------------------------ GEMM

// C[kRows][ncols] (=|+=) A[kRows][k] * B[k][ncols] for one strip of kRows rows;
// ncols is a multiple of kVecCols<T>. The kRows x kVecCols accumulator stays in
// registers while the k loop streams one B row and kRows A values per step.
template <class T, int kRows>
inline void gemm_strip(const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T* c,
                       std::int64_t ldc, int k, int ncols, bool accumulate) {
  constexpr int kW = kVecCols<T>;
  for (int j0 = 0; j0 < ncols; j0 += kW) {
    T acc[kRows][kW];
    for (int r = 0; r < kRows; ++r) {
#pragma omp simd
      for (int j = 0; j < kW; ++j) acc[r][j] = accumulate ? c[r * ldc + j0 + j] : T(0);
    }
    for (int kk = 0; kk < k; ++kk) {
      const T* brow = b + kk * ldb + j0;
      for (int r = 0; r < kRows; ++r) {
        const T av = a[r * lda + kk];
#pragma omp simd
        for (int j = 0; j < kW; ++j) acc[r][j] += av * brow[j];
      }
    }
    for (int r = 0; r < kRows; ++r) {
#pragma omp simd
      for (int j = 0; j < kW; ++j) c[r * ldc + j0 + j] = acc[r][j];
    }
  }
}

// C[rows][ncols] (=|+=) A[rows][k] * B[k][ncols], all row-major in the compute type.
template <class T>
inline void gemm(int rows, int k, int ncols, const T* a, std::int64_t lda, const T* b,
                 std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate) {
  int r = 0;
  // 6 x 2 accumulator registers plus one B row and one A broadcast fit the 16 AVX2
  // registers; each output element is summed over k in the same order in every strip.
  for (; r + 6 <= rows; r += 6)
    gemm_strip<T, 6>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k, ncols, accumulate);
  for (; r + 4 <= rows; r += 4)
    gemm_strip<T, 4>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k, ncols, accumulate);
  for (; r < rows; ++r)
    gemm_strip<T, 1>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, k, ncols, accumulate);
}

// One kW x kW block of the transpose below in AVX2 registers (8 x 8 floats or 4 x 4
// doubles); false when there is no such kernel for T (then the scalar loop runs).
template <class T>
inline bool transpose_block(const T* src, std::int64_t lds, T* dst, std::int64_t ldd) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, double>) {
    const __m256d r0 = _mm256_loadu_pd(src), r1 = _mm256_loadu_pd(src + lds);
    const __m256d r2 = _mm256_loadu_pd(src + 2 * lds), r3 = _mm256_loadu_pd(src + 3 * lds);
    const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
    const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
    _mm256_storeu_pd(dst, _mm256_permute2f128_pd(t0, t2, 0x20));
    _mm256_storeu_pd(dst + ldd, _mm256_permute2f128_pd(t1, t3, 0x20));
    _mm256_storeu_pd(dst + 2 * ldd, _mm256_permute2f128_pd(t0, t2, 0x31));
    _mm256_storeu_pd(dst + 3 * ldd, _mm256_permute2f128_pd(t1, t3, 0x31));
    return true;
  } else if constexpr (std::is_same_v<T, float>) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
    return true;
  }
#endif
  (void)src, (void)lds, (void)dst, (void)ldd;
  return false;
}

// Transpose src[rows][cols] (leading dim lds) into dst[cols][rows] (leading dim ldd):
// whole 32-byte blocks through transpose_block, the edges element by element. A copy,
// so the result does not depend on the path.
template <class T>
inline void transpose(const T* src, std::int64_t lds, int rows, int cols, T* dst,
                      std::int64_t ldd) {
  constexpr int kW = 32 / static_cast<int>(sizeof(T));
  int r0 = 0, c0 = 0;
  if (rows >= kW && cols >= kW && transpose_block<T>(src, lds, dst, ldd)) {
    r0 = rows / kW * kW;
    c0 = cols / kW * kW;
    for (int r = 0; r < r0; r += kW)
      for (int c = (r == 0 ? kW : 0); c < c0; c += kW)
        transpose_block<T>(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  }
  for (int r = 0; r < rows; ++r)
    for (int c = (r < r0 ? c0 : 0); c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// ------------------------------------------------------------------ dropout

// keep[r * ldk + j] = 1 or 0 for rows i0 + r (r < rows) and keys j0 + j (j < cols).
// One Philox call yields the words of rows i, i ^ 8 and keys j, j ^ 1 (see
// semantics::DropoutRng), so each call fills up to four entries; the result equals
// rng.keep(bh, i, j) element by element.
template <class T>
inline void dropout_keep_tile(const semantics::DropoutRng& rng, std::uint32_t bh, std::int64_t i0,
                              int rows, std::int64_t j0, int cols, T* keep, int ldk) {
  const std::int64_t i_end = i0 + rows, j_end = j0 + cols;
  for (int r = 0; r < rows; ++r) {
    const std::int64_t i = i0 + r;
    const bool high = ((i >> 3) & 1) != 0;
    if (high && i - 8 >= i0) continue;  // filled together with row i - 8
    const std::int64_t partner = high ? -1 : (i + 8 < i_end ? i + 8 : -1);
    for (std::int64_t j = j0 & ~std::int64_t(1); j < j_end; j += 2) {
      const semantics::Philox4 words = rng.block(bh, i, j);
      for (int dj = 0; dj < 2; ++dj) {
        const std::int64_t jj = j + dj;
        if (jj < j0 || jj >= j_end) continue;
        const std::uint32_t own = words.x[(high ? 2 : 0) + dj];
        keep[r * ldk + (jj - j0)] = own >= rng.threshold ? T(1) : T(0);
        if (partner >= 0)
          keep[(partner - i0) * ldk + (jj - j0)] = words.x[2 + dj] >= rng.threshold ? T(1) : T(0);
      }
    }
  }
}

// ------------------------------------------------------------------ scores

// Turns raw dot products s[0..kBlockN) of query i against keys j0 .. j0 + kBlockN into
// scores in semantics::score order (scale, softcap, ALiBi). When `capped` is given it
// receives the softcapped value before ALiBi (the backward's softcap_grad input).
// Keys outside [key_begin, key_end) become -inf.
template <class T>
inline void make_scores(T* s, T* capped, T scale, T softcap, T slope, std::int64_t i,
                        std::int64_t j0, std::int64_t s_q, std::int64_t s_k, bool masked,
                        std::int64_t key_begin, std::int64_t key_end) {
#pragma omp simd
  for (int j = 0; j < kBlockN; ++j) s[j] *= scale;
  if (softcap > T(0)) {
    for (int j = 0; j < kBlockN; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  }
  if (capped) {
#pragma omp simd
    for (int j = 0; j < kBlockN; ++j) capped[j] = s[j];
  }
  if (slope != T(0)) {
    const std::int64_t diag = i + s_k - s_q - j0;
#pragma omp simd
    for (int j = 0; j < kBlockN; ++j) {
      std::int64_t dist = diag - j;
      dist = dist < 0 ? -dist : dist;
      s[j] -= slope * static_cast<T>(dist);
    }
  }
  if (masked) {
    const std::int64_t lo = key_begin - j0, hi = key_end - j0;
#pragma omp simd
    for (int j = 0; j < kBlockN; ++j)
      s[j] = (j < lo || j >= hi) ? -static_cast<T>(INFINITY) : s[j];
  }
}

}  // namespace flashattn::detail::cpu
