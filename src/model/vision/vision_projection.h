// The vision tower's one way to apply a Linear (blocks' attn.qkv / attn.proj / mlp.linear_fc1 /
// linear_fc2 and the merger's linear_fc1 / linear_fc2): y = x W^T + b, plus the module's LoRA adapter
// (x' A^T) B^T * scale when the parameter map holds one (entries named as in model/lora/lora.h), x' =
// dropout(x) in a training pass with LoRA dropout (model/lora/lora_dropout.h; the mask's rows are
// the call's rows 0 .. rows - 1: all patches of the batch, or the merged rows in the merger), else x.
// Templated on the scalar (float, double for finite-difference tests).
#pragma once

#include <cstdint>
#include <string>

#include "model/vision/vision_block.h"

namespace deltamoe {

// y [rows, out] written.
template <typename T>
void vision_project_forward(const VisionParams& params, const std::string& module, const T* x, T* y, int64_t rows,
                            int64_t in_features, int64_t out_features);

// dx [rows, in] written (null: skipped). Each of the weight, bias, lora_A and lora_B gradients is
// added to grads[name] when grads holds that name (a trained tensor), skipped otherwise.
template <typename T>
void vision_project_backward(const VisionParams& params, VisionParams* grads, const std::string& module, const T* x,
                             const T* dy, T* dx, int64_t rows, int64_t in_features, int64_t out_features);

// grads[name] as T when grads holds it (checking its size), else null: the tensor is frozen.
template <typename T>
T* optional_vision_grad(VisionParams* grads, const std::string& name, int64_t numel);

}  // namespace deltamoe
