// The bump arena every arena is, the bump arithmetic, and the host arena.
#include "core/arena.h"

#include <cstdlib>

namespace deltamoe {

size_t arena_bump(const std::string& name, size_t capacity, size_t* used, size_t* high_water,
                  size_t bytes, size_t alignment) {
  CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, name, ": alignment ", alignment,
        " is not a power of two");
  size_t offset = (*used + alignment - 1) & ~(alignment - 1);
  CHECK(offset + bytes <= capacity, name, ": out of space (", offset + bytes, " bytes needed, ",
        capacity, " planned); plan a larger arena");
  *used = offset + bytes;
  if (*used > *high_water) *high_water = *used;
  return offset;
}

void* BumpArena::allocate(size_t bytes, size_t alignment) {
  return base_ + arena_bump(name_, capacity_, &used_, &high_water_, bytes, alignment);
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
