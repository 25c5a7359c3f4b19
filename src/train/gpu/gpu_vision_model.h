// GpuVisionModel: the Qwen3.5 vision tower (patch embedding, position embedding, `depth` blocks,
// 2x2 merger) trained on one GPU, composed from the vision kernels and following the CPU reference
// (model/vision/vision_tower.cc, vision_block.cc) op for op. Precision as in transformers' bf16
// autocast with fp32 parameters: bf16 GEMM operands and branch activations, an fp32 residual stream
// and stream gradient, norm parameters and the position table read from the fp32 master; fp32
// accumulation and reductions; fp32 master and gradients in flat buffers (ParamLayout); planned
// once for (max_patches, max_images), so forward and backward neither allocate nor synchronise.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device_buffer.h"
#include "model/config.h"
#include "model/text/text_params.h"
#include "model/vision/trainable_parts.h"
#include "optim/param_layout.h"

namespace deltamoe {

class GemmContext;

// Saved activations of one vision block (inside the model's arena). Legend: N patches, C hidden,
// H heads, I MLP width.
struct GpuVisionBlockBuffers {
  float* x_in = nullptr;            // [N, C] block input (the fp32 residual stream)
  __nv_bfloat16* ln1 = nullptr;     // [N, C] norm1 output
  float* mean1 = nullptr;           // [N]
  float* rstd1 = nullptr;           // [N]
  __nv_bfloat16* q = nullptr;       // [N, C] after the rotary embedding
  __nv_bfloat16* k = nullptr;       // [N, C] after the rotary embedding
  __nv_bfloat16* v = nullptr;       // [N, C]
  __nv_bfloat16* attn = nullptr;    // [N, C] attention output
  float* lse = nullptr;             // [N, H]
  float* h1 = nullptr;              // [N, C] x_in + proj (after the attention residual, fp32)
  __nv_bfloat16* ln2 = nullptr;     // [N, C] norm2 output
  float* mean2 = nullptr;           // [N]
  float* rstd2 = nullptr;           // [N]
  __nv_bfloat16* fc1 = nullptr;     // [N, I] fc1 output with bias (the GELU input)
  __nv_bfloat16* act = nullptr;     // [N, I] GELU output
};

class GpuVisionModel {
 public:
  // prefix: the tower's parameter prefix (model.visual). Every later set_images() must fit
  // max_patches patch rows and max_images images. All work goes to `stream` (not owned).
  GpuVisionModel(const VisionConfig& config, std::string prefix, int64_t max_patches, int64_t max_images,
                 cudaStream_t stream);
  ~GpuVisionModel();
  GpuVisionModel(const GpuVisionModel&) = delete;
  GpuVisionModel& operator=(const GpuVisionModel&) = delete;

  const ParamLayout& layout() const { return layout_; }
  const VisionConfig& config() const { return config_; }
  cudaStream_t stream() const { return stream_; }

  // fp32 host parameters (every vision_param_shapes name, checkpoint shapes) -> master and bf16
  // copy. Synchronises.
  void upload_params(const ParamMap& params);

  // Copies one batch's images to the device (outside the step): pixel_values f32 [N, patch_dim]
  // host rows in the processor's order, grid_thw (t, h, w) per image. Builds the per-frame
  // segments, the rotary tables and the position-embedding taps on the host. Synchronises.
  void set_images(const float* pixel_values, int64_t num_patches, const std::vector<std::array<int64_t, 3>>& grid_thw);
  int64_t num_patches() const { return num_patches_; }
  // Merged tokens of the current images: N / merge_size^2 (the rows of forward's output).
  int64_t num_merged() const;

  // merged_out [M, out_hidden_size] bf16 device, written. No host sync.
  void forward(__nv_bfloat16* merged_out);
  // d_merged [M, out_hidden_size] bf16 device (d loss / d merged_out of the last forward). The
  // gradients are zeroed, then written for the trainable parts: a frozen merger gets none (its
  // input gradient is still formed when the ViT trains); a frozen ViT stops after the merger;
  // with both frozen nothing runs but the zeroing. No host sync.
  void backward(const __nv_bfloat16* d_merged, const TrainableParts& trainable);

  // Downloads the fp32 gradient of one parameter (synchronises).
  std::vector<float> read_gradient(const std::string& name) const;
  std::vector<float> read_master(const std::string& name) const;

