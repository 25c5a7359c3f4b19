// The one funnel for the engine's device and pinned host allocations: every cudaMalloc and
// cudaMallocHost of src/ goes through these calls, which check the CUDA status and count, so that
// `bench` can show a training step allocating nothing after the first (allocation_counts() before
// and after). Frees stay with the owners (cudaFree / cudaFreeHost). CUDA builds only: without CUDA
// the calls raise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// `what` names the owner in the error message when CUDA refuses.
void* device_malloc(size_t bytes, const char* what);
void* pinned_malloc(size_t bytes, const char* what);

struct AllocationCounts {
  int64_t device = 0, device_bytes = 0;  // device_malloc calls and their bytes, since the process began
  int64_t pinned = 0, pinned_bytes = 0;  // pinned_malloc calls and their bytes
};
AllocationCounts allocation_counts();

}  // namespace deltamoe
