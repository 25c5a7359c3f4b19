// GpuEngine (gpu_engine.h): setup (limits, memory plan, refusal, the state from a checkpoint or by
// the init rules, the models bound to it), the step, evaluation, and the parity hooks.
#include "train/gpu/gpu_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "core/kill_point.h"
#include "core/log.h"
#include "core/workspace_carver.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/token_scatter/token_scatter_cuda.h"
#include "model/gradient_phases.h"
#include "model/param_table.h"
#include "model/text/expert_exchange_size.h"
#include "model/text/text_weights.h"
#include "model/vision/vision_tower.h"
#include "model/vision/vision_weights.h"
#include "optim/grad_clip.h"
#include "parallel/control_plane.h"
#include "train/batch_plan.h"
#include "train/kept_intermediates.h"
#include "train/parallel_memory_plan.h"
#include "train/model_flops.h"
#include "train/trainable_params.h"

namespace deltamoe {

namespace {

constexpr int64_t kIgnore = -100;
// Evaluation downloads [T, V] fp32 logits to count the right argmaxes only up to this size
// (256 MiB: the demo's 1024 x 4096 is 16 MiB; a real vocabulary at 8k tokens would be 8 GiB).
constexpr int64_t kMaxAccuracyLogits = int64_t{1} << 26;
// Pinned slots for the micro-batches' loss readbacks; a step with more micro-batches waits for
// the stream once per this many.
constexpr int kLossSlots = 1024;

int64_t count_correct(const std::vector<float>& logits, const std::vector<int64_t>& shifted_labels, int64_t vocab) {
  int64_t correct = 0;
  for (size_t t = 0; t < shifted_labels.size(); ++t) {
    if (shifted_labels[t] == kIgnore) continue;
    const float* row = logits.data() + t * static_cast<size_t>(vocab);
    correct += std::max_element(row, row + vocab) - row == shifted_labels[t];
  }
  return correct;
}

double gib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

ModelBytes model_bytes(const GpuModelBytes& b) { return {b.activations, b.workspace, b.inputs}; }
ModelBytes model_bytes(const GpuVisionBytes& b) { return {b.activations, b.workspace, b.inputs}; }

struct LossSlot {
  float ce_mean;
  float pad;
  double aux;
};

}  // namespace

int64_t DeviceBatch::num_supervised() const {
  return std::count_if(shifted_labels.begin(), shifted_labels.end(), [](int64_t label) { return label != kIgnore; });
}

bool cuda_device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the error so later CUDA calls start clean
    return false;
  }
  return true;
}

std::string gpu_lora_refusal(const LoraAdapters& lora) {
  std::string examples;
  int64_t unsupported = 0;
  for (const LoraTarget& target : lora.targets) {
    if (gpu_applies_lora_adapter(target.module) || gpu_vision_applies_lora_adapter(target.module)) continue;
    if (++unsupported <= 3) examples += (examples.empty() ? "" : ", ") + target.module;
  }
  if (unsupported > 0) {
    return str_cat("the GPU engine applies LoRA adapters to every Linear of the text model and the vision tower ",
                   "but the output layer, and to the routed experts (all-linear and --target_parameters ",
                   "mlp.experts.gate_up_proj mlp.experts.down_proj); ", unsupported, " of the ", lora.targets.size(),
                   " targets have no GPU kernels (", examples, unsupported > 3 ? ", ..." : "",
                   "; --modules_to_save lm_head trains the output layer whole)");
  }
  return "";
}

