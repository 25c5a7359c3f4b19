// The bump arena every arena is, and the host arena.
#include "core/arena.h"

#include <algorithm>
#include <cstdlib>

namespace deltamoe {

void* BumpArena::allocate(size_t bytes, size_t alignment) {
  CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, name_, ": alignment ", alignment,
        " is not a power of two");
  const size_t offset = (used_ + alignment - 1) & ~(alignment - 1);
  CHECK(offset + bytes <= capacity_, name_, ": out of space (", offset + bytes, " bytes needed, ", capacity_,
        " planned); plan a larger arena");
  used_ = offset + bytes;
  high_water_ = std::max(high_water_, used_);
  return base_ + offset;
}

TensorView BumpArena::allocate_tensor(DType dtype, Shape shape) {
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  return TensorView(allocate(bytes), dtype, shape, device_);
}

HostArena::HostArena(size_t capacity_bytes, std::string name)
    : BumpArena(std::move(name), capacity_bytes, Device::cpu) {
  size_t rounded = (capacity_bytes + 4095) / 4096 * 4096;
  base_ = static_cast<char*>(std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded));
  CHECK(base_ != nullptr, name_, ": cannot allocate ", capacity_bytes, " bytes of host memory");
}

HostArena::~HostArena() { std::free(base_); }

}  // namespace deltamoe
