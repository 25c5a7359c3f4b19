// ArenaCarver: hands out 256-byte aligned pieces of a DeviceArena or of a plain block (pinned host
// staging), or only counts their bytes when given neither, so that one layout function both sizes
// a buffer and carves it (GPU models, and the memory planner of CPU builds).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/arena.h"
#include "core/error.h"

namespace deltamoe {

class ArenaCarver {
 public:
  // Counts only (arena null) or carves the arena.
  explicit ArenaCarver(DeviceArena* arena) : arena_(arena) {}
  // Carves a block of `capacity` bytes at base (256-byte aligned).
  ArenaCarver(void* base, size_t capacity) : base_(static_cast<char*>(base)), capacity_(capacity) {}

  // count elements of T (at least one, so that a zero-sized slot still has a distinct address).
  template <typename T>
  T* take(int64_t count) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
    const size_t offset = (used_ + 255) / 256 * 256;
    used_ = offset + bytes;
    if (arena_ != nullptr) return static_cast<T*>(arena_->allocate(bytes, 256));
    if (base_ == nullptr) return nullptr;
    CHECK(used_ <= capacity_, "ArenaCarver: the layout needs ", used_, " bytes, the block has ", capacity_);
    return reinterpret_cast<T*>(base_ + offset);
  }
  void* take_bytes(size_t bytes) { return take<char>(static_cast<int64_t>(bytes)); }
  // Bytes a buffer needs for everything taken so far (with the last piece's alignment slack).
  size_t used() const { return used_ + 256; }

 private:
  DeviceArena* arena_ = nullptr;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
};

}  // namespace deltamoe
