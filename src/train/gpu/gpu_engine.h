// GpuEngine: the TrainEngine on one CUDA device. It owns the training state there
// (DeviceTrainState), the text model and (VLMs) the vision tower on one stream, and runs the
// optimizer step on the device: micro-batches accumulate gradients, the step reads back the losses
// and the gradient norm (its one host sync), then clips and updates. `train`, `parity --device
// cuda` and `bench` all run this engine.
// Built over a world (a device communicator) it is one rank of a parallel job, as CpuEngine is on
// the host: routed experts split over --expert_model_parallel_size ranks (each rank binds and
// trains its own experts only; tokens exchanged per layer), the dense parameters under ZeRO-2
// (gradients reduce-scattered per backward phase as the backward finishes it, master and moments
// sharded, updated bf16 weights all-gathered), losses and counts combined over the ranks as CpuEngine does.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/vision/gpu/gpu_vision_model.h"
#include "parallel/communicator.h"
#include "train/gpu/device_train_state.h"
#include "train/memory_plan.h"
#include "train/parallel_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

// One micro-batch as the models take it: labels already shifted, 3-D positions, the image rows.
// (train_step builds these from MicroBatch; parity from its inputs file, shifting per row as
// transformers does.)
struct DeviceBatch {
  std::vector<int64_t> ids;             // [T]
  std::vector<int64_t> shifted_labels;  // [T], -100 ignored
  std::vector<int32_t> cu_seqlens;      // [N + 1]
  std::vector<int64_t> positions;       // [3, T] (empty: text positions)
  // Images (none: text only): pixel rows [patches, patch_dim] in token order, their grids, and the
  // <|image_pad|> token rows the merged features fill.
  const float* pixel_values = nullptr;
  int64_t num_patches = 0;
  std::vector<std::array<int64_t, 3>> grid_thw;
  std::vector<int32_t> image_rows;
  int64_t num_supervised() const;
};

// Empty when the GPU engine can train these LoRA adapters; else why not (a target it has no
// kernels for: lm_head named in --target_modules).
std::string gpu_lora_refusal(const LoraAdapters& lora);

class GpuEngine : public TrainEngine {
 public:
  // The checkpoint's weights, streamed to the device one tensor at a time.
  GpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options);
  // Random weights by the parameter table's init rules, made on the device (the benchmark).
  GpuEngine(const ModelConfig& config, const EngineOptions& options, uint64_t seed);
  // One rank of a job over `world`: a device communicator (NcclComm, DeviceLoopbackComm, or any
  // backend taking device buffers on the engine's stream) that must outlive the engine. state()
  // holds this rank's pieces (ParallelLayout); train_step and evaluate are collectives over world
  // (every rank calls them, rank r with micro-batches g * world + r of the step one rank would
  // take). A world of one rank runs the same sharded path (NcclComm with one rank tests it).
  // LoRA is refused (it trains on one rank).
  GpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options, Communicator& world,
            const ParallelOptions& parallel);
  GpuEngine(const ModelConfig& config, const EngineOptions& options, uint64_t seed, Communicator& world,
            const ParallelOptions& parallel);
  ~GpuEngine() override;

  std::string device_name() const override;
  std::string accelerator_name() const override;
  size_t peak_memory_bytes() const override;
  StepResult train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) override;
  // Evaluation: forward and the loss only. Token accuracy is counted from downloaded logits when
  // T x V is small (the demo), else num_correct is -1; logits, when asked for, are always downloaded.
  MicroBatchLoss evaluate(const MicroBatch& batch, std::vector<float>* logits = nullptr) override;
  DeviceTrainState& state() override;

  // The plan the engine was built from (printed before step 1 unless options say not to).
  const MemoryPlan& memory_plan() const;
  // Whether the last train_step took the routed experts' share of the gradient norm from their
  // dW products (a step of one micro-batch; GpuTextModel::ExpertSquaresSink) rather than reading
  // those gradients back.
  bool last_step_summed_expert_squares() const;
  // Null on the plain one-rank engine.
  const ParallelLayout* parallel_layout() const override;

  // Parity and tests: zero the gradients; run one micro-batch's forward and backward with these
  // loss weights (d loss = ce_weight * mean CE + aux_weight * aux; gradients added to; LoRA dropout
  // as micro-batch 0 of the step); read them.
  void zero_gradients();
  MicroBatchLoss forward_backward(const DeviceBatch& batch, double ce_mean_weight, double aux_weight);
  std::vector<float> read_gradient(const std::string& name) const;
  GpuTextModel& text_model();
  // The experts the last pass chose per decoder layer (L entries of [T, K]; synchronises), e.g. to
  // pin the CPU engine's routing to them (CpuEngine::set_forced_routing).
  std::vector<std::vector<int32_t>> last_routing() const;
  // The device batch of a micro-batch (labels shifted inside each sample, the image rows found).
  DeviceBatch device_batch(const MicroBatch& batch) const;

 private:
  // train_step on one rank of a parallel job.
  StepResult train_step_parallel(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm);
  // The step's micro-batches, forward and backward, gradients accumulated on the device. Per
  // micro-batch i: supervised[i], tokens[i], and after the step's sync losses[2i] (its CE sum) and
  // losses[2i + 1] (its aux loss), read through collect_losses. `world` (null: one rank) gets the
  // activity labels.
  struct MicroBatchRun {
    std::vector<int64_t> supervised, tokens;
    std::vector<double> losses;
    double flops = 0;
    size_t collected = 0;  // loss slots read so far
  };
  MicroBatchRun run_micro_batches(const std::vector<MicroBatch>& batches, double ce_token_weight, double aux_weight,
                                  int64_t step);
  // Reads the loss slots of micro-batches [run.collected, end) (the stream must have passed them).
  void collect_losses(MicroBatchRun& run, size_t end) const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether a CUDA device answers (clears the error when none does).
bool cuda_device_available();

}  // namespace deltamoe
