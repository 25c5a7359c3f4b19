// Bump allocators planned once and reset per step: no allocation inside a training step.
// HostArena carves an aligned host block; DeviceArena does the same over one cudaMalloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace deltamoe {

class HostArena {
 public:
  explicit HostArena(size_t capacity_bytes, std::string name = "host arena");
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Returns `bytes` bytes aligned to `alignment`; CHECKs capacity with the arena's name.
  void* allocate(size_t bytes, size_t alignment = 256);
  TensorView allocate_tensor(DType dtype, Shape shape);
  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  size_t high_water() const { return high_water_; }
  size_t capacity() const { return capacity_; }

 private:
  std::string name_;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t high_water_ = 0;
};

// Device memory arena. In a build without CUDA, constructing one throws.
class DeviceArena {
 public:
  explicit DeviceArena(size_t capacity_bytes, std::string name = "device arena");
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void* allocate(size_t bytes, size_t alignment = 256);
  TensorView allocate_tensor(DType dtype, Shape shape);
  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  size_t high_water() const { return high_water_; }
  size_t capacity() const { return capacity_; }

 private:
  std::string name_;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t high_water_ = 0;
};

// Shared bump logic: returns the offset for an allocation or throws when it does not fit.
size_t arena_bump(const std::string& name, size_t capacity, size_t* used, size_t* high_water,
                  size_t bytes, size_t alignment);

}  // namespace deltamoe
