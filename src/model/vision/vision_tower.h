// The Qwen3.5 vision tower as a CPU reference (as in transformers' modeling_qwen3_5_moe.py): patch embedding,
// resampled position embedding, `depth` blocks with 2-D RoPE and per-frame attention, and the 2x2 patch
// merger — forward over all images of a batch, and backward to every parameter by its Hugging Face name.
// Legend: N patches (pixel_values rows), M = N / m^2 merged tokens, C hidden, O out_hidden_size.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/vision/trainable_parts.h"

namespace deltamoe {

using VisionParams = std::map<std::string, HostTensor>;

constexpr const char* kVisionPrefix = "model.visual";

// Activations kept by the forward for the backward (opaque; holds the scalar type it ran in).
struct VisionTowerSaved {
  DType dtype = DType::f32;
  std::shared_ptr<const void> state;
};

struct VisionTowerOutput {
  HostTensor features;     // [M, O], merged tokens of all images in order
  VisionTowerSaved saved;
};

// params: every "<prefix>.*" tensor (f32, or all f64 for tests), shapes as in the checkpoint
// (patch_embed.proj.weight [C, 3, Tp, P, P]). pixel_values [N, 3*Tp*P*P] of the params' dtype;
// grid_thw int64 [I, 3]. Throws naming the tensor on a missing or mis-shaped input.
VisionTowerOutput vision_tower_forward(const VisionParams& params, const VisionConfig& config,
                                       const HostTensor& pixel_values, const HostTensor& grid_thw,
                                       const std::string& prefix = kVisionPrefix);

// d_features [M, O] -> returns d_pixel_values [N, 3*Tp*P*P]; parameter gradients are added to
// grads by HF name (a missing entry is created zero-filled with the parameter's shape and dtype).
// Freezing (`trainable`, its llm field unused): a frozen merger gets no entries and no weight
// products (its input gradient is still formed when the ViT trains); with the ViT frozen the
// backward stops after the merger, adds no ViT entries and returns an empty() d_pixel_values.
HostTensor vision_tower_backward(const VisionParams& params, const VisionConfig& config,
                                 const VisionTowerSaved& saved, const HostTensor& d_features, VisionParams* grads,
                                 const std::string& prefix = kVisionPrefix, const TrainableParts& trainable = {});

// Names and shapes of the tower's parameters in checkpoint order.
std::vector<std::pair<std::string, Shape>> vision_param_shapes(const VisionConfig& config,
                                                               const std::string& prefix = kVisionPrefix);

// Number of merged (LLM) tokens for grid_thw int64 [I, 3]: sum of t*h*w / m^2.
int64_t vision_num_merged_tokens(const HostTensor& grid_thw, int64_t merge_size);

}  // namespace deltamoe
