// Shape arithmetic, view checks and the owning host tensor.
#include "core/tensor.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/parallel_ranges.h"

namespace deltamoe {

Shape::Shape(std::initializer_list<int64_t> dims) {
  CHECK(dims.size() <= kMaxDims, "rank ", dims.size(), " exceeds ", kMaxDims);
  for (int64_t dim : dims) dims_[rank_++] = dim;
}

Shape::Shape(const std::vector<int64_t>& dims) {
  CHECK(dims.size() <= kMaxDims, "rank ", dims.size(), " exceeds ", kMaxDims);
  for (int64_t dim : dims) dims_[rank_++] = dim;
}

int Shape::normalise_axis(int axis) const {
  int resolved = axis < 0 ? axis + rank_ : axis;
  CHECK(resolved >= 0 && resolved < rank_, "axis ", axis, " out of range for rank ", rank_);
  return resolved;
}

int64_t Shape::numel() const {
  int64_t count = 1;
  for (int i = 0; i < rank_; ++i) count *= dims_[i];
  return count;
}

std::string Shape::str() const {
  std::ostringstream out;
  out << "[";
  for (int i = 0; i < rank_; ++i) out << (i ? ", " : "") << dims_[i];
  out << "]";
  return out.str();
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i) {
    if (dims_[i] != other.dims_[i]) return false;
  }
  return true;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides = shape;
  int64_t stride = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

TensorView::TensorView(void* data_, DType dtype_, Shape shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_), shape(shape_), strides(contiguous_strides(shape_)) {}

bool TensorView::is_contiguous() const { return strides == contiguous_strides(shape); }

void HostTensor::FreeDeleter::operator()(void* ptr) const { std::free(ptr); }
void HostTensor::UnmapDeleter::operator()(void* ptr) const { munmap(ptr, bytes); }

namespace {

// From this size a tensor takes its own anonymous mapping: pages the kernel gives zeroed, faulted in
// by whoever first writes them (often a conversion on every thread: parallel_ranges) instead of a
// zeroing pass here on one thread, and advised as transparent huge pages: 512 times fewer faults,
// which on a virtual machine cost ~10 us each at 4 KiB (a 2 GiB tensor took ~6 s to zero that way,
// ~0.2-3 s with huge pages, on this project's 2-core CI machine).
constexpr size_t kMappedTensorBytes = size_t{64} << 20;

}  // namespace

HostTensor::HostTensor(DType dtype, Shape shape) : dtype_(dtype), shape_(shape) {
  for (int i = 0; i < shape.rank(); ++i) CHECK(shape[i] >= 0, "negative dimension in ", shape.str());
  const size_t bytes = nbytes();
  if (bytes >= kMappedTensorBytes) {
    void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(ptr != MAP_FAILED, "out of host memory mapping ", bytes, " bytes for a ", shape.str(), " tensor: ",
          std::strerror(errno));
    (void)madvise(ptr, bytes, MADV_HUGEPAGE);  // advice only: where THP is off the pages stay 4 KiB
    buffer_ = std::shared_ptr<void>(ptr, UnmapDeleter{bytes});
    return;
  }
  size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  void* ptr = std::aligned_alloc(64, rounded);
  CHECK(ptr != nullptr, "out of host memory allocating ", bytes, " bytes");
  std::memset(ptr, 0, rounded);
  buffer_ = std::shared_ptr<void>(ptr, FreeDeleter());
}

HostTensor HostTensor::from_f32(const std::vector<float>& values, Shape shape) {
  CHECK(static_cast<int64_t>(values.size()) == shape.numel(), "from_f32: ", values.size(),
        " values for shape ", shape.str());
  HostTensor out(DType::f32, shape);
  std::memcpy(out.data(), values.data(), values.size() * sizeof(float));
  return out;
}

namespace {

double load_float(const void* src, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(src)[i];
    case DType::f64: return static_cast<const double*>(src)[i];
    case DType::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(src)[i]);
    case DType::f16: return f16_bits_to_float(static_cast<const uint16_t*>(src)[i]);
    default: RAISE("convert_floats: ", dtype_name(dtype), " is not a floating type");
  }
}

void store_float(void* dst, DType dtype, int64_t i, double value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(dst)[i] = static_cast<float>(value); return;
    case DType::f64: static_cast<double*>(dst)[i] = value; return;
    case DType::bf16:
      static_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(static_cast<float>(value));
      return;
    case DType::f16:
      static_cast<uint16_t*>(dst)[i] = float_to_f16_bits(static_cast<float>(value));
      return;
    default: RAISE("convert_floats: ", dtype_name(dtype), " is not a floating type");
  }
}

}  // namespace

void convert_floats(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t count) {
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, static_cast<size_t>(count) * dtype_size(src_dtype));
    return;
  }
  // The two conversions of checkpoint loading and saving, without the general path's switches.
  if (src_dtype == DType::bf16 && dst_dtype == DType::f32) {
    const auto* in = static_cast<const uint16_t*>(src);
    auto* out = static_cast<float*>(dst);
    for (int64_t i = count - 1; i >= 0; --i) out[i] = bf16_bits_to_float(in[i]);  // backwards: may widen in place
    return;
  }
  if (src_dtype == DType::f32 && dst_dtype == DType::bf16) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16_bits(in[i]);  // forwards: may narrow in place
    return;
  }
  for (int64_t i = 0; i < count; ++i) store_float(dst, dst_dtype, i, load_float(src, src_dtype, i));
}

HostTensor HostTensor::to_f32() const { return to_dtype(DType::f32); }

HostTensor HostTensor::to_dtype(DType dtype) const {
  HostTensor out(dtype, shape_);
  // Separate buffers: each range converts on its own thread.
  const size_t in_size = dtype_size(dtype_), out_size = dtype_size(dtype);
  parallel_ranges(numel(), int64_t{1} << 20, [&](int64_t begin, int64_t end) {
    convert_floats(static_cast<const uint8_t*>(data()) + begin * in_size, dtype_,
                   static_cast<uint8_t*>(out.data()) + begin * out_size, dtype, end - begin);
  });
  return out;
}

}  // namespace deltamoe
