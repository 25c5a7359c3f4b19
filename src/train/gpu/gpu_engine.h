// GpuEngine: the trainer's TrainEngine on one CUDA device, composed from GpuTextModel and (VLMs)
// GpuVisionModel. Weights go up from the trainer's fp32 master buffer once per step, gradients come
// down into its flat host buffer once per micro-batch (the known cost; docs/training.md).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "optim/param_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

class GpuEngine : public TrainEngine {
 public:
  // Uploads every text and vision tensor of checkpoint (frozen ones stay as loaded); layout names
  // the trainable tensors (each must be a parameter of the model, checked). Activations and
  // workspaces are planned once for sizing (the trainer's token budget and sample cap).
  GpuEngine(const ModelCheckpoint& checkpoint, const ParamLayout& layout, const EngineSizing& sizing);
  ~GpuEngine() override;

  std::string device_name() const override;
  std::string accelerator_name() const override;
  void set_trainable_weights(const float* master) override;
  MicroBatchLoss forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight,
                                  float* grad) override;
  // Evaluation. Token accuracy is counted from downloaded logits when T x V is small (the demo),
  // else num_correct is -1; logits, when asked for, are always downloaded.
  MicroBatchLoss forward(const MicroBatch& batch, std::vector<float>* logits = nullptr) override;
  double training_flops(const MicroBatch& batch) const override;
  size_t peak_memory_bytes() const override;
  // Test hook: the experts the last pass chose per decoder layer (L entries of [T, K]; synchronises),
  // e.g. to pin the CPU engine's routing to them (CpuEngine::set_forced_routing).
  std::vector<std::vector<int32_t>> last_routing() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The most sequences one micro-batch may pack, from the trainer's plan: the sample cap when the
// batch is counted in samples, else tokens / kMinTokensPerSample (at least 64, at most tokens).
// A batch beyond it is refused with a message naming --micro_batch_size.
constexpr int64_t kMinTokensPerSample = 8;
int64_t planned_max_sequences(const EngineSizing& sizing);

// Registers GpuEngine with make_train_engine when a CUDA device answers; returns whether it did.
bool register_gpu_engine();

}  // namespace deltamoe
