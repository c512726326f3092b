// flashattn semantics: the function every backend computes, compiled for host and device.
//
// This header is the single definition of the rules that must agree bit for bit
// between the CPU backend, the CUDA kernels and the test oracle:
//   - which keys a query sees (the visibility rule, bottom-right aligned),
//   - the order of score operations (scale, softcap, ALiBi, mask, softmax),
//   - which probabilities dropout keeps (Philox4x32-10, a pure function of
//     (seed, offset, batch, head, i, j)),
//   - what a row that sees no key produces (out 0, lse -inf, gradients 0),
//   - how partial results over key splits merge (by log-sum-exp),
//   - the fp8 (e4m3) KV-cache format: decode, and the encode of the append,
//   - the draft-tree rule of speculative decoding (tree_mask bits),
//   - how NaN and inf propagate (comment only: the rule lives in the backends' softmax).
//   - the learnable sink: one logit per query head in every row's softmax denominator.
// docs/semantics.md states the same in prose. Nothing here allocates or throws.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FA_HD __host__ __device__ __forceinline__
#else
#define FA_HD inline
#endif

namespace flashattn::semantics {

// ------------------------------------------------------------------ visibility

// A resolved mask: window (left, right), -1 = unbounded on that side.
// causal means right = 0 (with any left).
struct Mask {
  int left = -1;
  int right = -1;

