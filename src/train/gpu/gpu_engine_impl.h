// GpuEngine::Impl, the engine's state (the device, the plan, the training state, the models bound
// to it, a parallel rank's layout and communicators), private to the engine: gpu_engine_setup.cc
// defines its setup (limits, memory plan, the recompute and kept choices, the state, the models,
// the checkpoint's upload), gpu_engine.cc the step, evaluation and GpuEngine's own methods.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/workspace_carver.h"
#include "model/device_param.h"
#include "model/gradient_phases.h"
#include "model/text/text_weights.h"
#include "model/vision/vision_weights.h"
#include "train/gpu/gpu_engine.h"

namespace deltamoe {

// A pinned slot for one micro-batch's loss readback.
struct LossSlot {
  float ce_mean;
  float pad;
  double aux;
};
// Pinned slots for the micro-batches' loss readbacks; a step with more micro-batches waits for
// the stream once per this many.
constexpr int kLossSlots = 1024;

struct GpuEngine::Impl {
  ModelConfig config;
  EngineOptions options;
  int device = 0;
  std::string gpu_name;
  cudaStream_t stream = nullptr;
  int64_t max_seqs = 0, max_image_tokens = 0, max_patches = 0;
  MemoryPlan plan;
  std::unique_ptr<DeviceTrainState> state;
  TextWeights text_weights;
  VisionWeights vision_weights;
  std::unique_ptr<GpuTextModel> text;
  std::unique_ptr<GpuVisionModel> vision;
  bool text_trained = false, vision_trained = false;
  bool experts_written_first = false;  // the routed experts' gradients are written by their first product
  bool lm_head_written_first = false;  // lm_head's gradient is written by the step's first loss chunk
  bool last_step_summed_expert_squares = false;
  // With experts_written_first: per layer the gate_up and down gradients' sums of squares
  // ([layers][2] doubles), then the products' scratch for forming them (begin_step_gradients).
  DeviceBuffer expert_squares;
  LossSlot* loss_slots = nullptr;  // pinned, kLossSlots
  size_t peak_used_bytes = 0;
  // One rank of a parallel job (null world: the plain engine).
  Communicator* world = nullptr;
  ParallelOptions parallel_options;
  // Rows this rank's experts may receive per micro-batch and layer (EP > 1): from
  // --expert_recv_headroom, or with auto grown into the memory the plan leaves (plan_and_allocate).
  int64_t expert_recv_rows = 0;
  ParamLayout full_layout;                   // every trained tensor whole (the checkpoint's view)
  std::vector<GradientPhase> phases;         // the backward's gradient phases (the layout's groups)
  std::unique_ptr<ParallelLayout> parallel;  // this rank's pieces
  std::unique_ptr<Communicator> ep_comm;     // expert parallel only
  std::unique_ptr<Communicator> expert_dp_comm;  // replicas of this rank's expert block (EP < world)

