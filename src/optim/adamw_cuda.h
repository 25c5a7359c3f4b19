// CUDA AdamW over the same flat buffers as the CPU AdamW (optim/adamw.h), bit for bit its
// arithmetic (every operation rounded alone, no fused multiply-add), also writing the bf16 copy
// of the weights that the forward reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "optim/adamw.h"
#include "optim/param_layout.h"

namespace deltamoe {

// How the accumulated gradient becomes the one AdamW steps with, as the CPU engine does it in place
// (divide_gradient, then scale_in_place when clipping): g = fl32(fl64(g) / divisor) unless the
// divisor is 1, then g = fl32(g * clip_coef) when clip_coef < 1. Applied on the fly: the gradient
// buffer is only read.
struct GradientScaling {
  double divisor = 1.0;
  float clip_coef = 1.0f;
};

// adamw_update_span on the device: count elements; master, grad f32; m, v of moment_dtype (f32 or
// bf16), updated in place; grad scaled as `scaling` says. weights_bf16 (count elements, or null)
// is written with bf16(master).
void adamw_update_span_cuda(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                            float* master, const float* grad, const GradientScaling& scaling, void* m, void* v,
                            __nv_bfloat16* weights_bf16, cudaStream_t stream);

// AdamW::step's walk on the device: one update of every piece of layout with adam_step counted from
// 1 (the value after the increment) and lr scaled per piece by lr_scale. master, grad, m, v are the
// layout's flat device buffers (padding left untouched); weights_bf16 has one entry per piece: where
// that piece's bf16 working copy goes (null: none). One launch per piece.
void adamw_step_cuda(const ParamLayout& layout, const AdamWConfig& config, double lr, int64_t adam_step,
                     const GradientScaling& scaling, float* master, const float* grad, void* m, void* v,
                     const std::vector<__nv_bfloat16*>& weights_bf16, cudaStream_t stream);

}  // namespace deltamoe
