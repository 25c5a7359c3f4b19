// One pre-norm vision transformer block (as in transformers' modeling_qwen3_5_moe.py), forward and backward,
// templated on the scalar type (float for the reference, double for finite-difference tests). Internal to the
// tower. Legend: N patches, C hidden, H heads, D head dim, I MLP width.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace deltamoe {

// What the tower passes every block: the patch layout shared by all of them.
template <typename T>
struct VisionLayout {
  int64_t num_patches = 0;          // N
  std::vector<int32_t> cu_seqlens;  // one segment per image frame
  std::vector<T> rope_cos, rope_sin;  // [N, D/2]
};

template <typename T>
struct VisionBlockSaved {
  std::vector<T> x_in, norm1, mean1, rstd1;  // block input, LayerNorm1 output and statistics
  std::vector<T> q, k, v;                    // [N, H, D], q and k after the rotary embedding
  std::vector<T> attn, lse;                  // attention output [N, C] and log-sum-exp [N, H]
  std::vector<T> x_mid, norm2, mean2, rstd2; // after the attention residual; LayerNorm2
  std::vector<T> fc1, act;                   // MLP pre-activation and GELU(tanh) output [N, I]
};

using VisionParams = std::map<std::string, HostTensor>;  // also declared in vision_tower.h

// x [N, C] is replaced by the block output. `block` is "model.visual.blocks.<j>.".
template <typename T>
void vision_block_forward(const VisionConfig& config, const VisionParams& params, const std::string& block,
                          const VisionLayout<T>& layout, std::vector<T>& x, VisionBlockSaved<T>& saved);

// dx [N, C]: the gradient at the block output on entry, at its input on return. Parameter
// gradients are added to grads[name] (which must exist, zero-filled, with the parameter's shape).
template <typename T>
void vision_block_backward(const VisionConfig& config, const VisionParams& params, const std::string& block,
                           const VisionLayout<T>& layout, const VisionBlockSaved<T>& saved, std::vector<T>& dx,
                           VisionParams& grads);

// The values of params[name] as T, checking presence, dtype and element count (errors name it).
template <typename T>
const T* vision_param(const VisionParams& params, const std::string& name, int64_t numel);
template <typename T>
T* vision_param(VisionParams& params, const std::string& name, int64_t numel);

}  // namespace deltamoe
