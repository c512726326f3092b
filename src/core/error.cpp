#include "flashattn/error.hpp"

#include <utility>

namespace flashattn {

namespace {
std::string format_message(const std::string& function, const std::string& argument,
                           const std::string& expected, const std::string& actual) {
  return "flashattn::" + function + ": argument '" + argument + "': expected " + expected +
         ", got " + actual;
}
}  // namespace

InvalidArgument::InvalidArgument(std::string function, std::string argument, std::string expected,
                                 std::string actual)
    : Error(format_message(function, argument, expected, actual)),
      function_(std::move(function)),
      argument_(std::move(argument)),
      expected_(std::move(expected)),
      actual_(std::move(actual)) {}

}  // namespace flashattn
