// The CPU reference engine: the fp32 reference model (vision tower, multimodal embedding, text
// model) with its training state in host memory (HostTrainState: fp32 master and the CPU AdamW).
// Slow but exact; it is the spec the GPU engine is compared with.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "model/text/text_params.h"
#include "model/vision/trainable_parts.h"
#include "model/vision/vision_tower.h"
#include "optim/host_train_state.h"
#include "train/train_engine.h"

namespace deltamoe {

class CpuEngine : public TrainEngine {
 public:
  // Copies every model parameter of checkpoint to fp32; the tensors options.freeze leaves trainable
  // get their master weights in state() (frozen ones keep these values for the whole run). With
  // options.lora the base is frozen whole and the state holds the adapters (attached to the model's
  // parameter maps) and the --modules_to_save tensors.
  CpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options);

  std::string device_name() const override { return "cpu"; }
  StepResult train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) override;
  MicroBatchLoss evaluate(const MicroBatch& batch, std::vector<float>* logits = nullptr) override;
  HostTrainState& state() override { return state_; }

  // The building block of train_step, public for the accumulation tests: forward and backward of
  // one micro-batch; the gradient of ce_token_weight * CE_sum + aux_weight * aux is ADDED to grad
  // (state().layout().total_numel() values).
  MicroBatchLoss forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight, float* grad);
  // Test hook: the experts per decoder layer (L entries of [T, K]) that the next passes use instead
  // of the routers' top-k, e.g. another engine's choices; empty: the routers decide.
  void set_forced_routing(std::vector<std::vector<int32_t>> routing) { forced_routing_ = std::move(routing); }

 private:
  struct Pass;  // one forward's state, kept for its backward
  MicroBatchLoss run_forward(const MicroBatch& batch, Pass* pass, std::vector<float>* logits);
  // The model computes with the master weights of state_ (after a step or a restore).
  void use_master_weights();

  ModelConfig config_;
  std::string text_prefix_;
  double aux_coef_ = 0;
  HostTrainState state_;
  std::vector<float> grad_;     // the step's gradient over state_'s layout
  ParamMap text_params_;        // fp32, fused layout
  VisionParams vision_params_;  // fp32; empty for a text-only model
  TrainableParts trainable_;    // which parts have tensors in the layout: frozen parts skip their weight products
  std::vector<std::vector<int32_t>> forced_routing_;  // set_forced_routing; empty: none
};

}  // namespace deltamoe
