// GpuVisionModel: the Qwen3.5 vision tower (patch embedding, position embedding, `depth` blocks,
// 2x2 merger) trained on one GPU, composed from the vision kernels and following the CPU reference
// (model/vision/vision_tower.cc, vision_block.cc) op for op. Precision as in transformers' bf16
// autocast with fp32 parameters: bf16 GEMM operands and branch activations, an fp32 residual stream
// and stream gradient, norm parameters and the position table read in fp32; fp32 accumulation and
// reductions. Parameters are typed views (VisionWeights; the owner is DeviceParams); gradients of
// trained ones are ADDED to. Every Linear goes through one funnel (project / lora_backward) that
// adds a LoRA adapter's term when the weight carries one (kernels/lora/lora_cuda.h). The blocks'
// attention runs on cuDNN's fused SDPA on the sm_90a path, q and k zero-padded per head to a
// multiple of 16 (kernels/cudnn_sdpa/cudnn_sdpa_notes.md), else on our flash-attention kernel.
// Activations are planned once for (max_patches, max_images) and for
// what trains: a frozen ViT keeps nothing for a backward; recomputed blocks (the first
// recompute_blocks of a trained ViT) keep only their fp32 input and rerun their forward, adapter
// products included, just before their backward. No allocation or host sync in a step.
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
#include "core/dtype.h"
#include "kernels/lora/lora_cuda.h"
#include "model/config.h"
#include "model/gradient_phases.h"
#include "model/vision/vision_weights.h"
#include "model/vision/vision_activations.h"

namespace deltamoe {

class CudnnSdpa;
class GemmContext;

struct GpuVisionBytes {
  size_t activations = 0, workspace = 0, inputs = 0;
  size_t total() const { return activations + workspace + inputs; }
};

class GpuVisionModel {
 public:
  // Every later set_images() must fit max_patches patch rows and max_images images. weights must
  // stay valid for the model's life; all work goes to `stream` (not owned). recompute_blocks
  // (0..depth): how many first blocks are recomputed in the backward (ignored for a frozen ViT).
  // lora_dropout_max_in: the widest input of a dense adapter that drops (0: no LoRA dropout).
  GpuVisionModel(const VisionConfig& config, const VisionWeights& weights, int64_t max_patches, int64_t max_images,
                 cudaStream_t stream, int64_t recompute_blocks = 0, int64_t lora_dropout_max_in = 0);
  ~GpuVisionModel();
  GpuVisionModel(const GpuVisionModel&) = delete;
  GpuVisionModel& operator=(const GpuVisionModel&) = delete;

  // The bytes such a model allocates, without allocating (memory planning).
  // lora_rank: the largest adapter rank on the tower's Linears (0: none); recompute_blocks as in
  // the constructor.
  static GpuVisionBytes planned_bytes(const VisionConfig& config, int64_t max_patches, int64_t max_images,
                                      bool vit_trained, bool merger_trained, int64_t lora_rank = 0,
                                      int64_t recompute_blocks = 0, int64_t lora_dropout_max_in = 0);
  // The adapters' scratch: x A^T and s dy B rows [max_patches, rank] bf16.
  static size_t lora_scratch_bytes(int64_t max_patches, int64_t lora_rank);

  const VisionConfig& config() const { return config_; }
  cudaStream_t stream() const { return stream_; }
  const VisionWeights& weights() const { return weights_; }

  // Copies one batch's images to the device, ahead of the forward on the stream: pixel_values f32
  // [N, patch_dim] host rows in the processor's order, grid_thw (t, h, w) per image. Builds the
  // per-frame segments, the rotary tables and the position-embedding taps on the host; the copies
  // go through pinned staging (the host vectors may go on return).
  void set_images(const float* pixel_values, int64_t num_patches, const std::vector<std::array<int64_t, 3>>& grid_thw);
  int64_t num_patches() const { return num_patches_; }
  // Merged tokens of the current images: N / merge_size^2 (the rows of forward's output).
  int64_t num_merged() const;

  // merged_out [M, out_hidden_size] bf16 device, written. No host sync.
  void forward(__nv_bfloat16* merged_out);
  // d_merged [M, out_hidden_size] bf16 device (d loss / d merged_out of the last forward). The
  // trained parts' gradients are added to: a frozen merger gets none (its input gradient is still
  // formed when the ViT trains); a frozen ViT stops after the merger; with both frozen nothing runs.
  void backward(const __nv_bfloat16* d_merged);
  // Called by backward() as each gradient phase is finished (the merger, each block from the last,
  // the patch and position embedding), with that phase's work queued on the stream; none by default.
  void set_gradient_ready_hook(GradientReadyHook hook) { gradient_ready_ = std::move(hook); }

