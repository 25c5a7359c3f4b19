// device_malloc / pinned_malloc: checked, counted (relaxed atomics: only totals are read).
#include "core/device_alloc.h"

#include <atomic>

#include "core/error.h"

#ifdef DELTAMOE_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace deltamoe {
namespace {

std::atomic<int64_t> device_calls{0}, device_bytes{0}, pinned_calls{0}, pinned_bytes{0};

}  // namespace

void* device_malloc(size_t bytes, const char* what) {
#ifdef DELTAMOE_WITH_CUDA
  void* data = nullptr;
  const cudaError_t status = cudaMalloc(&data, bytes);
  CHECK(status == cudaSuccess, what, ": cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(status));
  device_calls.fetch_add(1, std::memory_order_relaxed);
  device_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  return data;
#else
  RAISE(what, ": this deltamoe was built without CUDA (cpu preset); rebuild with the default preset");
#endif
}

void* pinned_malloc(size_t bytes, const char* what) {
#ifdef DELTAMOE_WITH_CUDA
  void* data = nullptr;
  const cudaError_t status = cudaMallocHost(&data, bytes);
  CHECK(status == cudaSuccess, what, ": cudaMallocHost of ", bytes, " bytes failed: ", cudaGetErrorString(status));
  pinned_calls.fetch_add(1, std::memory_order_relaxed);
  pinned_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  return data;
#else
  RAISE(what, ": this deltamoe was built without CUDA (cpu preset); rebuild with the default preset");
#endif
}

AllocationCounts allocation_counts() {
  AllocationCounts counts;
  counts.device = device_calls.load(std::memory_order_relaxed);
  counts.device_bytes = device_bytes.load(std::memory_order_relaxed);
  counts.pinned = pinned_calls.load(std::memory_order_relaxed);
  counts.pinned_bytes = pinned_bytes.load(std::memory_order_relaxed);
  return counts;
}

}  // namespace deltamoe
