// The activation layout of the vision tower on the GPU (patch embedding, blocks, merger) and its
// batch inputs. One function lays it out over an ArenaCarver, so it both sizes (also in CPU builds,
// for the memory planner) and carves (GpuVisionModel). A frozen ViT saves nothing for a backward:
// its blocks then share one set of buffers. Recomputed blocks (the first recompute_blocks of a
// trained ViT) keep only their fp32 input and share one set of everything else, refilled by the
// rerun of each one's forward just before its backward. Legend: N patches, M = N / merge^2 merged rows,
// C hidden, H heads, I MLP width.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device_bf16.h"
#include "model/arena_carver.h"
#include "model/config.h"

namespace deltamoe {

// What one vision block keeps for its backward.
struct VisionBlockActivations {
  float* x_in = nullptr;         // [N, C] block input (the fp32 residual stream)
  DeviceBf16* ln1 = nullptr;     // [N, C] norm1 output
  float* mean1 = nullptr;        // [N]
  float* rstd1 = nullptr;        // [N]
  DeviceBf16* q = nullptr;       // [N, H, Dqk] after the rotary embedding (vision_qk_head_stride)
  DeviceBf16* k = nullptr;       // [N, H, Dqk] after the rotary embedding
  DeviceBf16* v = nullptr;       // [N, C]
  DeviceBf16* attn = nullptr;    // [N, C] attention output
  float* lse = nullptr;          // [N, H]
  float* h1 = nullptr;           // [N, C] x_in + proj (after the attention residual, fp32)
  DeviceBf16* ln2 = nullptr;     // [N, C] norm2 output
  float* mean2 = nullptr;        // [N]
  float* rstd2 = nullptr;        // [N]
  DeviceBf16* fc1 = nullptr;     // [N, I] fc1 output with bias (the GELU input)
  DeviceBf16* act = nullptr;     // [N, I] GELU output
};

struct VisionActivationSpec {
  int64_t max_patches = 0;
  int64_t max_images = 1;
  bool blocks_backward = true;  // the ViT trains: every block saves its activations
  bool any_backward = true;     // the ViT or the merger trains: backward scratch is needed
  // With blocks_backward: the first recompute_blocks blocks (0..depth) keep only x_in.
  int64_t recompute_blocks = 0;
};

struct VisionActivations {
  std::vector<VisionBlockActivations> blocks;
  float* embedded = nullptr;             // [N, C] patch + position embedding (block 0's x_in), fp32
  DeviceBf16* qkv = nullptr;             // [N, 3C] scratch
  DeviceBf16* branch_out = nullptr;      // [N, C] scratch: patch projection / attention proj / MLP output
  float* merger_in = nullptr;            // [N, C] the residual stream after the last block
  DeviceBf16* merger_norm = nullptr;     // [N, C] = [M, 4C]
  float* merger_mean = nullptr;          // [N]
  float* merger_rstd = nullptr;          // [N]
  DeviceBf16* merger_fc1 = nullptr;      // [M, 4C] fc1 output with bias
  DeviceBf16* merger_act = nullptr;      // [M, 4C]
  // Backward scratch (null when nothing trains).
  float* grad_stream = nullptr;               // [N, C] residual-stream gradient (fp32)
  DeviceBf16* grad_stream_bf16 = nullptr;     // [N, C] its bf16 copy for the branch products
  float* grad_h1 = nullptr;                   // [N, C] gradient reaching h1 (fp32)
  DeviceBf16* grad_h1_bf16 = nullptr;         // [N, C] its bf16 copy
  float* grad_norm = nullptr;                 // [N, C] gradient of a LayerNorm output (a product's fp32 output)
  DeviceBf16* grad_wide = nullptr;            // [N, max(I, 3C)]: d_act / d_qkv, and [M, 4C] in the merger
  DeviceBf16* grad_attn = nullptr;            // [N, C]
  DeviceBf16* grad_q = nullptr;               // [N, H, Dqk]
  DeviceBf16* grad_k = nullptr;               // [N, H, Dqk]
  DeviceBf16* grad_v = nullptr;               // [N, C]
};

void carve_vision_activations(ArenaCarver& carver, const VisionConfig& config, const VisionActivationSpec& spec,
                              VisionActivations* out);
size_t vision_activation_bytes(const VisionConfig& config, const VisionActivationSpec& spec);

// The batch inputs: patches, per-frame segments, rotary tables and position-embedding taps.
struct VisionInputs {
  float* pixels_f32 = nullptr;       // [N, patch_dim] staging for the upload
  DeviceBf16* pixels = nullptr;      // [N, patch_dim]
  int32_t* cu_seqlens = nullptr;     // [segments + 1], one segment per image frame
  float* rope_cos = nullptr;         // [N, D/2]
  float* rope_sin = nullptr;         // [N, D/2]
  int64_t* tap_index = nullptr;      // [N, 4]
  float* tap_weight = nullptr;       // [N, 4]
  int32_t* tap_row_offsets = nullptr;  // [G*G + 1]
  int32_t* tap_entries = nullptr;    // [N * 4]
};
// Every frame covers at least one merge block: at most max_patches / merge^2 segments.
int64_t vision_max_segments(const VisionConfig& config, int64_t max_patches);
// Room per head of the rotated q and k and their gradients: the head dim rounded up to 16 (cuDNN's
// attention reads q and k zero-padded to it, cudnn_sdpa.h; our kernel reads [N, H, D] from the
// buffers' start).
int64_t vision_qk_head_stride(const VisionConfig& config);
void carve_vision_inputs(ArenaCarver& carver, const VisionConfig& config, const VisionActivationSpec& spec,
                         VisionInputs* out);
size_t vision_input_bytes(const VisionConfig& config, const VisionActivationSpec& spec);

}  // namespace deltamoe