namespace {

void check_gpu_lora(const EngineOptions& options) {
  if (options.lora == nullptr) return;
  const std::string why = gpu_lora_refusal(*options.lora);
  CHECK(why.empty(), "gpu engine: ", why, "; train them on the CPU reference (--device cpu)");
}

}  // namespace

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
  std::vector<DeviceParamSpec> param_specs() const {
    std::set<std::string> read_in_f32 = text_params_read_in_f32(config.text, config.text_prefix());
    if (config.has_vision)
      for (const std::string& name : vision_params_read_in_f32(config.vision, kVisionPrefix)) read_in_f32.insert(name);
    std::vector<DeviceParamSpec> specs;
    for (const ParamSpec& p : build_param_table(config)) {
      DeviceParamSpec spec;
      spec.name = p.name;
      spec.shape = p.shape.to_vector();
      spec.trained = options.lora == nullptr && !is_frozen(p.name, options.freeze);  // LoRA: the base frozen
      spec.needs_f32 = read_in_f32.count(p.name) != 0;
      spec.init = p.init;
      spec.init_std = p.component == Component::vision ? config.vision.initializer_range : config.text.initializer_range;
      // The trained routed experts (the bulk of the parameters, read in bf16 only) keep their
      // master split into the bf16 weight and a low half (optim/split_master.h): AdamW moves 20
      // bytes a parameter instead of 22. On one GPU, and on a rank of an expert-parallel job for
      // its own slices (local_expert_specs); the sharded state keeps the dense pieces' fp32 masters.
      spec.master_split = spec.trained && parallel == nullptr &&
                          master_kept_split(p.name, options.lora != nullptr, spec.needs_f32);
      // The same tensors keep bf16 gradients unless --expert_grad_dtype f32 (DeviceParamSpec::grad_bf16).
      spec.grad_bf16 = spec.master_split && options.expert_grad_dtype == DType::bf16;
      specs.push_back(std::move(spec));
    }
    if (options.lora != nullptr) {
      // The adapters, then the --modules_to_save tensors (trained whole): lora.trained_names()
      // order, the layout a LoRA checkpoint's state has.
      const int64_t rank = options.lora->options.rank;
      std::vector<DeviceParamSpec> trained;
      for (const LoraTarget& target : options.lora->targets) {
        trained.push_back({target.a_name(), target.a_shape(rank), true, false, InitKind::zeros, 0.0});
        trained.push_back({target.b_name(), target.b_shape(rank), true, false, InitKind::zeros, 0.0});
      }
      for (const std::string& name : options.lora->modules_to_save) {
        auto it = std::find_if(specs.begin(), specs.end(), [&](const DeviceParamSpec& spec) { return spec.name == name; });
        CHECK(it != specs.end(), "train: --modules_to_save names '", name, "', which the model lacks");
        it->trained = true;
        trained.push_back(std::move(*it));
        specs.erase(it);
      }
      for (DeviceParamSpec& spec : trained) specs.push_back(std::move(spec));
    }
    if (parallel != nullptr && parallel->expert_parallel_size() > 1) return local_expert_specs(std::move(specs));
    return specs;
  }

  // One rank of an expert-parallel job: each routed-expert stack becomes this rank's slice
  // [E_local, ...], and the trained slices go first, in the full layout's order (where
  // DeviceTrainState finds their gradients: the front of the state).
  std::vector<DeviceParamSpec> local_expert_specs(std::vector<DeviceParamSpec> specs) const {
    const int64_t E = config.text.num_experts, local = parallel->experts_per_rank();
    std::vector<DeviceParamSpec> experts, rest;
    for (DeviceParamSpec& spec : specs) {
      if (!is_routed_expert_tensor(spec.name)) {
        rest.push_back(std::move(spec));
        continue;
      }
      CHECK(!spec.shape.empty() && spec.shape[0] == E, "train: '", spec.name, "' does not lead with the ", E,
            " experts");
      int64_t numel = 1;
      for (const int64_t d : spec.shape) numel *= d;
      spec.full_numel = numel;
      spec.full_first = parallel->first_local_expert() * (numel / E);
      spec.shape[0] = local;
      spec.master_split = spec.trained && master_kept_split(spec.name, options.lora != nullptr, spec.needs_f32);
      spec.grad_bf16 = spec.master_split && options.expert_grad_dtype == DType::bf16;
      (spec.trained ? experts : rest).push_back(std::move(spec));
    }
    std::vector<DeviceParamSpec> ordered;
    for (const auto& [state_index, full_index] : parallel->expert_pieces()) {
      const std::string& name = full_layout.entry(full_index).name;
      auto it = std::find_if(experts.begin(), experts.end(), [&](const DeviceParamSpec& x) { return x.name == name; });
      CHECK(it != experts.end(), "train: the layout's expert tensor '", name, "' is not trained on the device");
      ordered.push_back(std::move(*it));
      experts.erase(it);
    }
    CHECK(experts.empty(), "train: ", experts.size(), " trained expert tensors are missing from the layout");
    for (DeviceParamSpec& spec : rest) ordered.push_back(std::move(spec));
    return ordered;
  }

  // Every trained tensor whole, in the checkpoint's order (the CPU engine's full layout), or the
  // parameter table's for random weights.
  ParamLayout trained_full_layout(const ModelCheckpoint* checkpoint) const {
    if (checkpoint != nullptr) return trainable_layout(*checkpoint, options.freeze);
    ParamLayout layout;
    for (const ParamSpec& p : build_param_table(config))
      if (!is_frozen(p.name, options.freeze)) layout.add(p.name, p.shape.to_vector());
    CHECK(layout.num_tensors() > 0, "train: every parameter is frozen; nothing would be trained");
    return layout;
  }

  // The rank's layout and its communicators (before the plan: the text model's exchange buffers
  // depend on the expert-parallel group).
  void setup_parallel(const ModelCheckpoint* checkpoint) {
    CHECK(options.lora == nullptr, "train: --tuner_type lora on ", world->size(), " ranks is not supported by the ",
          "GPU engine (LoRA trains on one rank: the adapters are small enough for one device)");
    full_layout = trained_full_layout(checkpoint);
    phases = backward_gradient_phases(config);
    parallel = std::make_unique<ParallelLayout>(full_layout, world->rank(), world->size(), config.text.num_experts,
                                                parallel_options, &phases);
    const int ep = parallel->expert_parallel_size(), rank = world->rank();
    if (ep > 1) {
      // Consecutive groups of EP ranks exchange tokens; the replicas of one expert block (same rank
      // mod EP) all-reduce its gradient (as CpuEngine).
      ep_comm = world->split(rank / ep, rank, "ep");
      if (parallel->expert_replicas() > 1) expert_dp_comm = world->split(rank % ep, rank, "expert_dp");
    }
  }

  // The adapters' initial values (PEFT's init, or the values a resumed run restores over them).
  void upload_adapters() {
    if (options.lora == nullptr) return;
    for (const LoraTarget& target : options.lora->targets) {
      for (const std::string& name : {target.a_name(), target.b_name()}) {
        const HostTensor values = options.lora->tensors.at(name).to_f32();
        state->params().upload(name, 0, values.numel(), values.data(), DType::f32);
      }
    }
    wait_for_uploads();
  }

  // The uploads copy from pageable memory: the last may still be landing when cudaMemcpy returns,
  // and the engine's stream does not wait for the legacy stream. Setup time: wait here.
  static void wait_for_uploads() { CUDA_CHECK(cudaDeviceSynchronize()); }

  // The adapter views of a weight module for bind_text_weights (none without LoRA).
  DeviceLoraLookup lora_lookup() const {
    if (options.lora == nullptr) return nullptr;
    return [this](const std::string& module) {
      DeviceLoraViews views;
      for (size_t index = 0; index < options.lora->targets.size(); ++index) {
        const LoraTarget& target = options.lora->targets[index];
        if (target.module != module) continue;
        const DeviceParam a = state->params().param(target.a_name(), false);
        const DeviceParam b = state->params().param(target.b_name(), false);
        views = DeviceLoraViews{a.w, b.w, a.grad, b.grad, options.lora->options.rank,
                                static_cast<float>(options.lora->options.scaling())};
        views.index = static_cast<int64_t>(index);  // keys the adapter's dropout mask, as on the CPU
      }
      return views;
    };
  }

  // LoRA dropout: the widest input of a dense adapter in the tower or the text model (its scratch
  // rows); 0 without dropout.
  int64_t lora_dropout_max_in(bool vision) const {
    if (options.lora == nullptr || options.lora->options.dropout == 0) return 0;
    return lora_dense_max_in_features(options.lora->targets, vision);
  }

  // The largest adapter rank on the vision tower (0: no adapter there, e.g. LoRA on the LLM only).
  int64_t vision_lora_rank() const {
    if (options.lora == nullptr) return 0;
    for (const LoraTarget& target : options.lora->targets)
      if (param_group(target.module + ".weight") != ParamGroup::llm) return options.lora->options.rank;
    return 0;
  }

  GpuModelOptions text_options() const {
    GpuModelOptions o;
    o.max_tokens = options.max_tokens;
    o.max_seqs = max_seqs;
    o.loss_chunk_rows = std::min(options.loss_chunk_rows, options.max_tokens);
    o.max_image_rows = max_image_tokens;
    o.recompute_mixers = options.recompute.mixers;
    o.recompute_layers = options.recompute.full_layers(config.text.num_hidden_layers);
    o.keep_expert_rows = options.recompute.keep_expert_rows;
    o.keep_gdn_forward = options.recompute.keep_gdn_forward;
    o.lora_rank = options.lora != nullptr ? options.lora->options.rank : 0;
    o.lora_dropout_max_in = lora_dropout_max_in(false);
    o.expert_parallel = ep_comm.get();
    o.expert_recv_rows = ep_comm != nullptr ? expert_recv_rows : 0;
    return o;
  }

  // ViT blocks recomputed in the backward: none unless the ViT trains (a frozen one keeps nothing).
  int64_t vision_recompute_blocks() const {
    return plan.vit_trained ? options.recompute.full_vision_blocks(config.vision.depth) : 0;
  }

  ModelBytes vision_plan() const {
    return model_bytes(GpuVisionModel::planned_bytes(config.vision, max_patches, max_image_tokens, plan.vit_trained,
                                                     plan.merger_trained, vision_lora_rank(),
                                                     vision_recompute_blocks(), lora_dropout_max_in(true)));
  }

  // --recompute auto: the fewest fully recomputed ViT blocks, then (with all of those) the fewest
  // decoder layers, first ones first, with which the plan fits; none when it fits as it is. A ViT
  // block holds much for the little it costs to rerun (design §1.4), so the tower goes first.
  // Leaves the options and plan.text / plan.vision as chosen; a run that does not fit even with
  // everything recomputed is refused by the caller with that plan.
  void choose_recompute(size_t available, const std::string& where) {
    const int64_t layers = config.text.num_hidden_layers;
    const int64_t blocks = max_patches > 0 && plan.vit_trained ? config.vision.depth : 0;
    options.recompute.layers = 0;
    plan.text = model_bytes(GpuTextModel::planned_bytes(config.text, text_options()));
    bool fits = false;
    for (int64_t n = 0; n <= blocks && !fits; ++n) {
      options.recompute.vision_blocks = n;
      if (max_patches > 0) plan.vision = vision_plan();
      fits = memory_refusal(plan, available, options, where).empty();
    }
    for (int64_t n = 1; n <= layers && !fits; ++n) {
      options.recompute.layers = n;
      plan.text = model_bytes(GpuTextModel::planned_bytes(config.text, text_options()));
      fits = memory_refusal(plan, available, options, where).empty();
    }
    if (options.recompute.vision_blocks > 0) {
      log_info("train: --recompute auto: the first ", options.recompute.vision_blocks, " of ", config.vision.depth,
               " vision blocks are recomputed in the backward (keeping their inputs only) so that the run fits");
    }
    if (options.recompute.layers > 0) {
      log_info("train: --recompute auto: the first ", options.recompute.layers, " of ", layers,
               " decoder layers are recomputed in the backward (keeping their inputs only) so that the run fits");
    }
  }

  // What the backward would otherwise recompute, kept from the forward when the plan has room for
  // it (train/kept_intermediates.h): the routed experts' permuted inputs and gate/up rows and each GDN set's chunk
  // quantities and states. Under --recompute auto with nothing recomputed, else with the recompute
  // the user chose, so keeping never makes the run recompute more. Under expert parallelism the
  // rows are exchanged and recomputed, and the GDN forward is kept only if the plan fits with it
  // and with the exchange at its worst case (every rank's rows to one rank) under
  // --expert_recv_headroom auto: the receive headroom, which keeps a skewed micro-batch from
  // stopping the job, is never traded for speed (grow_expert_capacity then takes it there).
  void choose_kept(size_t available) {
    const RecomputeOptions chosen = options.recompute;
    const int64_t layers = config.text.num_hidden_layers;
    // Layers that keep rows: those not fully recomputed (a rerun does not run the experts).
    const int64_t rows_layers = ep_comm != nullptr ? 0 : chosen.automatic ? layers : layers - chosen.full_layers(layers);
    const int64_t gdn_layers = config.text.num_layers_of(LayerType::linear_attention);
    const int64_t recv_rows = expert_recv_rows;
    // (An explicit --expert_recv_headroom fixes the receive rows: they are what the run can use.)
    if (ep_comm != nullptr && parallel_options.expert_recv_headroom == 0)
      expert_recv_rows = expert_recv_worst_rows(config.text, ep_comm->size(), options.max_tokens);
    auto plan_with = [&](const KeptIntermediates& kept) {
      options.recompute = chosen;
      options.recompute.keep_expert_rows = kept.expert_rows;
      options.recompute.keep_gdn_forward = kept.gdn_forward;
      const bool any = kept.expert_rows || kept.gdn_forward;
      if (any && options.recompute.automatic) options.recompute.layers = options.recompute.vision_blocks = 0;
      plan.keep_expert_rows = kept.expert_rows;
      plan.keep_gdn_forward = kept.gdn_forward;
      plan.text = model_bytes(GpuTextModel::planned_bytes(config.text, text_options()));
      if (max_patches > 0) plan.vision = vision_plan();
      return plan.total();
    };
    const KeptIntermediates kept = choose_kept_intermediates(rows_layers, gdn_layers, available, plan_with);
    expert_recv_rows = recv_rows;
    plan_with(kept);
    if (kept.expert_rows || kept.gdn_forward) {
      log_info("train: kept from the forward for the backward: ",
               kept.expert_rows ? "the routed experts' permuted inputs and gate/up rows" : "",
               kept.expert_rows && kept.gdn_forward ? " and " : "",
               kept.gdn_forward ? "the gated delta rule's chunk quantities and states" : "",
               !kept.expert_rows && rows_layers > 0 ? " (the experts' rows are recomputed: no room)" : "",
               !kept.gdn_forward && gdn_layers > 0 ? " (the gated delta rule's are recomputed: no room)" : "");
    } else if (rows_layers > 0 || gdn_layers > 0) {
      log_info("train: nothing the backward recomputes is kept from the forward (the plan has no room",
               ep_comm != nullptr ? " with the expert exchange at its worst case)" : ")");
    }
  }

  // --expert_recv_headroom auto: what the plan leaves of `available` (after the recompute choice)
  // raises the expert exchange's receive capacity from its minimum towards the worst case, so that
  // a skewed micro-batch finds room rather than stopping the job. Logged with the headroom reached.
  void grow_expert_capacity(size_t available) {
    const TextConfig& text = config.text;
    const int ep = ep_comm->size();
    if (parallel_options.expert_recv_headroom == 0 && plan.total() < available) {
      const size_t now = expert_exchange_bytes(text, ep, options.max_tokens, expert_recv_rows);
      expert_recv_rows = expert_recv_rows_within(text, ep, options.max_tokens, expert_recv_rows,
                                                 now + (available - plan.total()));
      plan.text = model_bytes(GpuTextModel::planned_bytes(text, text_options()));
    }
    log_info("train: expert exchange: up to ", expert_recv_rows, " received rows per layer (",
             static_cast<double>(expert_recv_rows) / static_cast<double>(expert_recv_mean_rows(text, options.max_tokens)),
             "x the mean, worst case ", ep, "x; --expert_recv_headroom ",
             parallel_options.expert_recv_headroom == 0 ? std::string("auto") : str_cat(parallel_options.expert_recv_headroom),
             ")");
  }

  // Limits, the plan, the refusal; then the state and the stream. Nothing is allocated on the
  // device before the plan has been checked.
  void plan_and_allocate(const ModelConfig& model_config, const EngineOptions& engine_options,
                         const ModelCheckpoint* checkpoint = nullptr) {
    config = model_config;
    options = engine_options;
    CHECK(!config.tie_word_embeddings && !config.text.tie_word_embeddings,
          "train: tie_word_embeddings is not supported (Qwen3.5-MoE unties lm_head)");
    CHECK(options.max_tokens > 0, "train: the GPU engine needs the micro-batch token budget");
    if (config.has_vision) {
      CHECK(config.vision.out_hidden_size == config.text.hidden_size, "train: vision out_hidden_size ",
            config.vision.out_hidden_size, " differs from the text hidden size ", config.text.hidden_size);
    }
    CUDA_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    gpu_name = prop.name;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));  // also creates the context
    max_seqs = planned_max_sequences(options);
    const int64_t merge = config.vision.spatial_merge_size * config.vision.spatial_merge_size;
    max_image_tokens = config.has_vision ? max_image_tokens_in(options.max_tokens, options.max_image_pixels,
                                                               config.vision)
                                         : 0;
    max_patches = max_image_tokens * merge;

    // What is kept from the forward for the backward is the engine's choice (choose_kept).
    options.recompute.keep_expert_rows = options.recompute.keep_gdn_forward = false;
    plan.max_tokens = options.max_tokens;
    plan.max_image_tokens = max_image_tokens;
    plan.max_patches = max_patches;
    if (world != nullptr) {
      setup_parallel(checkpoint);
      plan_rank_state_bytes(config, options.freeze, options.adamw.moment_dtype, world->size(), parallel_options, &plan,
                            options.expert_grad_dtype);
    } else {
      plan_state_bytes(config, options.freeze, options.adamw.moment_dtype, &plan, options.lora.get(),
                       options.expert_grad_dtype);
    }
    const int64_t layers = config.text.num_hidden_layers;
    CHECK(options.recompute.full_layers(layers) >= 0 && options.recompute.full_layers(layers) <= layers,
          "train: --recompute_num_layers ", options.recompute.layers, " is more than the model's ", layers,
          " decoder layers");
    if (ep_comm != nullptr) {
      expert_recv_rows = expert_recv_rows_for(config.text, ep_comm->size(), options.max_tokens,
                                              parallel_options.expert_recv_headroom);
    }
    plan.text = model_bytes(GpuTextModel::planned_bytes(config.text, text_options()));
    if (max_patches > 0) plan.vision = vision_plan();
    plan.reserve = size_t{1} << 30;
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const size_t available = options.device_memory_bytes > 0 ? options.device_memory_bytes : free_bytes;
    const std::string where = str_cat("cuda:", device, " (", gpu_name, ")");
    choose_kept(available);
    if (options.recompute.automatic && !options.recompute.keep_expert_rows && !options.recompute.keep_gdn_forward)
      choose_recompute(available, where);
    if (ep_comm != nullptr) grow_expert_capacity(available);
    const std::string refusal = memory_refusal(plan, available, options, where);
    CHECK(refusal.empty(), refusal);
    if (options.print_memory_plan) {
      log_info("train: memory plan on ", where, ", ", gib(available), " GiB available:\n", plan.describe());
    }

    state = world != nullptr ? std::make_unique<DeviceTrainState>(param_specs(), options.adamw, stream, *parallel, *world,
                                                                  expert_dp_comm.get(), phases)
                             : std::make_unique<DeviceTrainState>(param_specs(), options.adamw, stream);
    loss_slots = static_cast<LossSlot*>(pinned_malloc(sizeof(LossSlot) * kLossSlots, "gpu engine: loss slots"));
  }

  // A training step's gradients: zeroed, but for the routed experts' and lm_head's (build_models),
  // whose first product in the step writes them; after the micro-batches, those no backward
  // reached are zeroed (GpuTextModel::begin_gradient_step). In a step of one micro-batch,
  // where those gradients are final once written (no replicas sum them later), the products also
  // form their sums of squares, so that the norm need not read them back (4 bytes per expert
  // parameter); returns the sums' device array then (2 per decoder layer), else null.
  const double* begin_step_gradients(size_t micro_batches, double divisor) {
    state->zero_gradients(experts_written_first || lm_head_written_first);
    if (!experts_written_first) {
      if (lm_head_written_first) text->begin_gradient_step();
      return nullptr;
    }
    if (micro_batches != 1 || !state->expert_sums_usable()) {
      text->begin_gradient_step();
      return nullptr;
    }
    GpuTextModel::ExpertSquaresSink sink;
    sink.sums = expert_squares.as<double>();
    sink.divisor = divisor;
    sink.scratch = expert_squares.as<char>() + expert_square_sums_bytes();
    text->begin_gradient_step(&sink);
    return sink.sums;
  }
  int64_t num_expert_square_sums() const { return 2 * config.text.num_hidden_layers; }
  size_t expert_square_sums_bytes() const {
    return align256(static_cast<size_t>(num_expert_square_sums()) * sizeof(double));
  }
  void end_step_gradients() {
    if (experts_written_first || lm_head_written_first) text->zero_unwritten_gradients();
  }

  // Binds the models to the state (after its values are in place).
  void build_models() {
    const DeviceParamLookup lookup = state->params().lookup();
    text_weights = bind_text_weights(config.text, config.text_prefix(), lookup, lora_lookup());
    text = std::make_unique<GpuTextModel>(config.text, text_weights, text_options(), stream);
    text_trained = text_weights.any_trained();
    const GradientReadyHook gradients_ready = [this](GradientPhaseId phase) { state->gradients_ready(phase); };
    if (state->sharded()) text->set_gradient_ready_hook(gradients_ready);
    // The trained routed experts' gradients (the largest share of the state) are written by the
    // step's first product into them instead of being zeroed and then added to. Not under ZeRO-2
    // without expert parallelism: there the expert stacks are dense tensors whose gradients share
    // the region each backward phase reduce-scatters and zeroes, so they add like every other.
    std::vector<std::string> written_first;
    const bool experts_own_gradients = parallel == nullptr || parallel->expert_parallel_size() > 1;
    for (const DeviceParamSpec& spec : param_specs()) {
      if (experts_own_gradients && spec.trained && is_routed_expert_tensor(spec.name))
        written_first.push_back(spec.name);
    }
    // lm_head's (2 GB in fp32 at Qwen3.5's vocabulary) likewise, by the step's first loss chunk: on
    // one GPU, where it is its own memory (under data parallelism it is reduced with the rest).
    std::vector<std::string> lm_head_written;
    const DeviceParam& lm_head = text_weights.lm_head;
    if (world == nullptr && lm_head.grad != nullptr) lm_head_written.push_back("lm_head.weight");
    state->params().set_written_first(written_first, lm_head_written);
    experts_written_first = !written_first.empty();
    lm_head_written_first = !lm_head_written.empty();
    text->set_lm_head_gradient_written_first(lm_head_written_first);
    if (experts_written_first) expert_squares = DeviceBuffer(expert_square_sums_bytes() + kWeightGradSquaresScratchBytes);
    if (max_patches > 0) {
      vision_weights = bind_vision_weights(config.vision, kVisionPrefix, lookup, lora_lookup());
      vision = std::make_unique<GpuVisionModel>(config.vision, vision_weights, max_patches, max_image_tokens, stream,
                                                vision_recompute_blocks(), lora_dropout_max_in(true));
      vision_trained = vision_weights.vit_trained() || vision_weights.merger_trained();
      if (state->sharded()) vision->set_gradient_ready_hook(gradients_ready);
    }

    CUDA_CHECK(cudaStreamSynchronize(stream));
    note_memory();
    const DeviceParamBytes bytes = state->params().bytes();
    const std::string rank_note =
        world != nullptr ? str_cat(" (rank ", world->rank(), " of ", world->size(), ", expert parallel ",
                                   parallel->expert_parallel_size(), ", ZeRO-2 step buffers ",
                                   gib(state->sharded_step_bytes()), " GiB)")
                         : std::string();
    log_info("train: GPU engine on cuda:", device, " (", gpu_name, ")", rank_note, ": ", state->layout().num_tensors(),
             " trained tensors; weights ", gib(bytes.weights), " GiB, master ", gib(state->master_bytes()), ", gradients ",
             gib(bytes.gradients), ", moments ", gib(state->moment_bytes()), ", fp32 copies ", gib(bytes.frozen_f32),
             ", text ", gib(text->bytes().total()), ", vision ", vision ? gib(vision->bytes().total()) : 0.0,
             " GiB; ", gib(peak_used_bytes), " GiB in use");
  }

  void upload_checkpoint(const ModelCheckpoint& checkpoint) {
    size_t total = 0, done = 0;
    for (const ParamSpec& spec : build_param_table(config)) {
      const auto it = checkpoint.params.find(spec.name);
      CHECK(it != checkpoint.params.end(), "train: the checkpoint has no tensor '", spec.name, "'");
      CHECK(it->second.shape() == spec.shape, "train: tensor '", spec.name, "' is ", it->second.shape().str(),
            " in the checkpoint, the model needs ", spec.shape.str());
      total += it->second.nbytes();
    }
    auto last_report = std::chrono::steady_clock::now();
    for (const ParamSpec& spec : build_param_table(config)) {
      const StoredTensor& tensor = checkpoint.params.at(spec.name);
      const DType dtype = tensor.dtype();
      const size_t element = dtype_size(dtype);
      int64_t first = 0;
      tensor.for_each_piece([&](const uint8_t* bytes, size_t nbytes) {
        CHECK(nbytes % element == 0, "train: tensor '", spec.name, "' streams in pieces that split an element");
        const int64_t count = static_cast<int64_t>(nbytes / element);
        state->params().upload(spec.name, first, count, bytes, dtype);
        if (state->sharded()) state->upload_master(spec.name, first, count, bytes, dtype);
        first += count;
        done += nbytes;
        if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(5)) {
          log_info("train: weights to the GPU: ", static_cast<int>(100.0 * static_cast<double>(done) /
                                                                   static_cast<double>(std::max<size_t>(total, 1))),
                   "% (", gib(done), " of ", gib(total), " GiB)");
          last_report = std::chrono::steady_clock::now();
        }
      });
    }
    wait_for_uploads();
  }

  // Copies one micro-batch to the device and runs it: vision forward, text forward, then (when
  // anything of it trains) the backward, or the loss alone. The loss scalars go to a pinned slot.
  double lora_dropout() const { return options.lora != nullptr ? options.lora->options.dropout : 0.0; }

  // micro_batch: the index in the step that keys LoRA dropout's masks with the run's seed and the
  // updates applied so far (the CPU engine's counters); -1 (evaluation): nothing is dropped.
  void run_batch(const DeviceBatch& batch, double ce_mean_weight, double aux_weight, bool backward, int slot,
                 int64_t micro_batch) {
    const int64_t T = static_cast<int64_t>(batch.ids.size());
    CHECK(T > 0, "train: empty micro-batch");
    CHECK(T <= options.max_tokens, "train: a micro-batch of ", T, " tokens, the GPU engine was planned for at most ",
          options.max_tokens, " (the micro-batch token budget)");
    const int64_t num_seqs = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
    CHECK(num_seqs <= max_seqs, "train: a micro-batch of ", num_seqs, " samples, the GPU engine was planned for at ",
          "most ", max_seqs, " (", kMinTokensPerSample, " tokens per sample on average); cap the samples per ",
          "micro-batch with --micro_batch_size");
    const bool has_images = !batch.grid_thw.empty();
    CHECK(!has_images || vision, "train: the micro-batch has ", batch.grid_thw.size(), " image(s) but the model (",
          config.model_type, ") has no vision tower");
    if (has_images) {
      CHECK(static_cast<int64_t>(batch.image_rows.size()) <= max_image_tokens, "train: a micro-batch with ",
            batch.image_rows.size(), " image tokens; the vision tower was planned for at most ", max_image_tokens,
            " (from --micro_batch_tokens and --max_pixels)");
      vision->set_images(batch.pixel_values, batch.num_patches, batch.grid_thw);
    }
    text->set_image_rows(batch.image_rows);
    text->set_batch(batch.ids, batch.shifted_labels, batch.cu_seqlens, batch.positions);
    text->set_loss_weights(static_cast<float>(ce_mean_weight), static_cast<float>(aux_weight));
    if (lora_dropout() > 0) {
      LoraDropoutKey key;
      if (backward && micro_batch >= 0) {
        key = LoraDropoutKey{lora_dropout(), options.lora->seed, static_cast<uint64_t>(state->adam_step()),
                             static_cast<uint64_t>(micro_batch)};
      }
      if (lora_dropout_max_in(false) > 0) text->set_lora_dropout(key);
      if (vision != nullptr && lora_dropout_max_in(true) > 0) vision->set_lora_dropout(key);
    }
    ComponentTimer& timer = text->timer();
    if (has_images) {
      timer.mark(StepComponent::vision, stream);
      vision->forward(text->image_embeddings());
    }
    const bool vision_backward = has_images && vision_trained;
    // A parallel rank reduce-scatters each phase's gradients as the models report it finished
    // (gradients_ready), and whatever was not reported at the end: the same collectives on every
    // rank, whether or not this micro-batch had images or anything to differentiate.
    if (backward) state->begin_backward();
    // Under expert parallelism the text backward holds collectives (the expert exchange): when the
    // vision tower trains, every rank runs it, with or without images of its own, so that a rank
    // without images does not leave the others waiting.
    const bool text_backward = text_trained || vision_backward || (vision_trained && ep_comm != nullptr);
    if (backward && text_backward) {
      text->forward();
      text->backward();
      if (vision_backward) {
        timer.mark(StepComponent::vision, stream);
        vision->backward(text->image_embedding_grads());
      }
    } else {
      text->forward_loss();
    }
    if (backward) state->end_backward();
    LossSlot* out = loss_slots + slot;
    CUDA_CHECK(cudaMemcpyAsync(&out->ce_mean, text->device_loss(), sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaMemcpyAsync(&out->aux, text->device_aux_loss(), sizeof(double), cudaMemcpyDeviceToHost, stream));
  }

  uint64_t uploaded() const { return text->uploaded_bytes() + (vision ? vision->uploaded_bytes() : 0); }
};

