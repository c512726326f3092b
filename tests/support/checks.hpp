// Assertions shared by the CPU and GPU suites: a backend's forward / backward results
// (already on the host, in the oracle's concatenated order — see reference.hpp and
// cases.hpp) against the fp64 oracle under the tolerance rule (compare.hpp), plus the
// exact rules: rows that see no key give out 0, lse -inf and dq 0; nothing is NaN.
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include "reference/reference.hpp"
#include "support/cases.hpp"
#include "support/compare.hpp"

namespace flashattn::test {

struct ForwardResults {
  std::vector<double> out;    // concat_out order
  std::vector<double> lse;    // concat_lse order
  std::vector<double> probs;  // concat_probs order; empty when not requested
};

struct BackwardResults {
  std::vector<double> dq, dk, dv;  // concat_dq / concat_dk / concat_dv order
  std::vector<double> dsink;       // [h_q] with a sink gradient, else empty
};

// Splits concatenated forward results back into per-sequence RefOutputs (for the naive backward).
std::vector<RefOutput> split_forward(const RefProblem& p, const ForwardResults& r);

// The oracle's and the naive's forward for p, computed once and reused.
struct ForwardExpectation {
  std::vector<RefOutput> ref, naive;
  static ForwardExpectation of(const RefProblem& p, DType dtype);
};

// Forward results against the oracle: out in dtype, lse (fp32) and, when given, probs.
// floor_ulps scales the rounding floor of out (compare.hpp); raise it only where the
// problem's conditioning demands it (logits of magnitude L move P by ~L ulp).
void expect_forward_matches(const RefProblem& p, DType dtype, const ForwardResults& got,
                            const ForwardExpectation* expectation = nullptr,
                            double floor_ulps = kDefaultFloorUlps);
// Backward results against the oracle; `forward` is what the backend's backward read
// (its own forward's out and lse), which the naive backward reads too.
void expect_backward_matches(const RefProblem& p, DType dtype, const ForwardResults& forward,
                             const BackwardResults& got);

// Split-KV runs against the num_splits = 1 run of the same problem: each within twice the
// tolerance rule's bound (out in dtype, lse in fp32), from the naive computation's error
// against the oracle, measured once per problem.
struct SplitAgreement {
  double naive_out_err = 0;
  ErrorStats naive_lse;
  static SplitAgreement of(const ForwardExpectation& expect);
  void expect_agrees(DType dtype, const ForwardResults& split, const ForwardResults& one) const;
};

// Runs copies of a KV-cache case (its unappended caches) at each of `splits` through `run`,
// which checks the run against `expect` and returns its results; every count but 1 must
// agree with the num_splits = 1 run (SplitAgreement), which `splits` lists first.
void expect_split_counts_agree(const KVCacheCase& base, const ForwardExpectation& expect, DType dtype,
                               std::initializer_list<int> splits,
                               const std::function<ForwardResults(KVCacheCase&)>& run);

ForwardResults forward_results(const DenseCase& c);
BackwardResults backward_results(const DenseCase& c);
ForwardResults forward_results(const VarlenCase& c);
BackwardResults backward_results(const VarlenCase& c);
ForwardResults forward_results(const KVCacheCase& c);

// The gradients of c's backward (run already): dk and dv fully written (and dq when
// `dq_written`: varlen packs with padding or seqused_q rows leave those dq rows to other
// checks), then against the oracle (expect_backward_matches). Returns them for more checks.
BackwardResults expect_backward_written_and_matching(const DenseCase& c, const RefProblem& p, DType dtype,
                                                     const ForwardResults& forward, bool dq_written = true);
BackwardResults expect_backward_written_and_matching(const VarlenCase& c, const RefProblem& p, DType dtype,
                                                     const ForwardResults& forward, bool dq_written = true);

// dq, dk, dv of c's backward (run here, after c's forward) against central differences
// (step 1e-5) of the loss sum(out * dout) of c's forward, each within 1e-6 * max(1, max
// |FD|) and not all zero. For small fp64 cases on the CPU backend (thousands of forwards).
void expect_gradients_match_central_differences(DenseCase& c);

// Runs a KV-cache case (host tensors: the CPU backend) on poisoned outputs and checks out /
// lse against the oracle and both caches bitwise against the expected append (new rows at
// cache_seqlens, the rest untouched). A throwing call is one failure and returns empty
// results. Returns out / lse, e.g. for split-KV comparisons.
ForwardResults run_and_check_kvcache(KVCacheCase& c, const ForwardExpectation* expectation = nullptr);

}  // namespace flashattn::test