  // LoRA dropout, as GpuTextModel's: the counters of the next forward and backward (p 0: none;
  // p > 0 needs lora_dropout_max_in at construction).
  void set_lora_dropout(const LoraDropoutKey& key);

  GpuVisionBytes bytes() const { return bytes_; }
  // The blocks' attention, chosen at setup (kernels/cudnn_sdpa/gpu/cudnn_attention_choice.h):
  // "cudnn" (fused SDPA, for batches of up to min(max_images, 64) frames) or "ours" (flash attention).
  const char* attention_backend() const;
  uint64_t uploaded_bytes() const { return uploaded_bytes_; }

 private:
  // prev_mlp_out null: the block normalises its kept x_in (block 0, and every rerun). A rerun
  // (recompute) refills what the backward reads and skips fc2, whose output nothing reads then.
  void block_forward(int64_t block, const __nv_bfloat16* prev_mlp_out, const float* prev_h1, bool rerun = false);
  // On entry grad_stream (and its bf16 copy) holds the gradient reaching the block's output
  // (x_out = h1 + mlp); on return, the gradient reaching its input.
  void block_backward(int64_t block);
  // The projection funnel (compare llama.cpp's build_lora_mm): y [rows, out] bf16 = x W^T + b
  // rounded once, plus the LoRA term when w carries an adapter.
  void project(const DeviceParam& w, const DeviceParam& bias, const __nv_bfloat16* x, __nv_bfloat16* y, int64_t rows,
               int64_t in_features, int64_t out_features);
  // The adapter's backward for dy [rows, out] (nothing without one): dA, dB added to when trained,
  // and its input-gradient term added to dx (bf16 or f32, dx_dtype; null: skipped).
  void lora_backward(const DeviceParam& w, const __nv_bfloat16* x, const __nv_bfloat16* dy, void* dx, DType dx_dtype,
                     int64_t rows, int64_t in_features, int64_t out_features);
  // dW += dy^T x for a trained weight; nothing for a frozen one.
  void weight_grad(const DeviceParam& w, const __nv_bfloat16* dy, const __nv_bfloat16* x, int64_t rows,
                   int64_t in_features, int64_t out_features);
  void bias_grad(const DeviceParam& b, const void* dy, bool dy_f32, int64_t rows, int64_t features);
  void report(GradientPhaseKind kind, int64_t index);  // the gradient-ready hook, if any
  // cuDNN's plans exist and hold this batch's frames (else our kernel runs).
  bool use_cudnn_attention() const;
  // Head stride of the rotated q, k and their gradients this batch: padded for cuDNN, D for ours.
  int64_t qk_head_stride() const;

  VisionConfig config_;
  VisionWeights weights_;
  int64_t max_patches_ = 0, max_images_ = 0, max_segments_ = 0;
  cudaStream_t stream_ = nullptr;
  GradientReadyHook gradient_ready_;
  std::unique_ptr<GemmContext> gemm_;
  std::unique_ptr<CudnnSdpa> cudnn_attention_;  // null: our flash-attention kernel
  GpuVisionBytes bytes_;
  VisionActivationSpec spec_;

  std::unique_ptr<DeviceArena> arena_;
  VisionActivations acts_;
  DeviceBuffer workspace_;
  size_t workspace_bytes_ = 0;
  DeviceBuffer lora_scratch_;  // lora_scratch_bytes; empty without adapters
  int64_t lora_rank_ = 0;
  DeviceBuffer lora_dropout_scratch_;  // [max_patches, lora_dropout_max_in] f32; empty without dropout
  LoraDropoutKey lora_dropout_;        // this pass's counters (p 0: nothing dropped)
  LoraDropoutPass lora_dropout_pass(const DeviceLoraViews& views) const;
  std::unique_ptr<DeviceArena> inputs_arena_;
  VisionInputs inputs_;
  struct Staging;
  std::unique_ptr<Staging> staging_;
  uint64_t uploaded_bytes_ = 0;
  int64_t grid_side_ = 0;  // G: the position table is G x G
  int64_t num_patches_ = 0;
  int64_t num_segments_ = 0;
  int64_t longest_segment_ = 0;  // the batch's longest frame, in patches (picks cuDNN's plans)
};

}  // namespace deltamoe
