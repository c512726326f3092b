// The AVX-512 + AVX512_BF16 kernels of cpu/bf16_kernels.hpp. This translation unit alone is
// compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 (CMakeLists.txt), and
// includes no header with inline functions shared with the baseline units (an inline function
// compiled here could be the copy the linker keeps for every unit, and then run on a CPU
// without AVX-512): only <cstdint>, <immintrin.h> and the declarations.
#include "cpu/bf16_kernels.hpp"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// GCC 12's _mm512_setzero_* / _mm512_undefined_* report a false -Wmaybe-uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

namespace flashattn::detail::cpu::bf16x {
namespace {

// In-place transpose of 16 x 16 32-bit words: r[i] word k becomes r[k] word i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + k], 128-bit lane L: rows 4g .. 4g + 3 at column 4L + k.
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);       // column k
    r[4 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);   // column 4 + k
    r[8 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);   // column 8 + k
    r[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);  // column 12 + k
  }
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

template <int R>
inline void dot_strip(int pairs, const std::uint32_t* a, std::int64_t lda, const std::uint32_t* bp,
                      float* s, std::int64_t lds, bool accumulate) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = accumulate ? _mm512_loadu_ps(s + r * lds + 16 * x) : _mm512_setzero_ps();
  for (int c = 0; c < pairs; ++c) {
    const std::uint32_t* b = bp + std::int64_t(c) * kKeys;
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 16);
    const __m512i b2 = _mm512_loadu_si512(b + 32), b3 = _mm512_loadu_si512(b + 48);
    for (int r = 0; r < R; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a[r * lda + c]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], as_bh(av), as_bh(b0));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], as_bh(av), as_bh(b1));
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], as_bh(av), as_bh(b2));
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], as_bh(av), as_bh(b3));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) _mm512_storeu_ps(s + r * lds + 16 * x, acc[r][x]);
}

// acc[r][16 x ..] += P16[r] . vp over `pairs` key pairs, for NV vectors of 16 columns (row r
// of P16 at p16 + r * ldp16).
template <int R, int NV>
inline void pv_strip(int pairs, const std::uint32_t* p16, std::int64_t ldp16, const std::uint32_t* vp,
                     int ldw, float* acc, std::int64_t ldacc) {
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NV; ++x) a[r][x] = _mm512_loadu_ps(acc + r * ldacc + 16 * x);
  for (int c = 0; c < pairs; ++c) {
    __m512i b[NV];
    for (int x = 0; x < NV; ++x) b[x] = _mm512_loadu_si512(vp + std::int64_t(c) * ldw + 16 * x);
    for (int r = 0; r < R; ++r) {
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(p16[r * ldp16 + c]));
      for (int x = 0; x < NV; ++x) a[r][x] = _mm512_dpbf16_ps(a[r][x], as_bh(pv), as_bh(b[x]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < NV; ++x) _mm512_storeu_ps(acc + r * ldacc + 16 * x, a[r][x]);
}

template <int R>
inline void pv_cols(int pairs, const std::uint32_t* p16, std::int64_t ldp16, const std::uint32_t* vp,
                    int ldw, int cols, float* acc, std::int64_t ldacc) {
  int col = 0;
  for (; col + 64 <= cols; col += 64) pv_strip<R, 4>(pairs, p16, ldp16, vp + col, ldw, acc + col, ldacc);
  switch ((cols - col) / 16) {
    case 3: pv_strip<R, 3>(pairs, p16, ldp16, vp + col, ldw, acc + col, ldacc); break;
    case 2: pv_strip<R, 2>(pairs, p16, ldp16, vp + col, ldw, acc + col, ldacc); break;
    case 1: pv_strip<R, 1>(pairs, p16, ldp16, vp + col, ldw, acc + col, ldacc); break;
    default: break;
  }
}

template <int R>
inline void pv_rows(int pairs, const float* p, std::int64_t ldp, const std::uint32_t* vp, int ldw,
                    int cols, float* acc, std::int64_t ldacc) {
  // The R rows of P rounded to bf16 words (key 2c low, 2c + 1 high).
  alignas(64) std::uint32_t p16[R * (kKeys / 2)];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kKeys; c += 32) {
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + r * ldp + c + 16),
                                             _mm512_loadu_ps(p + r * ldp + c));
      _mm512_store_si512(p16 + r * (kKeys / 2) + c / 2, (__m512i)w);
    }
  pv_cols<R>(pairs, p16, kKeys / 2, vp, ldw, cols, acc, ldacc);
}

// Calls f(Rows<R>{}, r) over row blocks of 6, 4, 2 and 1 that cover [0, rows): the register
// blockings of the P V kernels. (A tag of this unit, not std::integral_constant: see above.)
template <int R>
struct Rows {
  static constexpr int value = R;
};
template <class F>
inline void by_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + 6 <= rows; r += 6) f(Rows<6>{}, r);
  for (; r + 4 <= rows; r += 4) f(Rows<4>{}, r);
  for (; r + 2 <= rows; r += 2) f(Rows<2>{}, r);
  for (; r < rows; ++r) f(Rows<1>{}, r);
}

}  // namespace

