// Owning device allocations for setup code and tests (never inside a training step, which
// takes its memory from a DeviceArena planned once), and host<->device copies of tensors.
#pragma once

#include <cstddef>
#include <vector>

#include "core/tensor.h"

namespace deltamoe {

// One cudaMalloc'd block, freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A device tensor that owns its memory (tests, parameter upload).
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;  // device = cuda
};

DeviceTensor device_tensor(DType dtype, Shape shape);
// Uploads a host tensor, converting floating dtypes to `dtype` (e.g. f32 reference data to bf16).
DeviceTensor to_device(const HostTensor& host, DType dtype);
inline DeviceTensor to_device(const HostTensor& host) { return to_device(host, host.dtype()); }
// Downloads a device view into a host tensor of the same dtype (synchronises the device).
HostTensor to_host(const TensorView& device_view);
// True when two device tensors hold the same bytes (determinism checks in tests). Synchronises.
bool device_bytes_equal(const DeviceTensor& a, const DeviceTensor& b);
// Fills a device buffer with a byte pattern (0xFF gives NaN for floats: poison before tests).
void device_fill_bytes(const TensorView& device_view, int byte_value);
void device_synchronize();

}  // namespace deltamoe