GpuEngine::GpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options)
    : impl_(std::make_unique<Impl>()) {
  check_gpu_lora(options);
  impl_->plan_and_allocate(checkpoint.config, options);
  impl_->upload_checkpoint(checkpoint);
  impl_->upload_adapters();
  impl_->build_models();
}

GpuEngine::GpuEngine(const ModelConfig& config, const EngineOptions& options, uint64_t seed)
    : impl_(std::make_unique<Impl>()) {
  check_gpu_lora(options);
  impl_->plan_and_allocate(config, options);
  impl_->state->params().randomize(seed);
  impl_->upload_adapters();
  impl_->build_models();
}

GpuEngine::GpuEngine(const ModelCheckpoint& checkpoint, const EngineOptions& options, Communicator& world,
                     const ParallelOptions& parallel)
    : impl_(std::make_unique<Impl>()) {
  impl_->world = &world;
  impl_->parallel_options = parallel;
  impl_->plan_and_allocate(checkpoint.config, options, &checkpoint);
  impl_->upload_checkpoint(checkpoint);
  impl_->build_models();
}

GpuEngine::GpuEngine(const ModelConfig& config, const EngineOptions& options, uint64_t seed, Communicator& world,
                     const ParallelOptions& parallel)
    : impl_(std::make_unique<Impl>()) {
  impl_->world = &world;
  impl_->parallel_options = parallel;
  impl_->plan_and_allocate(config, options);
  impl_->state->params().randomize(seed);
  impl_->state->randomize_master(seed);
  impl_->build_models();
}

