// bf16 dot-product kernels of the kAvx512Bf16 path (cpu/isa.hpp), defined in
// bf16_avx512.cpp, which alone is compiled with the AVX-512 flags. Call them only when
// active_isa() == Isa::kAvx512Bf16 (elsewhere they are not built: they throw).
//
// A "word" holds two consecutive bf16 values of a row (element 2c in the low half, 2c + 1 in
// the high half); vdpbf16ps multiplies two words lane by lane and adds both products to an
// fp32 accumulator. Every product of two bf16 values is exact in fp32; the kernels change the
// order of the fp32 sums, not what is summed (subnormal inputs and products are flushed to
// zero by the instruction: differences below 2^-126 per product).
#pragma once

#include <cstdint>

namespace flashattn::detail::cpu::bf16x {

// Keys per packed block (= kBlockN).
inline constexpr int kKeys = 64;

// Packs a block of key rows for dot_block: dst[c * kKeys + j] = word c of row j (c < pairs =
// (elems + 1) / 2), where rows[j] (j < n) points to `elems` bf16 values (an odd elems gets a
// zero high half in its last word; nullptr: a zero row); rows n .. kKeys are zero.
void pack_block(const std::uint16_t* const* rows, int n, int elems, std::uint32_t* dst);

// s[r * lds + j] (= or +=, accumulate) sum over c < pairs of the two products of
// a[r * lda + c] and bp[c * kKeys + j], for r < rows and j < kKeys, summed in fp32 in the same
// order for every row (a row's result does not depend on `rows`).
void dot_block(int rows, int pairs, const std::uint32_t* a, std::int64_t lda,
               const std::uint32_t* bp, float* s, std::int64_t lds, bool accumulate = false);

// Packs a block of value rows for pv_block: dst[c * ldw + col] holds (row 2c, row 2c + 1) at
// column col, for c < pairs = ceil(n / 2) and col < ldw (a multiple of 16, >= cols); rows[j]
// (j < n) points to `cols` bf16 values (nullptr: a zero row); row n of an odd n, and the
// columns from cols to ldw, are zero.
void pack_value_pairs(const std::uint16_t* const* rows, int n, int cols, std::uint32_t* dst,
                      int ldw);

// acc[r * ldacc + col] += sum over key pairs c < pairs of the two products of
// (bf16(p[r * ldp + 2c]), bf16(p[r * ldp + 2c + 1])) and vp[c * ldw + col], for r < rows and
// col < cols (a multiple of 16): P rounded to bf16 (round to nearest even), products exact,
// sums in fp32 in the same order for every row. p's rows have 2 * pairs readable entries.
void pv_block(int rows, int pairs, const float* p, std::int64_t ldp, const std::uint32_t* vp,
              int ldw, int cols, float* acc, std::int64_t ldacc);

// pv_block with the left-hand side already in words: acc[r * ldacc + col] += sum over c <
// pairs of the two products of a[r * lda + c] and vp[c * ldw + col].
void pv_block_words(int rows, int pairs, const std::uint32_t* a, std::int64_t lda,
                    const std::uint32_t* vp, int ldw, int cols, float* acc, std::int64_t ldacc);

// The transpose of pack_value_pairs for the left-hand side of dot_block: dst[col * (kKeys / 2)
// + c] = (row 2c, row 2c + 1) at column col, for col < cols and c < kKeys / 2 (n <= kKeys); rows
// from n on (and nullptr rows) are zero.
void pack_transposed_pairs(const std::uint16_t* const* rows, int n, int cols, std::uint32_t* dst);

// The backward's P and dS of `rows` query rows against kKeys keys, in place: s holds the
// raw dot products Q K^T and ds holds dP ([rows][ld]). For row r, key j with lo[r] <= j <
// hi[r] and x = scale * s != -inf: P = exp(min(x - lse[r], 0)) (exp_nonpositive of
// cpu/tile.hpp on 16 lanes), dS = P (dP - delta[r]); other keys, and every key of a row with
// lse = -inf, get P = dS = 0.
void softmax_grad_rows(int rows, float* s, float* ds, std::int64_t ld, float scale, const float* lse,
                       const float* delta, const int* lo, const int* hi);

// P and dS ([rows][ld] fp32, rows <= kKeys) rounded to bf16 (round to nearest even) as the
// operands of the backward's products: pt[c * kKeys + j] and dst[c * kKeys + j] = (row 2c,
// row 2c + 1) of P / dS at key j, for c < ceil(rows / 2) (row `rows` of an odd count: 0), and
// ds16[r * kKeys / 2 + c] = (key 2c, key 2c + 1) of dS row r.
void pack_probs(int rows, const float* p, const float* ds, std::int64_t ld, std::uint32_t* pt,
                std::uint32_t* dst, std::uint32_t* ds16);

// Whether this build compiled the kernels (x86-64 with a compiler that knows AVX512_BF16).
bool built() noexcept;

// dst[c] = src[c] as fp32 for c < n (bf16 widening, exact).
void widen(const std::uint16_t* src, int n, float* dst);

}  // namespace flashattn::detail::cpu::bf16x
