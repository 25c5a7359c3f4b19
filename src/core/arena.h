// Bump allocators planned once and reset per step: no allocation inside a training step.
// HostArena carves an aligned host block; DeviceArena does the same over one cudaMalloc. Both are
// a BumpArena over memory they own; only where the block comes from differs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "core/tensor.h"

namespace deltamoe {

// The bump arithmetic and bookkeeping over a block [base, base + capacity) of one device's memory.
class BumpArena {
 public:
  BumpArena(const BumpArena&) = delete;
  BumpArena& operator=(const BumpArena&) = delete;

  // Returns `bytes` bytes aligned to `alignment`; CHECKs capacity with the arena's name.
  void* allocate(size_t bytes, size_t alignment = 256);
  TensorView allocate_tensor(DType dtype, Shape shape);
  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  size_t high_water() const { return high_water_; }
  size_t capacity() const { return capacity_; }

 protected:
  BumpArena(std::string name, size_t capacity, Device device)
      : name_(std::move(name)), capacity_(capacity), device_(device) {}
  ~BumpArena() = default;

  std::string name_;
  char* base_ = nullptr;  // set by the owning arena's constructor, released by its destructor

 private:
  size_t capacity_ = 0;
  Device device_;
  size_t used_ = 0;
  size_t high_water_ = 0;
};

class HostArena : public BumpArena {
 public:
  explicit HostArena(size_t capacity_bytes, std::string name = "host arena");
  ~HostArena();
};

// Device memory arena. In a build without CUDA, constructing one throws.
class DeviceArena : public BumpArena {
 public:
  explicit DeviceArena(size_t capacity_bytes, std::string name = "device arena");
  ~DeviceArena();
};

}  // namespace deltamoe
