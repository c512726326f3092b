// flashattn public API: tensor views over caller-allocated memory.
//
// A Tensor is a non-owning view: a data pointer, an element type, a shape and
// strides counted in elements, and the device the memory lives on. The library
// never allocates or frees the memory a Tensor points to. The last dimension
// must be contiguous (stride 1); every other stride is free, so q, k and v may
// be slices of one packed qkv tensor. The byte offset of the highest element,
// sum((shape[i] - 1) * stride[i]) * element size, must stay below 2^63 and within the
// address space from data (a call with larger strides is an InvalidArgument).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace flashattn {

enum class DType : std::uint8_t {
  kFloat16,   // IEEE binary16
  kBFloat16,  // bfloat16
  kFloat32,   // CPU backend only
  kFloat64,   // CPU backend only (exact checks, finite differences)
  kFloat8E4M3,  // reserved: fp8 forward and fp8 KV cache come with the Hopper path
  kInt32,     // indices: cu_seqlens, block tables, cache lengths
};

// Size of one element in bytes.
std::size_t dtype_size(DType t) noexcept;
// "float16", "bfloat16", ...
const char* dtype_name(DType t) noexcept;

enum class DeviceType : std::uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; ignored for the CPU
  static constexpr Device cpu() { return {DeviceType::kCPU, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceType::kCUDA, i}; }
  friend constexpr bool operator==(Device a, Device b) {
    return a.type == b.type && (a.type == DeviceType::kCPU || a.index == b.index);
  }
};
std::string to_string(Device d);

inline constexpr int kMaxRank = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  std::int64_t shape[kMaxRank] = {0, 0, 0, 0};
  std::int64_t stride[kMaxRank] = {0, 0, 0, 0};  // in elements
  Device device = Device::cpu();

  // An absent optional argument is a default-constructed Tensor.
  bool defined() const noexcept { return rank > 0; }
  // The product of the sizes (0 when any is 0), saturated at INT64_MAX on overflow.
  std::int64_t numel() const noexcept;
  std::int64_t size(int dim) const noexcept { return shape[dim]; }

  // A row-major contiguous view.
  static Tensor contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                           Device device = Device::cpu());
  // A view with explicit strides (in elements).
  static Tensor strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                        std::initializer_list<std::int64_t> stride, Device device = Device::cpu());
};

// "[2, 128, 8, 64]"
std::string shape_string(const Tensor& t);

}  // namespace flashattn
