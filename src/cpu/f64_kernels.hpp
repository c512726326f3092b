// fp64 decode kernels of the kAvx512Bf16 path (cpu/isa.hpp) for fp32 tensors, defined in
// f64_avx512.cpp, which alone is compiled with the AVX-512 flags. Call them only when
// active_isa() == Isa::kAvx512Bf16 and built() (elsewhere they are not built: they abort).
//
// They read the fp32 key / value rows straight from the tensors (a pointer per key, as
// the forward's KvRowWalk finds them), widen them to fp64 in registers and multiply there:
// no converted copy of the block and no transpose through memory. Each result is the same
// chain of fp64 fused multiply-adds, in the same order, as the baseline path's gemm over
// the converted, transposed block (cpu/tile.hpp), so the results are bit-identical to the
// avx2 path (docs/semantics.md: fp32 inputs compute the same on both paths;
// tests/cpu/test_cpu_f64_decode.cpp).
#pragma once

#include <cstdint>

namespace flashattn::detail::cpu::f64x {

// Keys per block (= kBlockN) and the most query rows the kernels take.
inline constexpr int kKeys = 64;
inline constexpr int kMaxRows = 8;

// s[r * lds + j] = q[r * ldq + 0] k_j[0] + ... + q[r * ldq + d - 1] k_j[d - 1] in fp64, one
// fused multiply-add after another in order of c from 0 (the first onto +0), for r < rows
// (1 <= rows <= kMaxRows) and j < kKeys, where k_j = krows[j] (d fp32 values) for j < n and
// s = +0 for j >= n (as the baseline's zero-padded block gives).
void scores(int rows, int d, const double* q, std::int64_t ldq, const float* const* krows, int n,
            double* s, std::int64_t lds);

// acc[r * ldacc + c] = acc + p[r * ldp + 0] v_0[c] + ... + p[r * ldp + n - 1] v_{n-1}[c], one
// fused multiply-add after another in order of j, for r < rows (1 <= rows <= kMaxRows) and c
// < cols (a multiple of 8), where v_j = vrows[j] (dv fp32 values, taken as 0 from dv on).
void pv(int rows, int n, const double* p, std::int64_t ldp, const float* const* vrows, int dv,
        int cols, double* acc, std::int64_t ldacc);

// Whether this build compiled the kernels (x86-64 with a compiler that knows AVX-512).
bool built() noexcept;

}  // namespace flashattn::detail::cpu::f64x
