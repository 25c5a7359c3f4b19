// Device form of split_master.h: fp32 values into split masters' halves (the bf16 weights and the
// low halves), for masters initialised on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// high[i], low[i] = the halves of values[i], i < count; queued on stream.
void split_master_cuda(const float* values, __nv_bfloat16* high, uint16_t* low, int64_t count, cudaStream_t stream);

}  // namespace deltamoe
