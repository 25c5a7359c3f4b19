// The device memory one training engine needs, by kind, planned before anything is allocated: the
// training state (bf16 weights of every parameter, fp32 master, gradients and Adam moments of the
// trained ones, fp32 copies of frozen tensors read in fp32), the text model's and the vision
// tower's activations, workspaces and inputs, and a reserve for the CUDA runtime and libraries.
// A run that does not fit is refused before step 1 with the plan and what to change. The GPU
// engine plans with its models' exact byte counts; CPU builds (tests, `deltamoe plan`) with the
// same activation layouts and an estimate of the kernel workspaces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/config.h"
#include "train/train_engine.h"

namespace deltamoe {

// Bytes one model (text or vision) allocates for itself.
struct ModelBytes {
  size_t activations = 0, workspace = 0, inputs = 0;
  size_t total() const { return activations + workspace + inputs; }
};

struct MemoryPlan {
  // The limits it was planned for.
  int64_t max_tokens = 0;        // per micro-batch
  int64_t max_image_tokens = 0;  // merged <|image_pad|> tokens per micro-batch (0: text only)
  int64_t max_patches = 0;       // vision tower rows (max_image_tokens x merge^2)
  bool vit_trained = false, merger_trained = false;
  // RecomputeOptions::keep_expert_rows / keep_gdn_forward as planned (text activations).
  bool keep_expert_rows = false, keep_gdn_forward = false;
  // Bytes by kind.
  size_t weights = 0;     // bf16 working copies of every parameter
  size_t master = 0;      // master weights of the trained tensors: fp32, or 2-byte low halves where split
  size_t gradients = 0;   // gradients of the trained tensors (fp32; the routed experts' bf16)
  size_t moments = 0;     // AdamW m and v
  size_t frozen_f32 = 0;  // fp32 copies of frozen tensors the math reads in fp32 (sharded: of trained ones too)
  // One rank of a parallel job (ZeRO-2 on the device): its reduced gradient pieces, its pieces'
  // bf16 staging and one bucket's collective buffers (0 on one rank).
  size_t sharding = 0;
  ModelBytes text, vision;
  size_t reserve = 0;     // CUDA context, cuBLAS/cuDNN handles, allocator headroom

  size_t state() const { return weights + master + gradients + moments + frozen_f32 + sharding; }
  size_t total() const { return state() + text.total() + vision.total() + reserve; }
  // The plan as lines of "kind  GiB" (printed before step 1).
  std::string describe() const;
};

// The most sequences one micro-batch may pack: the sample cap when the batch is counted in samples,
// else tokens / kMinTokensPerSample (at least 64, at most tokens).
constexpr int64_t kMinTokensPerSample = 8;
int64_t planned_max_sequences(const EngineOptions& options);

// The most merged image tokens a micro-batch of `tokens` tokens can hold when no image has more
// than max_pixels pixels (0: no bound, every token could be an image token): images of P tokens
// each, plus their two marker tokens (<|vision_start|>, <|vision_end|>).
int64_t max_image_tokens_in(int64_t tokens, int64_t max_pixels, const VisionConfig& vision);

// Whether one GPU's engine keeps trained tensor `name`'s master split (optim/split_master.h): the
// routed experts' stacks in full training (under LoRA they are frozen), unless read in fp32.
bool master_kept_split(const std::string& name, bool lora, bool read_in_f32);

// The state's part of the plan: element counts of the parameter table split by the freeze choice,
// laid out as DeviceParams lays them out (tensors aligned to 64 elements).
// With lora (non-null) the base is frozen whole (bf16 weights and the fp32 copies it is read in) and
// the adapters' A and B (and --modules_to_save) are the trained tensors, as the engines hold them.
// expert_grad_dtype: the routed experts' gradients where their masters are split (bf16 or f32).
void plan_state_bytes(const ModelConfig& config, const FreezeOptions& freeze, DType moment_dtype, MemoryPlan* plan,
                      const LoraAdapters* lora = nullptr, DType expert_grad_dtype = DType::bf16);

// Estimates of the models' bytes for builds without the GPU models: the activation and input
// layouts are the GPU models' own (text_activations.h, vision_activations.h); the kernel
// workspaces are the largest terms of the step's kernels.
// recompute: the engine's (mixers: one set of mixer internals per layer type; layers: the first ones
// keep only their input); recompute_blocks: the first ViT blocks that keep only their input.
ModelBytes estimate_text_bytes(const TextConfig& config, int64_t max_tokens, int64_t max_seqs, int64_t max_image_rows,
                               int64_t loss_chunk_rows, const RecomputeOptions& recompute = {});
ModelBytes estimate_vision_bytes(const VisionConfig& config, int64_t max_patches, bool vit_trained,
                                 bool merger_trained, int64_t recompute_blocks = 0);

// The LoRA adapters' scratch of the GPU text model at rank r (GpuTextModel::planned_bytes with
// lora_rank r adds exactly this): the dense and shared-expert adapters' x A^T / dy B rows
// (shared_expert_lora_scratch_bytes) and the routed experts' adapter workspace, the larger of
// gate_up's and down's (moe_experts_lora_workspace_bytes: per-expert B copy, rank rows, the wide
// fp32 low-rank product, dB, the grouped GEMM's tile prefix). The formulas are restated here
// because CPU builds have no kernels; the GPU test checks both agree.
size_t estimate_text_lora_bytes(const TextConfig& config, int64_t max_tokens, int64_t rank);
// The vision tower's adapter scratch (GpuVisionModel::lora_scratch_bytes).
size_t estimate_vision_lora_bytes(int64_t max_patches, int64_t rank);

// "" when plan.total() fits in device_bytes; otherwise the refusal: the plan, both numbers and
// what to change (with what each change saves).
std::string memory_refusal(const MemoryPlan& plan, size_t device_bytes, const EngineOptions& options,
                           const std::string& device_name);

// The whole plan for a run of `options` on a model, with the estimated model bytes (CPU builds).
MemoryPlan plan_training_memory(const ModelConfig& config, const EngineOptions& options);

}  // namespace deltamoe
