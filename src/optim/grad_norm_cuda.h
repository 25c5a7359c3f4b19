// The global gradient norm's sum of squares on the device, deterministic (fixed grid, partial sums
// added in block order), over the gradient as the optimizer will see it: each element divided by
// the step's supervised-token count first (divide_gradient's fp64 quotient rounded to fp32), then
// squared and summed in fp64, as grad_clip.h's sum_of_squares_f64 does on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// Scratch doubles the reduction needs.
size_t grad_sum_of_squares_workspace_bytes();

// *out (device double) = sum over i < count of fl32(fl64(grad[i]) / divisor)^2 in fp64. No host sync.
void grad_sum_of_squares_cuda(const float* grad, int64_t count, double divisor, double* out, void* workspace,
                              cudaStream_t stream);

}  // namespace deltamoe