GpuEngine::~GpuEngine() = default;

std::string GpuEngine::device_name() const { return str_cat("cuda:", impl_->device); }
std::string GpuEngine::accelerator_name() const { return impl_->gpu_name; }
size_t GpuEngine::peak_memory_bytes() const { return impl_->peak_used_bytes; }
DeviceTrainState& GpuEngine::state() { return *impl_->state; }
const MemoryPlan& GpuEngine::memory_plan() const { return impl_->plan; }
const ParallelLayout* GpuEngine::parallel_layout() const { return impl_->parallel.get(); }

bool GpuEngine::last_step_summed_expert_squares() const { return impl_->last_step_summed_expert_squares; }
GpuTextModel& GpuEngine::text_model() { return *impl_->text; }

DeviceBatch GpuEngine::device_batch(const MicroBatch& batch) const {
  const ModelConfig& config = impl_->config;
  const int64_t T = batch.num_tokens();
  CHECK(T > 0, "train: empty micro-batch");
  CHECK(static_cast<int64_t>(batch.positions.size()) == 3 * T, "train: micro-batch positions must be [3, ", T,
        "], got ", batch.positions.size(), " values");
  DeviceBatch out;
  out.ids.assign(batch.input_ids.begin(), batch.input_ids.end());
  out.shifted_labels = shift_packed_labels(batch);
  out.cu_seqlens = batch.cu_seqlens;
  out.positions = batch.positions;
  if (batch.image_grid_thw.empty()) {
    CHECK(batch.pixel_values.empty(), "train: the micro-batch has pixel_values but no image_grid_thw");
    return out;
  }
  const VisionConfig& vc = config.vision;
  const int64_t patch_dim = vc.patch_dim();
  const int64_t num_patches = static_cast<int64_t>(batch.pixel_values.size()) / patch_dim;
  CHECK(num_patches * patch_dim == static_cast<int64_t>(batch.pixel_values.size()),
        "train: pixel_values of the micro-batch are not whole patches of ", patch_dim, " values");
  CHECK(num_patches == batch.num_patches(), "train: the micro-batch has ", num_patches,
        " patches of pixel_values but its image_grid_thw describe ", batch.num_patches());
  CHECK(std::count(out.ids.begin(), out.ids.end(), config.video_token_id) == 0, "train: video tokens (id ",
        config.video_token_id, ") are not supported yet");
  const int64_t merged = num_patches / (vc.spatial_merge_size * vc.spatial_merge_size);
  out.image_rows.resize(static_cast<size_t>(merged));
  token_scatter_pad_rows(out.ids.data(), T, config.image_token_id, merged, out.image_rows.data());
  out.pixel_values = batch.pixel_values.data();
  out.num_patches = num_patches;
  out.grid_thw = batch.image_grid_thw;
  return out;
}

