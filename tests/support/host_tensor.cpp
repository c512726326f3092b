#include "support/host_tensor.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>

#include "flashattn/half.hpp"
#include "flashattn/semantics.hpp"

namespace flashattn::test {

namespace {
constexpr std::size_t kAlignment = 64;

std::size_t element_size(DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}
}  // namespace

double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::kFloat16: return fp16_to_float(float_to_fp16(static_cast<float>(x)));
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(static_cast<float>(x)));
    case DType::kFloat32: return static_cast<float>(x);
    case DType::kFloat64: return x;
    case DType::kInt32: return std::nearbyint(x);
    case DType::kFloat8E4M3: break;
  }
  throw std::invalid_argument("round_to: unsupported dtype");
}

double dtype_epsilon(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return std::ldexp(1.0, -10);
    case DType::kBFloat16: return std::ldexp(1.0, -7);
    case DType::kFloat32: return std::ldexp(1.0, -23);
    case DType::kFloat64: return std::ldexp(1.0, -52);
    default: break;
  }
  throw std::invalid_argument("dtype_epsilon: not a floating dtype");
}

void HostTensor::AlignedDelete::operator()(std::byte* p) const {
  ::operator delete[](p, std::align_val_t(kAlignment));
}

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  numel_ = 1;
  for (std::int64_t s : shape_) {
    if (s < 0) throw std::invalid_argument("HostTensor: negative extent");
    numel_ *= s;
  }
  bytes_ = static_cast<std::size_t>(numel_) * element_size(dtype_);
  // Never a null pointer, even for an empty tensor: the API may reject null data.
  const std::size_t alloc = bytes_ == 0 ? kAlignment : (bytes_ + kAlignment - 1) / kAlignment * kAlignment;
  data_.reset(static_cast<std::byte*>(::operator new[](alloc, std::align_val_t(kAlignment))));
  std::memset(data_.get(), 0, alloc);
}

HostTensor::HostTensor(const HostTensor& other) : dtype_(other.dtype_) {
  // A default-constructed (undefined) tensor copies as undefined: through the shape
  // constructor its empty shape made a one-element scalar, so a copied case's unset qv
  // looked set (VarlenCase::problem then read it as rows: the segfault of
  // CudaIndexGuards.VarlenOutOfRangeUnderCapture on the H100).
  if (!other.data_) return;
  *this = HostTensor(other.dtype_, other.shape_);
  if (bytes_) std::memcpy(data_.get(), other.data_.get(), bytes_);
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) {
    HostTensor copy(other);
    *this = std::move(copy);
  }
  return *this;
}

double HostTensor::get(std::int64_t i) const {
  const std::byte* p = data_.get();
  switch (dtype_) {
    case DType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return fp16_to_float(h);
    }
    case DType::kBFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_float(h);
    }
    case DType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DType::kFloat64: return reinterpret_cast<const double*>(p)[i];
    case DType::kInt32: return reinterpret_cast<const std::int32_t*>(p)[i];
    case DType::kFloat8E4M3: return semantics::e4m3_to_float(reinterpret_cast<const std::uint8_t*>(p)[i]);
  }
  throw std::invalid_argument("HostTensor::get: unsupported dtype");
}

void HostTensor::set(std::int64_t i, double value) {
  std::byte* p = data_.get();
  switch (dtype_) {
    case DType::kFloat16: {
      const std::uint16_t h = float_to_fp16(static_cast<float>(value));
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case DType::kBFloat16: {
      const std::uint16_t h = float_to_bf16(static_cast<float>(value));
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case DType::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(value); return;
    case DType::kFloat64: reinterpret_cast<double*>(p)[i] = value; return;
    case DType::kInt32: reinterpret_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(value); return;
    case DType::kFloat8E4M3:
      reinterpret_cast<std::uint8_t*>(p)[i] = semantics::float_to_e4m3(static_cast<float>(value));
      return;
  }
  throw std::invalid_argument("HostTensor::set: unsupported dtype");
}

std::int64_t HostTensor::index(std::initializer_list<std::int64_t> idx) const {
  if (idx.size() != shape_.size()) throw std::invalid_argument("HostTensor::index: rank mismatch");
  std::int64_t flat = 0;
  std::size_t dim = 0;
  for (std::int64_t v : idx) flat = flat * shape_[dim++] + v;
  return flat;
}

Tensor HostTensor::view() const { return view_on(const_cast<std::byte*>(data_.get()), Device::cpu()); }

Tensor HostTensor::view_on(void* device_data, Device device) const {
  Tensor t;
  t.data = device_data;
  t.dtype = dtype_;
  t.rank = static_cast<int>(shape_.size());
  t.device = device;
  std::int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.shape[d] = shape_[static_cast<std::size_t>(d)];
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

std::vector<double> HostTensor::to_double() const {
  std::vector<double> out(static_cast<std::size_t>(numel_));
  for (std::int64_t i = 0; i < numel_; ++i) out[static_cast<std::size_t>(i)] = get(i);
  return out;
}

void HostTensor::fill(double value) {
  for (std::int64_t i = 0; i < numel_; ++i) set(i, value);
}

void HostTensor::fill_nan() {
  if (dtype_ == DType::kInt32) throw std::invalid_argument("HostTensor::fill_nan: int32");
  if (dtype_ == DType::kFloat8E4M3) {
    // Both e4m3 NaNs, alternating: 0x7F and 0xFF.
    auto* p = reinterpret_cast<std::uint8_t*>(data_.get());
    for (std::int64_t i = 0; i < numel_; ++i) p[i] = (i & 1) ? 0xFF : 0x7F;
    return;
  }
  fill(std::numeric_limits<double>::quiet_NaN());
}

std::int64_t HostTensor::count_nan() const {
  if (dtype_ == DType::kInt32) return 0;
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < numel_; ++i) n += std::isnan(get(i)) ? 1 : 0;
  return n;
}

bool HostTensor::bitwise_equal(const HostTensor& other) const {
  return dtype_ == other.dtype_ && shape_ == other.shape_ &&
         (bytes_ == 0 || std::memcmp(data_.get(), other.data_.get(), bytes_) == 0);
}

HostTensor int_tensor(const std::vector<int>& values, std::vector<std::int64_t> shape) {
  if (shape.empty()) shape = {static_cast<std::int64_t>(values.size())};
  HostTensor t(DType::kInt32, std::move(shape));
  if (t.numel() != static_cast<std::int64_t>(values.size()))
    throw std::invalid_argument("int_tensor: size mismatch");
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int));
  return t;
}

HostTensor float_tensor(const std::vector<float>& values, std::vector<std::int64_t> shape) {
  if (shape.empty()) shape = {static_cast<std::int64_t>(values.size())};
  HostTensor t(DType::kFloat32, std::move(shape));
  if (t.numel() != static_cast<std::int64_t>(values.size()))
    throw std::invalid_argument("float_tensor: size mismatch");
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(float));
  return t;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace flashattn::test
