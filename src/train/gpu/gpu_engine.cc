// GpuEngine (gpu_engine.h): construction (the setup itself is gpu_engine_setup.cc), the step on one
// rank and on several, evaluation, and the parity hooks.
#include "train/gpu/gpu_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/kill_point.h"
#include "core/log.h"
#include "kernels/token_scatter/token_scatter_cuda.h"
#include "optim/grad_clip.h"
#include "parallel/control_plane.h"
#include "train/batch_plan.h"
#include "train/gpu/gpu_engine_impl.h"
#include "train/model_flops.h"

namespace deltamoe {

namespace {

constexpr int64_t kIgnore = -100;
// Evaluation downloads [T, V] fp32 logits to count the right argmaxes only up to this size
// (256 MiB: the demo's 1024 x 4096 is 16 MiB; a real vocabulary at 8k tokens would be 8 GiB).
constexpr int64_t kMaxAccuracyLogits = int64_t{1} << 26;

int64_t count_correct(const std::vector<float>& logits, const std::vector<int64_t>& shifted_labels, int64_t vocab) {
  int64_t correct = 0;
  for (size_t t = 0; t < shifted_labels.size(); ++t) {
    if (shifted_labels[t] == kIgnore) continue;
    const float* row = logits.data() + t * static_cast<size_t>(vocab);
    correct += std::max_element(row, row + vocab) - row == shifted_labels[t];
  }
  return correct;
}

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

const double* GpuEngine::Impl::begin_step_gradients(size_t micro_batches, double divisor) {
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

void GpuEngine::Impl::run_batch(const DeviceBatch& batch, double ce_mean_weight, double aux_weight, bool backward,
                                int slot, int64_t micro_batch) {
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