  FA_HD static Mask make(bool causal, int window_left, int window_right) {
    Mask m;
    m.left = window_left < 0 ? -1 : window_left;
    m.right = causal ? 0 : (window_right < 0 ? -1 : window_right);
    return m;
  }
  FA_HD bool unbounded() const { return left < 0 && right < 0; }
};

// Query i of a sequence with s_q queries and s_k keys sees key j when
//   i + s_k - s_q - left <= j <= i + s_k - s_q + right   and 0 <= j < s_k.
FA_HD bool key_visible(std::int64_t i, std::int64_t j, std::int64_t s_q, std::int64_t s_k,
                       Mask m) {
  if (j < 0 || j >= s_k) return false;
  const std::int64_t diag = i + s_k - s_q;
  if (m.left >= 0 && j < diag - m.left) return false;
  if (m.right >= 0 && j > diag + m.right) return false;
  return true;
}

// The visible keys of query i form one interval [begin, end); empty when begin >= end.
struct KeyRange {
  std::int64_t begin;
  std::int64_t end;
  FA_HD bool empty() const { return begin >= end; }
};

FA_HD KeyRange visible_keys(std::int64_t i, std::int64_t s_q, std::int64_t s_k, Mask m) {
  const std::int64_t diag = i + s_k - s_q;
  std::int64_t b = m.left >= 0 ? diag - m.left : 0;
  std::int64_t e = m.right >= 0 ? diag + m.right + 1 : s_k;
  if (b < 0) b = 0;
  if (e > s_k) e = s_k;
  return {b, e};
}

// The keys visible to any query of rows [i0, i1): the union of their intervals.
FA_HD KeyRange visible_keys_of_rows(std::int64_t i0, std::int64_t i1, std::int64_t s_q,
                                    std::int64_t s_k, Mask m) {
  KeyRange first = visible_keys(i0, s_q, s_k, m);
  KeyRange last = visible_keys(i1 - 1, s_q, s_k, m);
  KeyRange r{first.begin, last.end};
  if (r.begin < 0) r.begin = 0;
  if (r.end > s_k) r.end = s_k;
  return r;
}

// ------------------------------------------------------------------ draft tree

// Speculative decoding: the last s_q keys of a sequence are the draft tokens, key
// j = s_k - s_q + t being draft t. `row` holds the ceil(s_q / 32) mask words of query i;
// query i sees draft t only when bit t % 32 of row[t / 32] is set. Keys before the
// drafts (j < s_k - s_q) are not restricted. The rule is and-ed with key_visible.
FA_HD bool tree_draft_visible(const std::uint32_t* row, std::int64_t t) {
  return ((row[t >> 5] >> (t & 31)) & 1u) != 0u;
}
FA_HD bool tree_key_visible(const std::uint32_t* row, std::int64_t j, std::int64_t s_q,
                            std::int64_t s_k) {
  const std::int64_t t = j - (s_k - s_q);
  return t < 0 || tree_draft_visible(row, t);
}

// ------------------------------------------------------------------ block sparsity

// A block-sparse mask (Options::block_sparse) tiles the (query, key) plane of each
// (batch, head) into blocks of block_q x block_k elements: block (m, n) holds queries
// [m * block_q, min((m + 1) * block_q, s_q)) and keys [n * block_k, min((n + 1) * block_k,
// s_k)). Each block is skipped, partial or full (the lists mask_block_* and full_block_*).
// Query i sees key j only when j's block in i's row of blocks is listed, and then:
//   full:     always (no element rule: not even causal / window);
//   partial:  partial_element_visible below: the call's causal / window rule, widened to
//             the first prefix_keys keys of the sequence (prefix-LM, sink tokens), and
//             and-ed with equal document ids when the mask has them (packed documents).
// Without a block mask every block is partial with no prefix and no document ids, which
// is the plain visibility rule.
enum BlockKind : std::uint8_t { kBlockSkip = 0, kBlockPartial = 1, kBlockFull = 2 };

// The element rule of a partial block. prefix_keys <= 0 widens nothing; doc ids are
// compared only when has_docs.
FA_HD bool partial_element_visible(std::int64_t i, std::int64_t j, std::int64_t s_q,
                                   std::int64_t s_k, Mask m, std::int64_t prefix_keys,
                                   bool has_docs, int doc_q, int doc_k) {
  if (j < 0 || j >= s_k) return false;
  if (has_docs && doc_q != doc_k) return false;
  return j < prefix_keys || key_visible(i, j, s_q, s_k, m);
}

// Element (i, j) of a block-sparse call, given the kind of its block.
FA_HD bool block_sparse_visible(BlockKind kind, std::int64_t i, std::int64_t j, std::int64_t s_q,
                                std::int64_t s_k, Mask m, std::int64_t prefix_keys, bool has_docs,
                                int doc_q, int doc_k) {
  if (j < 0 || j >= s_k || i < 0 || i >= s_q) return false;
  if (kind == kBlockFull) return true;
  if (kind == kBlockPartial)
    return partial_element_visible(i, j, s_q, s_k, m, prefix_keys, has_docs, doc_q, doc_k);
  return false;
}

// ------------------------------------------------------------------ fp8 (e4m3)

// OCP FP8 E4M3 ("e4m3fn", torch.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3
// mantissa bits; no infinities; S.1111.111 (0x7F, 0xFF) is NaN; largest finite 448;
// subnormals m * 2^-9. An fp8 KV cache stores e4m3 bytes; the value of a cached
// element is e4m3_to_float(byte) * scale, scale an fp32 per (KV head) or per
// (cache block, KV head).
inline constexpr float kE4M3Max = 448.0f;

FA_HD float e4m3_bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}
FA_HD std::uint32_t e4m3_float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// Exact decode: every e4m3 value is an fp32 value.
FA_HD float e4m3_to_float(std::uint8_t x) {
  const std::uint32_t sign = std::uint32_t(x & 0x80u) << 24;
  const std::uint32_t e = (x >> 3) & 0xFu, m = x & 0x7u;
  if (e == 0xFu && m == 0x7u) return e4m3_bits_to_float(sign | 0x7FC00000u);  // NaN
  if (e == 0u) {
    const float v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9, exact
    return sign ? -v : v;
  }
  return e4m3_bits_to_float(sign | ((e + 120u) << 23) | (m << 20));
}

// Encode: round to nearest even; finite values beyond +-448 and +-inf saturate to
// +-448 (0x7E / 0xFE); NaN gives 0x7F. Matches cvt.rn.satfinite.e4m3x2.f32 except
// that the NaN is always the positive 0x7F.
FA_HD std::uint8_t float_to_e4m3(float f) {
  const std::uint32_t u = e4m3_float_to_bits(f);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7Fu;
  if (a >= 0x43E00000u) return static_cast<std::uint8_t>(sign | 0x7Eu);  // |f| >= 448
  if (a >= 0x3C800000u) {
    // |f| >= 2^-6 (normal e4m3): drop 20 mantissa bits with round to nearest even; a
    // carry into the exponent is the correct rounding, and |f| < 448 rounds to <= 0x7E.
    const std::uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    return static_cast<std::uint8_t>(sign | ((r >> 20) - (120u << 3)));
  }
  // Subnormal e4m3 (or zero): m = round(|f| * 2^9), m = 8 being the smallest normal.
  const std::int32_t exp = static_cast<std::int32_t>(a >> 23);  // biased fp32 exponent
  if (exp == 0) return static_cast<std::uint8_t>(sign);         // fp32 zero / subnormal
  const std::uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;       // |f| = sig * 2^(exp - 150)
  const std::int32_t shift = 141 - exp;                         // |f| * 2^9 = sig >> shift
  if (shift > 24) return static_cast<std::uint8_t>(sign);       // < 0.5
  std::uint32_t m = sig >> shift;
  const std::uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  return static_cast<std::uint8_t>(sign | m);
}

