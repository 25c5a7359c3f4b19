// Device forms of split_master.h: fp32 values into split masters' halves (the bf16 weights and the
// low halves), for masters initialised on the device, and the bf16 working weights of fp32 masters
// (their high halves: every trained tensor's weight is rounded from its master the same way,
// whether the master is kept split or not, so that engines of any rank count agree bit for bit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// high[i], low[i] = the halves of values[i], i < count; queued on stream.
void split_master_cuda(const float* values, __nv_bfloat16* high, uint16_t* low, int64_t count, cudaStream_t stream);
// weights[i] = the high half of master[i] (bf16, ties away from zero), i < count; queued on stream.
void master_weights_cuda(const float* master, __nv_bfloat16* weights, int64_t count, cudaStream_t stream);

}  // namespace deltamoe
