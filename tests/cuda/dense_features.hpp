// The feature columns of the dense parameterized suites at head dims above 256
// (test_cuda_head_dim_512.cpp, the forward; test_cuda_backward_512.cpp, the backward): one
// row per case, and the random case a row describes.
#pragma once

#include <ostream>

#include "support/cases.hpp"

namespace flashattn::test {

struct DenseFeatures {
  const char* name;
  int b, s_q, s_k, h_q, h_k, d, d_v;
  bool causal;
  int left, right;
  float softcap;
  int alibi;  // 0 off, 1 slopes [h_q], 2 slopes [b, h_q]
  bool sink;
  float dropout;
};

inline void PrintTo(const DenseFeatures& f, std::ostream* os) { *os << f.name; }

// Random inputs of f's shape in dtype with f's options; the dropout seed and offset, the
// ALiBi slopes and the sink are drawn from rng in that order.
inline DenseCase dense_feature_case(Rng& rng, const DenseFeatures& f, DType dtype) {
  DenseCase c = DenseCase::random(rng, Shape{f.b, f.s_q, f.s_k, f.h_q, f.h_k, f.d, f.d_v}, dtype);
  c.opts.causal = f.causal;
  c.opts.window_left = f.left;
  c.opts.window_right = f.right;
  c.opts.softcap = f.softcap;
  c.opts.dropout_p = f.dropout;
  c.opts.seed = rng();
  c.opts.offset = rng();
  if (f.alibi) c.set_alibi(random_alibi(rng, f.b, f.h_q, f.alibi == 2), f.alibi == 2);
  if (f.sink) c.sink.set(random_sink(rng, f.h_q));
  return c;
}

}  // namespace flashattn::test