// The byte the append stores for x under `scale`: e4m3(x / scale) with the fp32
// (IEEE, round-to-nearest) quotient of x (converted to fp32) and scale.
FA_HD std::uint8_t quantize_e4m3(float x, float scale) { return float_to_e4m3(x / scale); }

// ------------------------------------------------------------------ scores

// The score of (i, j) from the raw dot product q_i . k_j, before masking:
//   scale, then softcap (softcap * tanh(x / softcap), off when softcap == 0),
//   then ALiBi (-slope * |i + s_k - s_q - j|, off when slope == 0).
FA_HD float alibi_bias(float slope, std::int64_t i, std::int64_t j, std::int64_t s_q,
                       std::int64_t s_k) {
  std::int64_t dist = i + s_k - s_q - j;
  if (dist < 0) dist = -dist;
  return -slope * static_cast<float>(dist);
}

template <typename T>
FA_HD T score(T dot, T scale, T softcap, T slope, std::int64_t i, std::int64_t j,
              std::int64_t s_q, std::int64_t s_k) {
  T x = dot * scale;
  if (softcap > T(0)) x = softcap * std::tanh(x / softcap);
  if (slope != T(0)) {
    std::int64_t dist = i + s_k - s_q - j;
    if (dist < 0) dist = -dist;
    x -= slope * static_cast<T>(dist);
  }
  return x;
}

// d score / d (scale * dot) for the softcap: 1 - tanh^2, written through the capped
// score itself (x_capped = softcap * tanh(.)), so the backward needs no second tanh.
template <typename T>
FA_HD T softcap_grad(T capped_without_bias, T softcap) {
  if (!(softcap > T(0))) return T(1);
  const T t = capped_without_bias / softcap;
  return T(1) - t * t;
}

// ------------------------------------------------------------------ empty rows

// A row that sees no key: output 0, lse -inf, and zero gradients. Never NaN.
FA_HD float empty_row_lse() { return -INFINITY; }

// ------------------------------------------------------------------ non-finite values

// docs/semantics.md, "Non-finite values": a NaN or +inf score at a visible key makes the
// row NaN (out in every column, lse); a -inf score is probability 0 (all -inf: an empty
// row); NaN in v reaches the columns of the rows that see the key; a masked score is
// replaced by -inf with a select, and a masked element's P and dS are 0 by a select. The
// backends implement it as: the running max skips NaN (fmax / std::max), the exponent
// base of a row with no finite score yet is 0 (exp(NaN - 0) = NaN keeps the NaN in the
// sum), and a row is empty when its sum is exactly 0 (a NaN sum is not 0).

// ------------------------------------------------------------------ learnable sink

// A learnable sink adds exp(sink) to a row's softmax denominator and nothing to its
// numerator. Given the row's lse over its visible keys (-inf when it sees none), the
// row's lse with the sink is log(exp(lse) + exp(sink)); the output normalised over the
// keys alone is rescaled by exp(lse - lse_with_sink) (0 for a row that sees no key: its
// output stays 0, its lse becomes the sink). A sink of -inf changes nothing.
template <typename T>
FA_HD T lse_with_sink(T lse, T sink) {
  if (sink == -T(INFINITY)) return lse;
  if (lse == -T(INFINITY)) return sink;
  const T m = lse > sink ? lse : sink;
  return m + std::log(std::exp(lse - m) + std::exp(sink - m));
}
template <typename T>
FA_HD T sink_rescale(T lse, T lse_total) {
  return lse == -T(INFINITY) ? T(0) : std::exp(lse - lse_total);
}
// The sink's share of row i's softmax, exp(sink - lse_i), and its gradient term: with
// D_i = rowsum(dout_i * out_i), d loss / d sink = -sum_i exp(sink - lse_i) * D_i (the sink
// carries no value, so its dP is 0 and dS_sink = P_sink * (0 - D_i)).
template <typename T>
FA_HD T sink_prob(T sink, T lse) {
  return sink == -T(INFINITY) ? T(0) : std::exp(sink - lse);
}

// ------------------------------------------------------------------ dropout

// Philox4x32-10 (Salmon et al., SC'11).
struct Philox4 {
  std::uint32_t x[4];
};

