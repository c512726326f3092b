// One-line descriptions of a test configuration, for SCOPED_TRACE.
#pragma once

#include <string>

#include "flashattn/attention.hpp"

namespace flashattn::test {

std::string describe(const Options& o);

}  // namespace flashattn::test
