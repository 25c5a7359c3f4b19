// Tensor views (a pointer with dtype, shape, strides and device) and an owning host tensor.
// Views never own memory; HostTensor owns an aligned host buffer and hands out views.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace deltamoe {

enum class Device : uint8_t { cpu, cuda };

constexpr int kMaxDims = 8;

// A small fixed-capacity list of dimension sizes (or strides, counted in elements).
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(const std::vector<int64_t>& dims);

  int rank() const { return rank_; }
  int64_t operator[](int axis) const { return dims_[normalise_axis(axis)]; }
  int64_t& operator[](int axis) { return dims_[normalise_axis(axis)]; }
  int64_t numel() const;
  std::vector<int64_t> to_vector() const { return {dims_.begin(), dims_.begin() + rank_}; }
  std::string str() const;  // "[2, 3, 4]"
  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }

 private:
  int normalise_axis(int axis) const;
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

// Row-major strides of a shape.
Shape contiguous_strides(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  Shape shape;
  Shape strides;  // in elements

  TensorView() = default;
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu);

  int rank() const { return shape.rank(); }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;

  // Typed pointer; CHECKs that T matches the dtype.
  template <typename T>
  T* as() const;
};

template <typename T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::f32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::f64; };
template <> struct DTypeOf<bf16> { static constexpr DType value = DType::bf16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::i32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::i64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::boolean; };

template <typename T>
T* TensorView::as() const {
  CHECK(dtype == DTypeOf<T>::value, "tensor holds ", dtype_name(dtype), ", accessed as ",
        dtype_name(DTypeOf<T>::value));
  return static_cast<T*>(data);
}

// An owning, 64-byte aligned, contiguous host tensor. Zero-initialised.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape);

  static HostTensor from_f32(const std::vector<float>& values, Shape shape);

  TensorView view() const { return TensorView(buffer_.get(), dtype_, shape_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  void* data() const { return buffer_.get(); }
  template <typename T>
  T* as() const {
    return view().as<T>();
  }
  bool empty() const { return buffer_ == nullptr; }

  // Converts any floating dtype to f32 (a new tensor), e.g. bf16 weights to the reference's f32.
  HostTensor to_f32() const;
  // Converts an f32 tensor to dtype with round-to-nearest-even.
  HostTensor to_dtype(DType dtype) const;

 private:
  struct FreeDeleter {
    void operator()(void* ptr) const;
  };
  struct UnmapDeleter {
    size_t bytes;
    void operator()(void* ptr) const;
  };
  std::shared_ptr<void> buffer_;
  DType dtype_ = DType::f32;
  Shape shape_;
};

// Element-wise conversion of n values between floating dtypes (f32, bf16, f16, f64); src and dst
// may be the same buffer.
void convert_floats(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t count);

}  // namespace deltamoe