GpuEngine::MicroBatchRun GpuEngine::run_micro_batches(const std::vector<MicroBatch>& batches, double ce_token_weight,
                                                      double aux_weight, int64_t step) {
  Impl& s = *impl_;
  MicroBatchRun run;
  run.supervised.resize(batches.size());
  run.tokens.resize(batches.size());
  run.losses.resize(2 * batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    // More micro-batches than loss slots: wait for the stream once per kLossSlots to reuse them.
    if (i > run.collected && (i - run.collected) % kLossSlots == 0) {
      CUDA_CHECK(cudaStreamSynchronize(s.stream));
      collect_losses(run, i);
    }
    if (s.world != nullptr) s.world->set_activity(str_cat("train step ", step, ": micro-batch ", i, " forward/backward"));
    const DeviceBatch batch = device_batch(batches[i]);
    run.supervised[i] = batch.num_supervised();
    run.tokens[i] = batches[i].num_tokens();
    // The model differentiates ce_weight * (mean CE); the contract's ce_token_weight * CE sum is
    // (ce_token_weight * supervised) * mean, as the CPU engine seeds it.
    s.run_batch(batch, ce_token_weight * static_cast<double>(run.supervised[i]), aux_weight, true,
                static_cast<int>(i % kLossSlots), static_cast<int64_t>(i));
    run.flops += training_step_flops(s.config.text, batches[i].cu_seqlens);
  }
  return run;
}

