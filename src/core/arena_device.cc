// Device arena: one cudaMalloc planned up front. Without CUDA the constructor explains why it fails.
#include "core/arena.h"
#include "core/device_alloc.h"

#ifdef DELTAMOE_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace deltamoe {

DeviceArena::DeviceArena(size_t capacity_bytes, std::string name)
    : BumpArena(std::move(name), capacity_bytes, Device::cuda) {
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

}  // namespace deltamoe