  // The flat buffers (layout().total_numel() elements each), e.g. for an optimizer.
  float* gradients() { return grads_.as<float>(); }
  float* master() { return master_.as<float>(); }
  __nv_bfloat16* weights_bf16() { return weights_bf16_.as<__nv_bfloat16>(); }
  // Bytes of activations + workspaces planned on the device (parameters not included).
  size_t activation_bytes() const { return activation_bytes_ + workspace_bytes_ + inputs_bytes_; }

 private:
  void plan();
  int64_t offset_of(const std::string& name) const;  // name without the prefix, e.g. ".merger.norm.weight"
  const __nv_bfloat16* weight(const std::string& name) const;
  const float* master_weight(const std::string& name) const;  // fp32 master (norms, position table)
  float* grad(const std::string& name) const;
  std::string block_name(int64_t block, const char* leaf) const;
  void block_forward(int64_t block, const __nv_bfloat16* prev_mlp_out, const float* prev_h1);
  // On entry grad_stream_ (and its bf16 copy) holds the gradient reaching the block's output
  // (x_out = h1 + mlp); on return, the gradient reaching its input.
  void block_backward(int64_t block);

  VisionConfig config_;
  std::string prefix_;
  int64_t max_patches_ = 0, max_images_ = 0, max_segments_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GemmContext> gemm_;
  ParamLayout layout_;
  DeviceBuffer master_, grads_, weights_bf16_;

  std::unique_ptr<DeviceArena> arena_;
  size_t activation_bytes_ = 0;
  DeviceBuffer workspace_;
  size_t workspace_bytes_ = 0;
  std::unique_ptr<DeviceArena> inputs_;  // batch inputs, planned once
  size_t inputs_bytes_ = 0;

  int64_t grid_side_ = 0;                // G: the position table is G x G

  // Batch inputs (inside inputs_).
  float* pixels_f32_ = nullptr;          // [N, K] staging for the upload
  __nv_bfloat16* pixels_ = nullptr;      // [N, K]
  int32_t* cu_seqlens_ = nullptr;        // [segments + 1], one segment per image frame
  float* rope_cos_ = nullptr;            // [N, D/2]
  float* rope_sin_ = nullptr;            // [N, D/2]
  int64_t* tap_index_ = nullptr;         // [N, 4]
  float* tap_weight_ = nullptr;          // [N, 4]
  int32_t* tap_row_offsets_ = nullptr;   // [G*G + 1]
  int32_t* tap_entries_ = nullptr;       // [N * 4]
  int64_t num_patches_ = 0;
  int64_t num_segments_ = 0;

  // Activations (inside arena_).
  std::vector<GpuVisionBlockBuffers> blocks_;
  float* embedded_ = nullptr;             // [N, C] patch + position embedding (block 0's x_in), fp32
  __nv_bfloat16* qkv_ = nullptr;          // [N, 3C] scratch
  __nv_bfloat16* branch_out_ = nullptr;   // [N, C] scratch: patch projection / attention proj / MLP output
  float* merger_in_ = nullptr;            // [N, C] the residual stream after the last block
  __nv_bfloat16* merger_norm_ = nullptr;  // [N, C] = [M, 4C]
  float* merger_mean_ = nullptr;          // [N]
  float* merger_rstd_ = nullptr;          // [N]
  __nv_bfloat16* merger_fc1_ = nullptr;   // [M, 4C] fc1 output with bias
  __nv_bfloat16* merger_act_ = nullptr;   // [M, 4C]
  // Backward scratch.
  float* grad_stream_ = nullptr;               // [N, C] residual-stream gradient (fp32)
  __nv_bfloat16* grad_stream_bf16_ = nullptr;  // [N, C] its bf16 copy for the branch products
  float* grad_h1_ = nullptr;                   // [N, C] gradient reaching h1 (fp32)
  __nv_bfloat16* grad_h1_bf16_ = nullptr;      // [N, C] its bf16 copy
  float* grad_norm_ = nullptr;            // [N, C] gradient of a LayerNorm output (a product's fp32 output)
  __nv_bfloat16* grad_wide_ = nullptr;    // [N, max(I, 3C)]: d_act / d_qkv, and [M, 4C] in the merger
  __nv_bfloat16* grad_attn_ = nullptr;    // [N, C]
  __nv_bfloat16* grad_q_ = nullptr;       // [N, C]
  __nv_bfloat16* grad_k_ = nullptr;       // [N, C]
  __nv_bfloat16* grad_v_ = nullptr;       // [N, C]
};

}  // namespace deltamoe
