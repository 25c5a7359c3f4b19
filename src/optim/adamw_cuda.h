// CUDA AdamW over the same flat buffers as the CPU AdamW (optim/adamw.h), bit for bit its
// arithmetic (every operation rounded alone, no fused multiply-add), also writing the bf16 copy
// of the weights that the forward reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "optim/adamw.h"
#include "optim/param_layout.h"

namespace deltamoe {

// adamw_update_span on the device: count elements; master, grad f32; m, v of moment_dtype (f32 or
// bf16), updated in place. weights_bf16 (count elements, or null) is written with bf16(master).
void adamw_update_span_cuda(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                            float* master, const float* grad, void* m, void* v, __nv_bfloat16* weights_bf16,
                            cudaStream_t stream);

// AdamW::step's walk on the device: one update of every tensor of layout inside range, with
// adam_step counted from 1 (the value after the increment) and lr scaled per tensor by lr_scale.
// All buffers are range-local device memory of range.size() elements (element i is flat element
// range.begin + i); padding and parts outside any tensor are left untouched. One launch per tensor.
void adamw_step_cuda(const ParamLayout& layout, const AdamWConfig& config, FlatRange range, double lr,
                     int64_t adam_step, float* master, const float* grad, void* m, void* v,
                     __nv_bfloat16* weights_bf16, cudaStream_t stream);

}  // namespace deltamoe