void pack_value_pairs(const std::uint16_t* const* rows, int n, int cols, std::uint32_t* dst,
                      int ldw) {
  alignas(64) static constexpr short kIdx[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i idx0 = _mm512_load_si512(kIdx[0]), idx1 = _mm512_load_si512(kIdx[1]);
  const int pairs = (n + 1) / 2;
  for (int c = 0; c < pairs; ++c) {
    const std::uint16_t* r0 = rows[2 * c];
    const std::uint16_t* r1 = 2 * c + 1 < n ? rows[2 * c + 1] : nullptr;
    std::uint32_t* out = dst + std::int64_t(c) * ldw;
    for (int col = 0; col < ldw; col += 32) {
      const int left = cols - col;
      const __mmask32 m = left >= 32 ? ~__mmask32(0) : left <= 0 ? __mmask32(0) : (__mmask32(1) << left) - 1;
      const __m512i lo = r0 ? _mm512_maskz_loadu_epi16(m, r0 + col) : _mm512_setzero_si512();
      const __m512i hi = r1 ? _mm512_maskz_loadu_epi16(m, r1 + col) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + col, _mm512_permutex2var_epi16(lo, idx0, hi));
      if (col + 16 < ldw) _mm512_storeu_si512(out + col + 16, _mm512_permutex2var_epi16(lo, idx1, hi));
    }
  }
}

void pv_block(int rows, int pairs, const float* p, std::int64_t ldp, const std::uint32_t* vp,
              int ldw, int cols, float* acc, std::int64_t ldacc) {
  by_row_blocks(rows, [&](auto R, int r) {
    pv_rows<decltype(R)::value>(pairs, p + r * ldp, ldp, vp, ldw, cols, acc + r * ldacc, ldacc);
  });
}

void pack_block(const std::uint16_t* const* rows, int n, int elems, std::uint32_t* dst) {
  const int pairs = (elems + 1) / 2;
  for (int c0 = 0; c0 < pairs; c0 += 16) {
    // bf16 elements 2 * c0 .. of each row, masked to the row's end (an odd elems reads a
    // zero high half).
    const int left = elems - 2 * c0;
    const __mmask32 m = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const int cols = pairs - c0 < 16 ? pairs - c0 : 16;
    for (int g = 0; g < kKeys; g += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int j = g + i;
        r[i] = (j < n && rows[j] != nullptr) ? _mm512_maskz_loadu_epi16(m, rows[j] + 2 * c0)
                                             : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int k = 0; k < cols; ++k)
        _mm512_storeu_si512(dst + std::int64_t(c0 + k) * kKeys + g, r[k]);
    }
  }
}

void dot_block(int rows, int pairs, const std::uint32_t* a, std::int64_t lda,
               const std::uint32_t* bp, float* s, std::int64_t lds, bool accumulate) {
  int r = 0;
  for (; r + 6 <= rows; r += 6) dot_strip<6>(pairs, a + r * lda, lda, bp, s + r * lds, lds, accumulate);
  for (; r + 4 <= rows; r += 4) dot_strip<4>(pairs, a + r * lda, lda, bp, s + r * lds, lds, accumulate);
  for (; r + 2 <= rows; r += 2) dot_strip<2>(pairs, a + r * lda, lda, bp, s + r * lds, lds, accumulate);
  for (; r < rows; ++r) dot_strip<1>(pairs, a + r * lda, lda, bp, s + r * lds, lds, accumulate);
}

void pv_block_words(int rows, int pairs, const std::uint32_t* a, std::int64_t lda,
                    const std::uint32_t* vp, int ldw, int cols, float* acc, std::int64_t ldacc) {
  by_row_blocks(rows, [&](auto R, int r) {
    pv_cols<decltype(R)::value>(pairs, a + r * lda, lda, vp, ldw, cols, acc + r * ldacc, ldacc);
  });
}

void pack_transposed_pairs(const std::uint16_t* const* rows, int n, int cols, std::uint32_t* dst) {
  // Up to 256 columns at a time: pack_value_pairs into [kKeys / 2][columns rounded to 16]
  // words, then 16 x 16 word transposes.
  constexpr int kChunk = 256;
  alignas(64) std::uint32_t tmp[(kKeys / 2) * kChunk];
  const std::uint16_t* part[kKeys];
  const int pairs = (n + 1) / 2;
  for (int base = 0; base < cols; base += kChunk) {
    const int width = cols - base < kChunk ? cols - base : kChunk;
    const int ldw = (width + 15) / 16 * 16;
    for (int j = 0; j < n; ++j) part[j] = rows[j] ? rows[j] + base : nullptr;
    pack_value_pairs(part, n, width, tmp, ldw);
    for (int c = pairs; c < kKeys / 2; ++c)
      for (int col = 0; col < ldw; ++col) tmp[c * ldw + col] = 0;
    for (int c0 = 0; c0 < kKeys / 2; c0 += 16)
      for (int col0 = 0; col0 < ldw; col0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(tmp + (c0 + i) * ldw + col0);
        transpose16(r);
        const int left = width - col0 < 16 ? width - col0 : 16;
        for (int k = 0; k < left; ++k)
          _mm512_storeu_si512(dst + std::int64_t(base + col0 + k) * (kKeys / 2) + c0, r[k]);
      }
  }
}

