// Host-side typed buffers for the tests: a contiguous, 64-byte aligned array of one
// flashattn dtype with a shape, element access through double, NaN poisoning and
// checks that a backend wrote every element. Free of CUDA: GPU tests copy device
// results into a HostTensor and use the same comparisons.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flashattn/tensor.hpp"

namespace flashattn::test {

// Round a double to the nearest value representable in `dtype` (fp16/bf16 via fp32,
// round to nearest even; int32 rounds to the nearest integer).
double round_to(DType dtype, double x);
// Unit in the last place at 1.0 for a floating dtype (fp16 2^-10, bf16 2^-7, ...).
double dtype_epsilon(DType dtype);

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t size(int dim) const { return shape_[static_cast<std::size_t>(dim)]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const { return numel_; }
  std::size_t bytes() const { return bytes_; }
  bool empty() const { return numel_ == 0; }
  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(data_.get()); }
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(data_.get()); }

  // Element at flat (row-major) index, converted to double / stored with rounding
  // (float8_e4m3: the e4m3 value itself, scale 1; set encodes float(value)).
  double get(std::int64_t flat) const;
  void set(std::int64_t flat, double value);
  // Flat index of a multi-index (row-major).
  std::int64_t index(std::initializer_list<std::int64_t> idx) const;
  double at(std::initializer_list<std::int64_t> idx) const { return get(index(idx)); }

  // A contiguous flashattn::Tensor view of this buffer (CPU device).
  Tensor view() const;
  // The same view on another device, for GPU tests whose device copy has this layout.
  Tensor view_on(void* device_data, Device device) const;

  std::vector<double> to_double() const;
  void fill(double value);
  void fill_nan();  // poison: every element becomes a quiet NaN (e4m3: 0x7F, 0xFF alternating)
  // Number of NaN elements (0 for int32).
  std::int64_t count_nan() const;
  // Bitwise equality of the stored bytes (NaN payloads included).
  bool bitwise_equal(const HostTensor& other) const;

 private:
  struct AlignedDelete {
    void operator()(std::byte* p) const;
  };
  DType dtype_ = DType::kFloat32;
  std::vector<std::int64_t> shape_;
  std::int64_t numel_ = 0;
  std::size_t bytes_ = 0;
  std::unique_ptr<std::byte[], AlignedDelete> data_;
};

// An int32 host tensor holding `values` with the given shape (default: 1-D).
HostTensor int_tensor(const std::vector<int>& values, std::vector<std::int64_t> shape = {});
// An fp32 host tensor holding `values` with the given shape (default: 1-D).
HostTensor float_tensor(const std::vector<float>& values, std::vector<std::int64_t> shape = {});

std::string shape_string(const std::vector<std::int64_t>& shape);

}  // namespace flashattn::test
