// flashattn public API: errors.
//
// Every rejected call throws before anything is written. The message names the
// argument, the expected value and the actual one, e.g.
//   flashattn::forward: argument 'k': expected shape[3] == 64 (head dim of q), got 32
#pragma once

#include <stdexcept>
#include <string>

namespace flashattn {

// Base class of everything the library throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An argument is malformed: wrong shape, dtype, stride, alignment, range or aliasing.
class InvalidArgument : public Error {
 public:
  InvalidArgument(std::string function, std::string argument, std::string expected,
                  std::string actual);
  const std::string& function() const noexcept { return function_; }
  const std::string& argument() const noexcept { return argument_; }
  const std::string& expected() const noexcept { return expected_; }
  const std::string& actual() const noexcept { return actual_; }

 private:
  std::string function_, argument_, expected_, actual_;
};

// The arguments are well formed but the chosen backend cannot run them
// (a head dim, dtype or feature it does not support, or a backend not built).
class Unsupported : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// The CUDA runtime reported an error while running a call.
class CudaError : public Error {
 public:
  using Error::Error;
};

}  // namespace flashattn