namespace {

// exp_nonpositive (cpu/tile.hpp) on 16 lanes: the same reduction and polynomial.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33f);
  const __m512 xc = _mm512_max_ps(lo, x);  // NaN stays NaN
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), result);
}

// Two rows of 16 fp32 values as 16 words (row a in the low half, b in the high half),
// rounded to bf16 (round to nearest even).
inline __m512i interleave_rows(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

}  // namespace

void softmax_grad_rows(int rows, float* s, float* ds, std::int64_t ld, float scale, const float* lse,
                       const float* delta, const int* lo, const int* hi) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __m512 zero = _mm512_setzero_ps();
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * ld;
    float* dsr = ds + r * ld;
    if (lse[r] == -__builtin_inff()) {
      for (int x = 0; x < kKeys; x += 16) {
        _mm512_storeu_ps(sr + x, zero);
        _mm512_storeu_ps(dsr + x, zero);
      }
      continue;
    }
    const __m512 l = _mm512_set1_ps(lse[r]), d = _mm512_set1_ps(delta[r]), sc = _mm512_set1_ps(scale);
    const __m512i b = _mm512_set1_epi32(lo[r]), e = _mm512_set1_epi32(hi[r]);
    for (int x = 0; x < kKeys; x += 16) {
      const __m512i j = _mm512_add_epi32(lanes, _mm512_set1_epi32(x));
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sr + x), sc);
      const __mmask16 visible = _mm512_cmpge_epi32_mask(j, b) & _mm512_cmplt_epi32_mask(j, e) &
                                _mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_UQ);
      const __m512 p = exp_nonpositive16(_mm512_min_ps(zero, _mm512_sub_ps(v, l)));
      const __m512 g = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dsr + x), d));
      _mm512_storeu_ps(sr + x, _mm512_maskz_mov_ps(visible, p));
      _mm512_storeu_ps(dsr + x, _mm512_maskz_mov_ps(visible, g));
    }
  }
}

void pack_probs(int rows, const float* p, const float* ds, std::int64_t ld, std::uint32_t* pt,
                std::uint32_t* dst, std::uint32_t* ds16) {
  const __m512 zero = _mm512_setzero_ps();
  for (int c = 0; c < (rows + 1) / 2; ++c) {
    const float* p0 = p + 2 * c * ld;
    const float* d0 = ds + 2 * c * ld;
    const bool second = 2 * c + 1 < rows;
    for (int x = 0; x < kKeys; x += 16) {
      const __m512 pa = _mm512_loadu_ps(p0 + x), pb = second ? _mm512_loadu_ps(p0 + ld + x) : zero;
      const __m512 da = _mm512_loadu_ps(d0 + x), db = second ? _mm512_loadu_ps(d0 + ld + x) : zero;
      _mm512_storeu_si512(pt + c * kKeys + x, interleave_rows(pa, pb));
      _mm512_storeu_si512(dst + c * kKeys + x, interleave_rows(da, db));
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int x = 0; x < kKeys; x += 32) {
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(ds + r * ld + x + 16), _mm512_loadu_ps(ds + r * ld + x));
      _mm512_storeu_si512(ds16 + r * (kKeys / 2) + x / 2, (__m512i)w);
    }
}

bool built() noexcept { return true; }

void widen(const std::uint16_t* src, int n, float* dst) {
  int c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
  }
  if (c < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src + c));
    _mm512_mask_storeu_ps(dst + c, m, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
  }
}

}  // namespace flashattn::detail::cpu::bf16x

#else  // a build without the AVX-512 flags: active_isa() never selects these

#include <cstdlib>

namespace flashattn::detail::cpu::bf16x {
bool built() noexcept { return false; }
void pack_block(const std::uint16_t* const*, int, int, std::uint32_t*) { std::abort(); }
void dot_block(int, int, const std::uint32_t*, std::int64_t, const std::uint32_t*, float*,
               std::int64_t, bool) {
  std::abort();
}
void pv_block_words(int, int, const std::uint32_t*, std::int64_t, const std::uint32_t*, int, int,
                    float*, std::int64_t) {
  std::abort();
}
void pack_transposed_pairs(const std::uint16_t* const*, int, int, std::uint32_t*) { std::abort(); }
void softmax_grad_rows(int, float*, float*, std::int64_t, float, const float*, const float*,
                       const int*, const int*) {
  std::abort();
}
void pack_probs(int, const float*, const float*, std::int64_t, std::uint32_t*, std::uint32_t*,
                std::uint32_t*) {
  std::abort();
}
void widen(const std::uint16_t*, int, float*) { std::abort(); }
void pack_value_pairs(const std::uint16_t* const*, int, int, std::uint32_t*, int) { std::abort(); }
void pv_block(int, int, const float*, std::int64_t, const std::uint32_t*, int, int, float*,
              std::int64_t) {
  std::abort();
}
}  // namespace flashattn::detail::cpu::bf16x

#endif
