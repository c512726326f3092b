// Tensor view helpers: element sizes and names, shape strings, view constructors.
#include "flashattn/tensor.hpp"

#include <limits>
#include <string>

#include "flashattn/error.hpp"

namespace flashattn {

std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kInt32: return "int32";
  }
  return "unknown";
}

std::string to_string(Device d) {
  if (d.type == DeviceType::kCPU) return "cpu";
  return "cuda:" + std::to_string(d.index);
}

std::int64_t Tensor::numel() const noexcept {
  if (rank <= 0) return 0;
  const int dims = rank < kMaxRank ? rank : kMaxRank;
  for (int i = 0; i < dims; ++i)
    if (shape[i] == 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < dims; ++i)
    if (__builtin_mul_overflow(n, shape[i], &n)) return std::numeric_limits<std::int64_t>::max();
  return n;
}

namespace {

void check_rank(const char* function, std::size_t rank) {
  if (rank < 1 || rank > static_cast<std::size_t>(kMaxRank)) {
    throw InvalidArgument(function, "shape", "rank in [1, " + std::to_string(kMaxRank) + "]",
                          "rank " + std::to_string(rank));
  }
}

}  // namespace

Tensor Tensor::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                          Device device) {
  check_rank("Tensor::contiguous", shape.size());
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  t.device = device;
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  std::int64_t stride = 1;
  for (int dim = t.rank - 1; dim >= 0; --dim) {
    t.stride[dim] = stride;
    stride *= t.shape[dim];
  }
  return t;
}

Tensor Tensor::strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       std::initializer_list<std::int64_t> stride, Device device) {
  check_rank("Tensor::strided", shape.size());
  if (stride.size() != shape.size()) {
    throw InvalidArgument("Tensor::strided", "stride",
                          std::to_string(shape.size()) + " strides (one per dimension)",
                          std::to_string(stride.size()));
  }
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  t.device = device;
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  i = 0;
  for (std::int64_t s : stride) t.stride[i++] = s;
  return t;
}

std::string shape_string(const Tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank && i < kMaxRank; ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(t.shape[i]);
  }
  return s + "]";
}

}  // namespace flashattn