void GpuEngine::collect_losses(MicroBatchRun& run, size_t end) const {
  for (size_t i = run.collected; i < end; ++i) {
    const LossSlot& slot = impl_->loss_slots[i % kLossSlots];
    run.losses[2 * i] = static_cast<double>(slot.ce_mean) * static_cast<double>(run.supervised[i]);
    run.losses[2 * i + 1] = slot.aux;
  }
  run.collected = end;
}

StepResult GpuEngine::train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) {
  if (impl_->world != nullptr) return train_step_parallel(batches, lr, max_grad_norm);
  Impl& s = *impl_;
  CHECK(!batches.empty(), "train: a step needs at least one micro-batch");
  StepResult result;
  result.num_micro_batches = static_cast<int64_t>(batches.size());
  for (const MicroBatch& batch : batches) result.num_supervised += batch.num_supervised;
  const MicroBatchWeights weights = micro_batch_weights(result.num_supervised, result.num_micro_batches,
                                                        s.options.aux_coef);
  const uint64_t uploaded_before = s.uploaded();
  const double* expert_sums = s.begin_step_gradients(batches.size(), weights.gradient_divisor);
  s.last_step_summed_expert_squares = expert_sums != nullptr;
  MicroBatchRun run = run_micro_batches(batches, weights.ce_token_weight, weights.aux_weight, s.state->adam_step() + 1);
  s.end_step_gradients();
  for (const MicroBatch& batch : batches) result.num_tokens += batch.num_tokens();
  result.flops = run.flops;
  // Test hook (DELTAMOE_KILL_AT=mid_step@N): a kill -9 with step N's backward queued on the device.
  kill_point("mid_step", s.state->adam_step() + 1);
  s.text->timer().mark(StepComponent::optimizer, s.stream);
  s.state->start_sum_of_squares(weights.gradient_divisor, expert_sums, s.num_expert_square_sums());
  const double sum_of_squares = s.state->finish_sum_of_squares();  // the step's host sync
  collect_losses(run, batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    result.ce_sum += run.losses[2 * i];
    result.aux_loss_sum += run.losses[2 * i + 1];
  }
  const GradClipResult clip = grad_clip_from_sum_of_squares(sum_of_squares, max_grad_norm);
  result.grad_norm = clip.grad_norm;
  result.clip_coef = clip.clip_coef;
  result.skipped = !clip.finite;
  if (clip.finite) s.state->adamw_step(lr, GradientScaling{weights.gradient_divisor, clip.clip_coef});
  result.host_to_device_bytes = s.uploaded() - uploaded_before;
  result.device_to_host_bytes = batches.size() * (sizeof(float) + sizeof(double)) + sizeof(double);
  s.note_memory();
  return result;
}