  ~Impl() {
    text.reset();
    vision.reset();
    state.reset();
    ep_comm.reset();
    expert_dp_comm.reset();
    if (loss_slots != nullptr) cudaFreeHost(loss_slots);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  void note_memory() {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    peak_used_bytes = std::max(peak_used_bytes, total_bytes - free_bytes);
  }

  // The parameter list with what each needs: trained by the freeze choice, fp32 values where the
  // models read them in fp32, the init rule of the table.
  std::vector<DeviceParamSpec> param_specs() const;

  // One rank of an expert-parallel job: each routed-expert stack becomes this rank's slice
  // [E_local, ...], and the trained slices go first, in the full layout's order (where
  // DeviceTrainState finds their gradients: the front of the state).
  std::vector<DeviceParamSpec> local_expert_specs(std::vector<DeviceParamSpec> specs) const;

  // Every trained tensor whole, in the checkpoint's order (the CPU engine's full layout), or the
  // parameter table's for random weights.
  ParamLayout trained_full_layout(const ModelCheckpoint* checkpoint) const;

  // The rank's layout and its communicators (before the plan: the text model's exchange buffers
  // depend on the expert-parallel group).
  void setup_parallel(const ModelCheckpoint* checkpoint);

  // The adapters' initial values (PEFT's init, or the values a resumed run restores over them).
  void upload_adapters();

  // The uploads copy from pageable memory: the last may still be landing when cudaMemcpy returns,
  // and the engine's stream does not wait for the legacy stream. Setup time: wait here.
  static void wait_for_uploads() { CUDA_CHECK(cudaDeviceSynchronize()); }

  // The adapter views of a weight module for bind_text_weights (none without LoRA).
  DeviceLoraLookup lora_lookup() const;

  // LoRA dropout: the widest input of a dense adapter in the tower or the text model (its scratch
  // rows); 0 without dropout.
  int64_t lora_dropout_max_in(bool vision) const;

  // The largest adapter rank on the vision tower (0: no adapter there, e.g. LoRA on the LLM only).
  int64_t vision_lora_rank() const;

  // The text model's options from the run's (recompute, kept intermediates, LoRA, the exchange).
  GpuModelOptions text_options() const;

  // ViT blocks recomputed in the backward: none unless the ViT trains (a frozen one keeps nothing).
  int64_t vision_recompute_blocks() const {
    return plan.vit_trained ? options.recompute.full_vision_blocks(config.vision.depth) : 0;
  }

  ModelBytes vision_plan() const;

  // --recompute auto: the fewest fully recomputed ViT blocks, then (with all of those) the fewest
  // decoder layers, first ones first, with which the plan fits; none when it fits as it is. A ViT
  // block holds much for the little it costs to rerun (design §1.4), so the tower goes first.
  // Leaves the options and plan.text / plan.vision as chosen; a run that does not fit even with
  // everything recomputed is refused by the caller with that plan.
  void choose_recompute(size_t available, const std::string& where);

  // What the backward would otherwise recompute, kept from the forward when the plan has room for
  // it (train/kept_intermediates.h): the routed experts' permuted inputs and gate/up rows and each GDN set's chunk
  // quantities and states. Under --recompute auto with nothing recomputed, else with the recompute
  // the user chose, so keeping never makes the run recompute more. Under expert parallelism the
  // rows are exchanged and recomputed, and the GDN forward is kept only if the plan fits with it
  // and with the exchange at its worst case (every rank's rows to one rank) under
  // --expert_recv_headroom auto: the receive headroom, which keeps a skewed micro-batch from
  // stopping the job, is never traded for speed (grow_expert_capacity then takes it there).
  void choose_kept(size_t available);

  // --expert_recv_headroom auto: what the plan leaves of `available` (after the recompute choice)
  // raises the expert exchange's receive capacity from its minimum towards the worst case, so that
  // a skewed micro-batch finds room rather than stopping the job. Logged with the headroom reached.
  void grow_expert_capacity(size_t available);

  // Limits, the plan, the refusal; then the state and the stream. Nothing is allocated on the
  // device before the plan has been checked.
  void plan_and_allocate(const ModelConfig& model_config, const EngineOptions& engine_options,
                         const ModelCheckpoint* checkpoint = nullptr);

  // A training step's gradients: zeroed, but for the routed experts' and lm_head's (build_models),
  // whose first product in the step writes them; after the micro-batches, those no backward
  // reached are zeroed (GpuTextModel::begin_gradient_step). In a step of one micro-batch,
  // where those gradients are final once written (no replicas sum them later), the products also
  // form their sums of squares, so that the norm need not read them back (4 bytes per expert
  // parameter); returns the sums' device array then (2 per decoder layer), else null.
  const double* begin_step_gradients(size_t micro_batches, double divisor);
  int64_t num_expert_square_sums() const { return 2 * config.text.num_hidden_layers; }
  size_t expert_square_sums_bytes() const {
    return align256(static_cast<size_t>(num_expert_square_sums()) * sizeof(double));
  }
  void end_step_gradients() {
    if (experts_written_first || lm_head_written_first) text->zero_unwritten_gradients();
  }

  // Binds the models to the state (after its values are in place).
  void build_models();

  // The checkpoint's weights into the state, one tensor at a time, with progress every 5 s.
  void upload_checkpoint(const ModelCheckpoint& checkpoint);

  double lora_dropout() const { return options.lora != nullptr ? options.lora->options.dropout : 0.0; }

  // Copies one micro-batch to the device and runs it: vision forward, text forward, then (when
  // anything of it trains) the backward, or the loss alone. The loss scalars go to a pinned slot.
  // micro_batch: the index in the step that keys LoRA dropout's masks with the run's seed and the
  // updates applied so far (the CPU engine's counters); -1 (evaluation): nothing is dropped.
  void run_batch(const DeviceBatch& batch, double ce_mean_weight, double aux_weight, bool backward, int slot,
                 int64_t micro_batch);

  uint64_t uploaded() const { return text->uploaded_bytes() + (vision ? vision->uploaded_bytes() : 0); }
};

}  // namespace deltamoe
