#include "support/describe.hpp"

#include <sstream>

namespace flashattn::test {

std::string describe(const Options& o) {
  std::ostringstream s;
  s << "scale=";
  if (o.softmax_scale) s << *o.softmax_scale;
  else s << "default";
  s << " causal=" << o.causal << " window=(" << o.window_left << ","
    << o.window_right << ") softcap=" << o.softcap << " alibi=" << (o.alibi_slopes.defined() ? "yes" : "no")
    << " sink=" << (o.learnable_sink.defined() ? "yes" : "no")
    << " dropout=" << o.dropout_p << " seed=" << o.seed << " offset=" << o.offset
    << " deterministic=" << o.deterministic << " threads=" << o.num_threads;
  return s.str();
}

}  // namespace flashattn::test
