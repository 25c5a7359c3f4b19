// acc += in over fp32 gradients on the device: a rank adds each micro-batch's reduce-scattered
// piece of a dense bucket to the step's running sum (the order one rank's engine adds them in).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// acc[i] += in[i] for i < count (fp32, one rounding per add). No host sync.
void add_f32_cuda(const float* in, float* acc, int64_t count, cudaStream_t stream);

}  // namespace deltamoe
