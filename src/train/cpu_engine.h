// The CPU reference engine: runs the fp32 reference model (vision tower, multimodal embedding, text
// model) on one packed micro-batch and adds the gradients of the trainable tensors to the flat
// buffer. Slow but exact; it is the spec the GPU engine is compared with.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "model/text/text_params.h"
#include "model/vision/trainable_parts.h"
#include "model/vision/vision_tower.h"
#include "optim/param_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

class CpuEngine : public TrainEngine {
 public:
  // Copies every model parameter of checkpoint to fp32 (frozen ones keep these values for the whole
  // run); layout names the trainable ones (each must exist in the checkpoint, checked).
  CpuEngine(const ModelCheckpoint& checkpoint, const ParamLayout& layout);

  std::string device_name() const override { return "cpu"; }
  void set_trainable_weights(const float* master) override;
  MicroBatchLoss forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight,
                                  float* grad) override;
  MicroBatchLoss forward(const MicroBatch& batch, std::vector<float>* logits = nullptr) override;
  // Test hook: the experts per decoder layer (L entries of [T, K]) that the next passes use instead
  // of the routers' top-k, e.g. another engine's choices; empty: the routers decide.
  void set_forced_routing(std::vector<std::vector<int32_t>> routing) { forced_routing_ = std::move(routing); }

 private:
  struct Pass;  // one forward's state, kept for its backward
  MicroBatchLoss run_forward(const MicroBatch& batch, Pass* pass, std::vector<float>* logits);

  ModelConfig config_;
  std::string text_prefix_;
  ParamLayout layout_;
  ParamMap text_params_;        // fp32, fused layout
  VisionParams vision_params_;  // fp32; empty for a text-only model
  TrainableParts trainable_;    // which parts have tensors in the layout: frozen parts skip their weight products
  std::vector<std::vector<int32_t>> forced_routing_;  // set_forced_routing; empty: none
};

}  // namespace deltamoe
