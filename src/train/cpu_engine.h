// The CPU reference engine: the fp32 reference model (vision tower, multimodal embedding, text
// model) with its training state in host memory (HostTrainState: fp32 master and the CPU AdamW).
// Slow but exact; it is the spec the GPU engine is compared with.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "model/text/text_params.h"
#include "model/vision/trainable_parts.h"
#include "model/vision/vision_tower.h"
#include "optim/grad_clip.h"
#include "optim/host_train_state.h"
#include "parallel/communicator.h"
#include "parallel/expert_dispatch.h"
#include "train/parallel_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

class CpuEngine : public TrainEngine {
 public:
  // Copies every model parameter of checkpoint to fp32; the tensors options.freeze leaves trainable
  // get their master weights in state() (frozen ones keep these values for the whole run). With
  // options.lora the base is frozen whole and the state holds the adapters (attached to the model's
  // parameter maps) and the --modules_to_save tensors.
  CpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options);
  // One rank of a job over `world` (which must outlive the engine): the routed experts split over
  // parallel.expert_parallel_size ranks, the dense parameters under ZeRO-2 (parallel_layout.h).
  // state() then holds this rank's pieces only; train_step and evaluate are collectives over world
  // (every rank calls them, each with its own micro-batches: those of rank r are micro-batches
  // g * world + r of the step a single rank would take, g = 0, 1, ...). A world of one rank is the
  // plain engine.
  CpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options, Communicator* world,
            const ParallelOptions& parallel);

  std::string device_name() const override { return "cpu"; }
  StepResult train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) override;
  MicroBatchLoss evaluate(const MicroBatch& batch, std::vector<float>* logits = nullptr) override;
  HostTrainState& state() override { return state_; }

  // The building block of train_step, public for the accumulation tests: forward and backward of
  // one micro-batch; the gradient of ce_token_weight * CE_sum + aux_weight * aux is ADDED to grad
  // (full_layout().total_numel() values; on a rank of an expert-parallel job only its own experts'
  // ranges are touched). A collective with expert parallelism. micro_batch is the micro-batch's index
  // in the step over all ranks (g * world + rank): with --lora_dropout it keys the dropout masks,
  // together with the optimizer's step count (model/lora/lora_dropout.h).
  MicroBatchLoss forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight, float* grad,
                                  int64_t micro_batch = 0);
  // Every trained tensor whole (on one rank, also the layout of state()).
  const ParamLayout& full_layout() const { return full_layout_; }
  // Null on a single rank.
  const ParallelLayout* parallel_layout() const override { return parallel_.get(); }
  // The last train_step's gradient over state()'s layout, divided by S and clipped (for tests).
  const std::vector<float>& step_gradient() const { return grad_; }
  // Test hook: the experts per decoder layer (L entries of [T, K]) that the next passes use instead
  // of the routers' top-k, e.g. another engine's choices; empty: the routers decide.
  void set_forced_routing(std::vector<std::vector<int32_t>> routing) { forced_routing_ = std::move(routing); }

 private:
  struct Pass;  // one forward's state, kept for its backward
  MicroBatchLoss run_forward(const MicroBatch& batch, Pass* pass, std::vector<float>* logits);
  // The model computes with the master weights of state_ (after a step or a restore).
  void use_master_weights();
  // Records `clip` in `result`; unless the norm is not finite (a skipped step), clips grad_ and steps
  // AdamW on the master weights. Returns whether the masters moved.
  bool clip_and_step(const GradClipResult& clip, double lr, StepResult& result);
  // train_step on several ranks (ZeRO-2 dense, expert parallel).
  StepResult train_step_parallel(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm);
  // All-gathers every rank's dense master pieces into the working weights (a collective).
  void gather_dense_weights();
  // Writes `count` values into the working weights of full-layout entry `full_entry` from element
  // `tensor_begin` on.
  void set_working_weights(int full_entry, int64_t tensor_begin, int64_t count, const float* values);

  ModelConfig config_;
  std::string text_prefix_;
  double aux_coef_ = 0;
  ParamLayout full_layout_;                   // every trained tensor whole
  Communicator* world_ = nullptr;             // null: one rank
  std::unique_ptr<ParallelLayout> parallel_;  // null: one rank
  std::unique_ptr<Communicator> ep_comm_;     // expert parallel only
  std::unique_ptr<Communicator> expert_dp_comm_;  // replicas of this rank's expert block (EP < world)
  std::unique_ptr<ExpertDispatcher> dispatcher_;
  HostTrainState state_;
  std::vector<float> grad_;     // the step's gradient over state_'s layout
  std::vector<float> micro_grad_;  // several ranks: one micro-batch's gradient over full_layout_
  ParamMap text_params_;        // fp32, fused layout
  VisionParams vision_params_;  // fp32; empty for a text-only model
  TrainableParts trainable_;    // which parts have tensors in the layout: frozen parts skip their weight products
  std::vector<std::vector<int32_t>> forced_routing_;  // set_forced_routing; empty: none
  std::shared_ptr<const LoraAdapters> lora_;  // the run's LoRA settings (dropout p, seed); null: full tuning
};

}  // namespace deltamoe
