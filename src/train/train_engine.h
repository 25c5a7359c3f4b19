// The device-agnostic face of a training engine. An engine owns the training state of the tensors it
// trains (bf16 working weights, fp32 master, fp32 gradients, AdamW moments) on its device; the
// trainer hands it the micro-batches of one optimizer step and the learning rate, and reaches the
// state only through TrainStateStore to save or resume. The CPU reference engine (cpu_engine.h) and
// the GPU engine (gpu/gpu_engine.h) implement the same contract, so `train`, `parity` and `bench`
// run one step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/packer.h"
#include "model/lora/lora_adapters.h"
#include "optim/adamw.h"
#include "optim/train_state.h"
#include "train/parallel_layout.h"
#include "train/recompute_options.h"
#include "train/trainable_params.h"

namespace deltamoe {

// What one micro-batch's forward pass gave.
struct MicroBatchLoss {
  double ce_sum = 0;           // cross-entropy summed over the supervised tokens (after the shift)
  int64_t num_supervised = 0;  // tokens whose shifted label is not -100
  double aux_loss = 0;         // router load-balancing loss of this forward pass, before its coefficient
  int64_t num_tokens = 0;
  // Supervised tokens whose highest logit is the label (token accuracy, as ms-swift's token_acc);
  // -1 when the engine does not compute it.
  int64_t num_correct = -1;
};

// What one optimizer step did.
struct StepResult {
  double ce_sum = 0;            // over all micro-batches
  int64_t num_supervised = 0;   // S: the divisor of the CE sum
  double aux_loss_sum = 0;      // sum over micro-batches of each one's aux loss
  int64_t num_micro_batches = 0;
  int64_t num_tokens = 0;
  int64_t num_correct = -1;     // -1: not computed
  double grad_norm = 0;         // global norm before clipping
  float clip_coef = 1.0f;
  bool skipped = false;         // non-finite norm: weights and moments untouched
  double flops = 0;             // model FLOPs of forward + backward (0: not reported)
  // Bytes copied host -> device and device -> host during the step (batches in, losses and the
  // norm out); the CPU engine reports 0.
  uint64_t host_to_device_bytes = 0, device_to_host_bytes = 0;
};

// What an engine must know beyond the checkpoint, fixed for the whole run.
struct EngineOptions {
  FreezeOptions freeze;
  // LoRA (--tuner_type lora): the adapters' initial values (or those of the checkpoint resumed);
  // then only they (and --modules_to_save) are trained and `freeze` is not used. Null: full tuning.
  std::shared_ptr<const LoraAdapters> lora;
  AdamWConfig adamw;
  // The routed experts' gradients (--expert_grad_dtype): bf16 (DeviceParamSpec::grad_bf16) or f32.
  // Where they are dense tensors of a ZeRO-2 job without expert parallelism they are f32 either way.
  DType expert_grad_dtype = DType::bf16;
  double aux_coef = 0;       // router load-balancing loss coefficient
  // Planning limits of one micro-batch, so that an engine that plans its memory once (the GPU
  // engine) never allocates inside a step.
  int64_t max_tokens = 0;         // token budget (0: unknown)
  int64_t max_samples = 0;        // most samples (0: limited by tokens only)
  int64_t max_image_pixels = 0;   // largest image area after resizing (--max_pixels; 0: unknown)
  // lm_head + cross-entropy rows per chunk (the logits never exist whole). Each chunk's weight
  // gradient reads and writes the fp32 [V, C] lm_head gradient (2 x 2 GB at Qwen3.5's 248,320 x
  // 2,048): 2,048 rows halve that traffic against 1,024 (~4 ms a step at 8,192 tokens on the H200)
  // for 1 GB of bf16 logits, about as much as the other largest workspaces of the step.
  int64_t loss_chunk_rows = 2048;
  // What the GPU engine reruns before the backward instead of keeping (docs/training.md,
  // "Recompute"; Megatron's names in cli/recompute_flags.h).
  RecomputeOptions recompute;
  // The device bytes the memory plan may use (0: what the device has free at start). Tests and
  // `deltamoe plan` set it to model a smaller device.
  size_t device_memory_bytes = 0;
  bool print_memory_plan = true;
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;

  // "cpu" or "cuda:<n>", for logs and the metrics file.
  virtual std::string device_name() const = 0;
  // The accelerator's model name (e.g. "NVIDIA H200"), which picks the default peak FLOP/s for
  // MFU; empty for the CPU.
  virtual std::string accelerator_name() const { return ""; }
  // Most device memory in use so far (bytes, CUDA context included); 0 when not measured.
  virtual size_t peak_memory_bytes() const { return 0; }

  // One optimizer step over these micro-batches (one global batch of this rank): forward and
  // backward of each, gradients accumulated on the engine's device; the loss is the token mean of
  // the CE over all their supervised tokens plus aux_coef times the mean aux loss (docs/training.md,
  // "One step"); then the global gradient norm, clipping to max_grad_norm (<= 0: none) and AdamW
  // with learning rate lr (times each tensor's multiplier). A non-finite norm skips the update.
  virtual StepResult train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) = 0;

  // Forward only (evaluation). When logits is not null it receives [T, V] fp32.
  virtual MicroBatchLoss evaluate(const MicroBatch& batch, std::vector<float>* logits = nullptr) = 0;

  // The training state, for saving and resuming (the only way the trainer touches it).
  virtual TrainStateStore& state() = 0;
  const TrainStateStore& state() const { return const_cast<TrainEngine*>(this)->state(); }
  // Who holds what on a rank of several (null on one rank): which of state()'s pieces a checkpoint
  // takes from this rank (train/rank_checkpoint.h).
  virtual const ParallelLayout* parallel_layout() const { return nullptr; }
};

// Labels of a packed micro-batch shifted inside each sample: shifted[i] = labels[i + 1] when token
// i + 1 belongs to the same sample, else -100 (a sample never predicts the next sample's first token).
std::vector<int64_t> shift_packed_labels(const MicroBatch& batch);

}  // namespace deltamoe
