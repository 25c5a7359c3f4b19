// GpuEngine's setup (gpu_engine_impl.h): the parameters it trains and how, a parallel rank's
// layout and communicators, the memory plan with the recompute and kept-intermediate choices and
// the refusal when the run cannot fit, the state and the models bound to it, the uploads of the
// checkpoint and the adapters.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "core/log.h"
#include "core/units.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "model/gradient_phases.h"
#include "model/param_table.h"
#include "model/text/expert_exchange_size.h"
#include "model/vision/vision_tower.h"
#include "train/batch_plan.h"
#include "train/gpu/gpu_engine_impl.h"
#include "train/kept_intermediates.h"
#include "train/parallel_memory_plan.h"
#include "train/trainable_params.h"

namespace deltamoe {

namespace {

ModelBytes model_bytes(const GpuModelBytes& b) { return {b.activations, b.workspace, b.inputs}; }
ModelBytes model_bytes(const GpuVisionBytes& b) { return {b.activations, b.workspace, b.inputs}; }

}  // namespace

std::vector<DeviceParamSpec> GpuEngine::Impl::param_specs() const {
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

std::vector<DeviceParamSpec> GpuEngine::Impl::local_expert_specs(std::vector<DeviceParamSpec> specs) const {
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

ParamLayout GpuEngine::Impl::trained_full_layout(const ModelCheckpoint* checkpoint) const {
  if (checkpoint != nullptr) return trainable_layout(*checkpoint, options.freeze);
  ParamLayout layout;
  for (const ParamSpec& p : build_param_table(config))
    if (!is_frozen(p.name, options.freeze)) layout.add(p.name, p.shape.to_vector());
  CHECK(layout.num_tensors() > 0, "train: every parameter is frozen; nothing would be trained");
  return layout;
}

void GpuEngine::Impl::setup_parallel(const ModelCheckpoint* checkpoint) {
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

void GpuEngine::Impl::upload_adapters() {
  if (options.lora == nullptr) return;
  for (const LoraTarget& target : options.lora->targets) {
    for (const std::string& name : {target.a_name(), target.b_name()}) {
      const HostTensor values = options.lora->tensors.at(name).to_f32();
      state->params().upload(name, 0, values.numel(), values.data(), DType::f32);
    }
  }
  wait_for_uploads();
}

DeviceLoraLookup GpuEngine::Impl::lora_lookup() const {
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

int64_t GpuEngine::Impl::lora_dropout_max_in(bool vision) const {
  if (options.lora == nullptr || options.lora->options.dropout == 0) return 0;
  return lora_dense_max_in_features(options.lora->targets, vision);
}

int64_t GpuEngine::Impl::vision_lora_rank() const {
  if (options.lora == nullptr) return 0;
  for (const LoraTarget& target : options.lora->targets)
    if (param_group(target.module + ".weight") != ParamGroup::llm) return options.lora->options.rank;
  return 0;
}

GpuModelOptions GpuEngine::Impl::text_options() const {
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

ModelBytes GpuEngine::Impl::vision_plan() const {
  return model_bytes(GpuVisionModel::planned_bytes(config.vision, max_patches, max_image_tokens, plan.vit_trained,
                                                   plan.merger_trained, vision_lora_rank(),
                                                   vision_recompute_blocks(), lora_dropout_max_in(true)));
}

void GpuEngine::Impl::choose_recompute(size_t available, const std::string& where) {
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

void GpuEngine::Impl::choose_kept(size_t available) {
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

void GpuEngine::Impl::grow_expert_capacity(size_t available) {
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

void GpuEngine::Impl::plan_and_allocate(const ModelConfig& model_config, const EngineOptions& engine_options,
                                        const ModelCheckpoint* checkpoint) {
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

void GpuEngine::Impl::build_models() {
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

void GpuEngine::Impl::upload_checkpoint(const ModelCheckpoint& checkpoint) {
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

}  // namespace deltamoe