FA_HD std::uint32_t mulhi32(std::uint32_t a, std::uint32_t b) {
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32);
}

FA_HD Philox4 philox4x32_10(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                            std::uint32_t c3, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const std::uint32_t hi0 = mulhi32(kM0, c0), lo0 = kM0 * c0;
    const std::uint32_t hi1 = mulhi32(kM1, c2), lo1 = kM1 * c2;
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// Dropout keeps an element when its 32-bit random word r satisfies r >= threshold,
// threshold = floor(p * 2^32): probability 1 - p up to 2^-32. Kept values are scaled
// by 1 / (1 - p).
FA_HD std::uint32_t dropout_threshold(float p) {
  if (!(p > 0.0f)) return 0u;
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 4294967295u : static_cast<std::uint32_t>(t);
}

// The scale of kept values, 1 / (1 - p), in double: an fp32 computation rounds it once to
// fp32 (FwdParams / BwdParams::rp_dropout), an fp64 one uses it as is (an fp32 scale put
// an error of up to 2^-24 relative on every fp64 output and gradient under dropout).
FA_HD double dropout_keep_scale(float p) { return p > 0.0f ? 1.0 / (1.0 - static_cast<double>(p)) : 1.0; }

// One Philox call yields the random words of four elements:
//   rows i and i ^ 8 (same i >> 4 and i & 7), columns j and j ^ 1 (same j >> 1).
// This is the set one thread holds in an m16n8 tensor-core accumulator, so a
// kernel makes one call per four probabilities. The counter is
//   (j >> 1, (i >> 4) << 3 | (i & 7), batch * h_q + head, offset low word)
// and the key (seed low word, seed high word ^ offset high word).
struct DropoutRng {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  std::uint32_t threshold = 0;  // dropout_threshold(p); 0 = no dropout

  FA_HD Philox4 block(std::uint32_t bh, std::int64_t i, std::int64_t j) const {
    const std::uint32_t c0 = static_cast<std::uint32_t>(j >> 1);
    const std::uint32_t c1 = static_cast<std::uint32_t>(((i >> 4) << 3) | (i & 7));
    const std::uint32_t k0 = static_cast<std::uint32_t>(seed);
    const std::uint32_t k1 =
        static_cast<std::uint32_t>(seed >> 32) ^ static_cast<std::uint32_t>(offset >> 32);
    return philox4x32_10(c0, c1, bh, static_cast<std::uint32_t>(offset), k0, k1);
  }
  // Which of block()'s four words belongs to (i, j).
  FA_HD static int word(std::int64_t i, std::int64_t j) {
    return static_cast<int>(((i >> 3) & 1) * 2 + (j & 1));
  }
  // The keep decision for element (batch, head, i, j) with bh = batch * h_q + head.
  FA_HD bool keep(std::uint32_t bh, std::int64_t i, std::int64_t j) const {
    if (threshold == 0u) return true;
    const Philox4 r = block(bh, i, j);
    const int w = word(i, j);
    // A select chain rather than r.x[w]: a run-time index would put r in local memory.
    const std::uint32_t bits = w == 0 ? r.x[0] : w == 1 ? r.x[1] : w == 2 ? r.x[2] : r.x[3];
    return bits >= threshold;
  }
};

// ------------------------------------------------------------------ split merge

// Partial results over disjoint key splits s = 0..n-1, each (o_s, lse_s) normalised
// over its own keys, merge exactly:
//   lse = log(sum_s exp(lse_s)),   o = sum_s exp(lse_s - lse) * o_s.
// A split that saw no key has lse_s = -inf and weight 0; if all did, lse = -inf, o = 0.
// A NaN lse_s (a NaN row within that split) makes lse NaN and every weight NaN.
template <typename T>
FA_HD T merged_lse(const T* lse, int n, std::int64_t stride) {
  T m = -INFINITY;
  for (int s = 0; s < n; ++s) m = lse[s * stride] > m ? lse[s * stride] : m;  // skips NaN
  const T base = m == -INFINITY ? T(0) : m;  // exp(-inf - 0) = 0; a NaN lse_s stays NaN
  T sum = 0;
  for (int s = 0; s < n; ++s) sum += std::exp(lse[s * stride] - base);
  return sum == T(0) ? T(-INFINITY) : m + std::log(sum);
}

template <typename T>
FA_HD T merge_weight(T lse_s, T lse) {
  return lse_s == -INFINITY ? T(0) : std::exp(lse_s - lse);
}

}  // namespace flashattn::semantics