StepResult GpuEngine::train_step_parallel(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) {
  Impl& s = *impl_;
  Communicator& world = *s.world;
  const int ranks = world.size();
  const int64_t step = s.state->adam_step() + 1;
  // The step's sizes over the ranks through the host control plane (no device sync): every rank
  // must take the same number of micro-batches, and the per-token seeding and divisor are those
  // of one rank taking all of them (S and the micro-batch count of the whole step).
  const int64_t local = static_cast<int64_t>(batches.size());
  int64_t mine[2] = {local, 0};
  for (const MicroBatch& batch : batches) mine[1] += batch.num_supervised;
  world.set_activity(str_cat("train step ", step, ": micro-batch counts"));
  const std::vector<std::string> sizes =
      world.control().all_gather(std::string(reinterpret_cast<const char*>(mine), sizeof(mine)),
                                 str_cat("train step ", step, " micro-batch counts"));
  CHECK(static_cast<int>(sizes.size()) == ranks, "train: ", sizes.size(), " ranks answered, the world has ", ranks);
  StepResult result;
  int64_t fewest = local, most = local;
  for (const std::string& bytes : sizes) {
    CHECK(bytes.size() == sizeof(mine), "train: a rank sent ", bytes.size(), " bytes of step sizes");
    int64_t theirs[2];
    std::memcpy(theirs, bytes.data(), sizeof(theirs));
    fewest = std::min(fewest, theirs[0]);
    most = std::max(most, theirs[0]);
    result.num_supervised += theirs[1];
  }
  CHECK(fewest == most, "train: the ranks hold different numbers of micro-batches for this step (", fewest, " to ",
        most, "); each rank must take micro-batches g * world + rank of the global batch");
  CHECK(local > 0, "train: a step needs at least one micro-batch on every rank");
  result.num_micro_batches = local * ranks;
  const MicroBatchWeights weights =
      micro_batch_weights(result.num_supervised, result.num_micro_batches, s.options.aux_coef);
  const uint64_t uploaded_before = s.uploaded();
  const double* expert_sums = s.begin_step_gradients(batches.size(), weights.gradient_divisor);
  s.last_step_summed_expert_squares = expert_sums != nullptr;
  MicroBatchRun run = run_micro_batches(batches, weights.ce_token_weight, weights.aux_weight, step);
  s.end_step_gradients();
  result.flops = run.flops;  // this rank's share
  kill_point("mid_step", step);
  s.text->timer().mark(StepComponent::optimizer, s.stream);
  world.set_activity(str_cat("train step ", step, ": gradient reduce-scatter"));
  s.state->reduce_gradients();
  world.set_activity(str_cat("train step ", step, ": gradient norm"));
  s.state->start_sum_of_squares(weights.gradient_divisor, expert_sums, s.num_expert_square_sums());
  const double sum_of_squares = s.state->finish_sum_of_squares();  // the step's host sync
  collect_losses(run, batches.size());
  // Losses and tokens in the order one rank would add them: micro-batch g * world + r.
  std::vector<double> mine_parts(run.losses);
  for (int64_t g = 0; g < local; ++g) mine_parts.push_back(static_cast<double>(run.tokens[g]));
  const std::vector<std::string> all_parts = world.control().all_gather(
      std::string(reinterpret_cast<const char*>(mine_parts.data()), mine_parts.size() * sizeof(double)),
      str_cat("train step ", step, " losses"));
  std::vector<std::vector<double>> by_rank(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const std::string& bytes = all_parts[static_cast<size_t>(r)];
    CHECK(bytes.size() == mine_parts.size() * sizeof(double), "train: rank ", r, " sent ", bytes.size(),
          " bytes of losses, expected ", mine_parts.size() * sizeof(double));
    by_rank[static_cast<size_t>(r)].resize(mine_parts.size());
    std::memcpy(by_rank[static_cast<size_t>(r)].data(), bytes.data(), bytes.size());
  }
  for (int64_t g = 0; g < local; ++g) {
    for (int r = 0; r < ranks; ++r) {
      const std::vector<double>& part = by_rank[static_cast<size_t>(r)];
      result.ce_sum += part[2 * g];
      result.aux_loss_sum += part[2 * g + 1];
      result.num_tokens += static_cast<int64_t>(part[2 * local + g]);
    }
  }
  const GradClipResult clip = grad_clip_from_sum_of_squares(sum_of_squares, max_grad_norm);
  result.grad_norm = clip.grad_norm;
  result.clip_coef = clip.clip_coef;
  result.skipped = !clip.finite;
  if (clip.finite) {
    world.set_activity(str_cat("train step ", step, ": AdamW and weight all-gather"));
    s.state->adamw_step(lr, GradientScaling{weights.gradient_divisor, clip.clip_coef});
  }
  result.host_to_device_bytes = s.uploaded() - uploaded_before;
  result.device_to_host_bytes = batches.size() * (sizeof(float) + sizeof(double)) + 2 * sizeof(double);
  s.note_memory();
  return result;
}

