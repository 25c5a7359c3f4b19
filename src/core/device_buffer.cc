// Device allocations and host<->device copies. Without CUDA every entry point explains itself.
#include "core/device_buffer.h"

#include <cstring>

#include "core/device_alloc.h"

#ifdef DELTAMOE_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace deltamoe {

#ifdef DELTAMOE_WITH_CUDA

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  data_ = device_malloc(bytes == 0 ? 256 : bytes, "device buffer");
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);  // NOTE: unchecked in a destructor on purpose
}

DeviceTensor device_tensor(DType dtype, Shape shape) {
  DeviceTensor out;
  out.buffer = DeviceBuffer(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  out.view = TensorView(out.buffer.data(), dtype, shape, Device::cuda);
  return out;
}

DeviceTensor to_device(const HostTensor& host, DType dtype) {
  HostTensor converted = host.dtype() == dtype ? host : host.to_dtype(dtype);
  DeviceTensor out = device_tensor(dtype, host.shape());
  CUDA_CHECK(cudaMemcpy(out.buffer.data(), converted.data(), converted.nbytes(), cudaMemcpyHostToDevice));
  return out;
}

HostTensor to_host(const TensorView& device_view) {
  CHECK(device_view.device == Device::cuda, "to_host: the view is not on the device");
  CHECK(device_view.is_contiguous(), "to_host: the view is not contiguous");
  HostTensor out(device_view.dtype, device_view.shape);
  CUDA_CHECK(cudaMemcpy(out.data(), device_view.data, out.nbytes(), cudaMemcpyDeviceToHost));
  return out;
}

void device_fill_bytes(const TensorView& device_view, int byte_value) {
  CUDA_CHECK(cudaMemset(device_view.data, byte_value, device_view.nbytes()));
}

void device_synchronize() { CUDA_CHECK(cudaDeviceSynchronize()); }

#else

namespace {
[[noreturn]] void no_cuda() { RAISE("this deltamoe was built without CUDA (cpu preset); rebuild with the default preset"); }
}  // namespace

DeviceBuffer::DeviceBuffer(size_t) { no_cuda(); }
DeviceBuffer::~DeviceBuffer() = default;
DeviceTensor device_tensor(DType, Shape) { no_cuda(); }
DeviceTensor to_device(const HostTensor&, DType) { no_cuda(); }
HostTensor to_host(const TensorView&) { no_cuda(); }
void device_fill_bytes(const TensorView&, int) { no_cuda(); }
void device_synchronize() { no_cuda(); }

#endif

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    this->~DeviceBuffer();
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

bool device_bytes_equal(const DeviceTensor& a, const DeviceTensor& b) {
  const HostTensor ha = to_host(a.view), hb = to_host(b.view);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data(), hb.data(), ha.nbytes()) == 0;
}

}  // namespace deltamoe
