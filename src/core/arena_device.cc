// Device arena: one cudaMalloc planned up front. Without CUDA the constructor explains why it fails.
#include "core/arena.h"
#include "core/device_alloc.h"

#ifdef DELTAMOE_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace deltamoe {

DeviceArena::DeviceArena(size_t capacity_bytes, std::string name)
    : name_(std::move(name)), capacity_(capacity_bytes) {
#ifdef DELTAMOE_WITH_CUDA
  base_ = static_cast<decltype(base_)>(device_malloc(capacity_bytes == 0 ? 256 : capacity_bytes, name_.c_str()));
#else
  RAISE(name_, ": this deltamoe was built without CUDA (cpu preset); rebuild with the default preset");
#endif
}

DeviceArena::~DeviceArena() {
#ifdef DELTAMOE_WITH_CUDA
  if (base_ != nullptr) cudaFree(base_);  // NOTE: no CHECK in a destructor; the context may be gone
#endif
}

void* DeviceArena::allocate(size_t bytes, size_t alignment) {
  return base_ + arena_bump(name_, capacity_, &used_, &high_water_, bytes, alignment);
}

TensorView DeviceArena::allocate_tensor(DType dtype, Shape shape) {
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  return TensorView(allocate(bytes), dtype, shape, Device::cuda);
}

}  // namespace deltamoe