MicroBatchLoss GpuEngine::evaluate(const MicroBatch& batch, std::vector<float>* logits) {
  Impl& s = *impl_;
  const DeviceBatch device = device_batch(batch);
  s.run_batch(device, 0.0, 0.0, false, 0, -1);
  CUDA_CHECK(cudaStreamSynchronize(s.stream));
  MicroBatchLoss loss;
  loss.num_tokens = batch.num_tokens();
  loss.num_supervised = device.num_supervised();
  loss.ce_sum = static_cast<double>(s.loss_slots[0].ce_mean) * static_cast<double>(loss.num_supervised);
  loss.aux_loss = s.loss_slots[0].aux;
  const int64_t vocab = s.config.text.vocab_size;
  if (logits != nullptr || loss.num_tokens * vocab <= kMaxAccuracyLogits) {
    std::vector<float> values = s.text->compute_logits();
    loss.num_correct = count_correct(values, device.shifted_labels, vocab);
    if (logits != nullptr) *logits = std::move(values);
  }
  s.note_memory();
  return loss;
}

void GpuEngine::zero_gradients() { impl_->state->zero_gradients(); }

MicroBatchLoss GpuEngine::forward_backward(const DeviceBatch& batch, double ce_mean_weight, double aux_weight) {
  Impl& s = *impl_;
  s.run_batch(batch, ce_mean_weight, aux_weight, true, 0, 0);
  CUDA_CHECK(cudaStreamSynchronize(s.stream));
  MicroBatchLoss loss;
  loss.num_tokens = static_cast<int64_t>(batch.ids.size());
  loss.num_supervised = batch.num_supervised();
  loss.ce_sum = static_cast<double>(s.loss_slots[0].ce_mean) * static_cast<double>(loss.num_supervised);
  loss.aux_loss = s.loss_slots[0].aux;
  return loss;
}

std::vector<float> GpuEngine::read_gradient(const std::string& name) const {
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  return impl_->state->params().read_gradient(name);
}

std::vector<std::vector<int32_t>> GpuEngine::last_routing() const {
  std::vector<std::vector<int32_t>> routing;
  for (int64_t layer = 0; layer < impl_->config.text.num_hidden_layers; ++layer)
    routing.push_back(impl_->text->read_topk_idx(layer));
  return routing;
}

}  // namespace deltamoe
