// ArenaCarver: hands out 256-byte aligned pieces of a DeviceArena, or only counts their bytes when
// the arena is null, so that one layout function both sizes an arena and carves it (GPU models).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/arena.h"

namespace deltamoe {

class ArenaCarver {
 public:
  explicit ArenaCarver(DeviceArena* arena) : arena_(arena) {}
  // count elements of T (at least one, so that a zero-sized slot still has a distinct address).
  template <typename T>
  T* take(int64_t count) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
    used_ = (used_ + 255) / 256 * 256 + bytes;
    return arena_ != nullptr ? static_cast<T*>(arena_->allocate(bytes, 256)) : nullptr;
  }
  void* take_bytes(size_t bytes) { return take<char>(static_cast<int64_t>(bytes)); }
  // Bytes an arena needs for everything taken so far (with the last piece's alignment slack).
  size_t used() const { return used_ + 256; }

 private:
  DeviceArena* arena_;
  size_t used_ = 0;
};

}  // namespace deltamoe
