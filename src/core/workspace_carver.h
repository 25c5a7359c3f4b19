// One caller-provided workspace cut into 256-byte aligned pieces in order, and the size rule that
// goes with it, so that a kernel's *_workspace_bytes function and the code that carves agree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace deltamoe {

// Bytes rounded up to the pieces' 256-byte alignment.
constexpr size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

class WorkspaceCarver {
 public:
  // `owner` names the operation in the message when the workspace is too small.
  WorkspaceCarver(const char* owner, void* base, size_t bytes)
      : owner_(owner), at_(static_cast<char*>(base)), left_(bytes) {}

  // The next count elements of T (align256(count * sizeof(T)) bytes of the workspace).
  template <typename T>
  T* take(int64_t count) {
    const size_t bytes = align256(static_cast<size_t>(count) * sizeof(T));
    CHECK(bytes <= left_, owner_, ": workspace too small (", left_, " bytes left, need ", bytes, ")");
    T* piece = reinterpret_cast<T*>(at_);
    at_ += bytes;
    left_ -= bytes;
    return piece;
  }

 private:
  const char* owner_;
  char* at_;
  size_t left_;
};

}  // namespace deltamoe
