// The layout-aware planner (see the header): state by (expert / dense, trained / frozen) from the
// parameter table, activations from the GPU models' own layouts.
#include "train/parallel_memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "core/error.h"
#include "core/units.h"
#include "model/gradient_phases.h"
#include "model/param_table.h"
#include "model/text/expert_exchange_size.h"
#include "optim/param_layout.h"
#include "train/sharded_region.h"
#include "train/trainable_params.h"
#include "model/text/text_weights.h"
#include "model/vision/vision_weights.h"
#include "model/vision/vision_tower.h"

namespace deltamoe {

namespace {

size_t aligned_elements(int64_t numel) {
  return static_cast<size_t>((numel + kFlatAlignmentElements - 1) / kFlatAlignmentElements * kFlatAlignmentElements);
}

}  // namespace

bool parse_recompute_choice(const std::string& text, RecomputeChoice* out) {
  if (text == "none") *out = RecomputeChoice::none;
  else if (text == "selective") *out = RecomputeChoice::selective;
  else if (text == "full") *out = RecomputeChoice::full;
  else return false;
  return true;
}

const char* recompute_choice_name(RecomputeChoice choice) {
  return choice == RecomputeChoice::none ? "none" : choice == RecomputeChoice::selective ? "selective" : "full";
}

void plan_rank_state_bytes(const ModelConfig& config, const FreezeOptions& freeze, DType moment_dtype, int world,
                           const ParallelOptions& layout, MemoryPlan* plan, DType expert_grad_dtype) {
  const int ep = layout.expert_parallel_size;
  CHECK(world >= 1 && ep >= 1 && world % ep == 0, "plan: --expert_model_parallel_size ", ep, " must divide the ",
        world, " ranks");
  std::set<std::string> read_in_f32 = text_params_read_in_f32(config.text, config.text_prefix());
  if (config.has_vision)
    for (const std::string& name : vision_params_read_in_f32(config.vision, kVisionPrefix)) read_in_f32.insert(name);
  // The rank's layout as the engine builds it (rank 0; every rank's pieces differ by a few
  // elements of padding at most).
  ParamLayout full;
  size_t all = 0, f32_copies = 0;
  bool experts_split = ep > 1;  // a rank's trained expert slices keep their masters split, as the engine's
  for (const ParamSpec& spec : build_param_table(config)) {
    const bool expert = ep > 1 && is_routed_expert_tensor(spec.name);
    const size_t numel = aligned_elements(spec.shape.numel() / (expert ? ep : 1));
    all += numel;
    if (read_in_f32.count(spec.name) != 0) f32_copies += numel;  // frozen, or trained with the master elsewhere
    if (is_frozen(spec.name, freeze)) continue;
    if (expert) experts_split = experts_split && master_kept_split(spec.name, false, read_in_f32.count(spec.name) != 0);
    full.add(spec.name, spec.shape.to_vector());
    const ParamGroup group = param_group(spec.name);
    plan->vit_trained = plan->vit_trained || group == ParamGroup::vit;
    plan->merger_trained = plan->merger_trained || group == ParamGroup::aligner;
  }
  CHECK(full.num_tensors() > 0, "plan: every parameter is frozen; nothing would be trained");
  const std::vector<GradientPhase> phases = backward_gradient_phases(config);
  const ParallelLayout rank(full, 0, world, config.text.num_experts, layout, &phases);
  const size_t state = static_cast<size_t>(rank.state().total_numel());
  const size_t experts = static_cast<size_t>(rank.dense_state_begin());
  const ShardedRegion region =
      plan_sharded_region(rank, [&](const std::string& name) { return read_in_f32.count(name) != 0; });
  plan->weights = 2 * all;
  // fp32 masters of the dense pieces; the expert slices' low halves (2 bytes) when split.
  plan->master = experts_split ? 4 * (state - experts) + 2 * experts : 4 * state;
  // The expert slices' gradients (expert_grad_dtype where their masters are split, as the engine
  // keeps them, else fp32), then the region every dense gradient group takes in turn (and the
  // weight all-gather stages in at the step end).
  const size_t expert_grad_bytes = experts_split ? dtype_size(expert_grad_dtype) : 4;
  plan->gradients = expert_grad_bytes * aligned_elements(static_cast<int64_t>(experts)) +
                    static_cast<size_t>(region.bytes());
  plan->moments = 2 * dtype_size(moment_dtype) * state;
  plan->frozen_f32 = 4 * f32_copies;
  plan->sharding = 4 * (state - experts);  // the reduced dense pieces, summed over the micro-batches
}

ParallelMemoryPlan plan_parallel_memory(const ModelConfig& config, const EngineOptions& options,
                                        const ParallelPlanOptions& parallel) {
  const int world = parallel.world, ep = parallel.layout.expert_parallel_size;
  CHECK(world >= 1, "plan: --nproc must be >= 1, got ", world);
  CHECK(ep >= 1 && world % ep == 0, "plan: --expert_model_parallel_size ", ep, " must divide the ", world, " GPUs");
  CHECK(config.text.num_experts % ep == 0, "plan: --expert_model_parallel_size ", ep, " does not divide the ",
        config.text.num_experts, " routed experts");
  CHECK(world == 1 || parallel.layout.distributed_optimizer || ep == world,
        "plan: dense tensors replicated over ", world, " GPUs: give --use_distributed_optimizer true");
  ParallelMemoryPlan out;
  EngineOptions engine = options;
  engine.recompute = RecomputeOptions{};
  engine.recompute.mixers = parallel.recompute == RecomputeChoice::selective;
  if (parallel.recompute == RecomputeChoice::full) engine.recompute.layers = config.text.num_hidden_layers;
  if (!parallel.images) engine.max_image_pixels = 1;  // no image fits: text-only micro-batches
  MemoryPlan& plan = out.plan;
  plan = plan_training_memory(config, engine);
  if (!parallel.images) {
    plan.max_image_tokens = plan.max_patches = 0;
    plan.vision = ModelBytes{};
    plan.text = estimate_text_bytes(config.text, engine.max_tokens, planned_max_sequences(engine), 0,
                                    engine.loss_chunk_rows, engine.recompute);
  }
  if (parallel.layout.distributed_optimizer) {
    // State: the GPU engine's own plan of a rank (its layout, its gradient region, its buffers).
    plan_rank_state_bytes(config, options.freeze, options.adamw.moment_dtype, world, parallel.layout, &plan,
                          options.expert_grad_dtype);
  } else if (world > 1 || ep > 1) {
    // Replicated dense state (layout (c) of the design: the engine refuses it; planned to compare):
    // experts 1/EP with their whole state, every dense tensor's state on every rank.
    size_t expert_all = 0, expert_trained = 0, dense_all = 0, dense_trained = 0;
    for (const ParamSpec& spec : build_param_table(config)) {
      const size_t numel = aligned_elements(spec.shape.numel());
      const bool expert = is_routed_expert_tensor(spec.name), trained = !is_frozen(spec.name, options.freeze);
      (expert ? expert_all : dense_all) += numel;
      if (trained) (expert ? expert_trained : dense_trained) += numel;
    }
    const size_t here = expert_trained / static_cast<size_t>(ep) + dense_trained;
    plan.weights = 2 * (expert_all / static_cast<size_t>(ep) + dense_all);
    plan.master = 4 * here;
    plan.gradients = 4 * here;
    plan.moments = 2 * dtype_size(options.adamw.moment_dtype) * here;
  }
  if (ep > 1) {
    const TextConfig& text = config.text;
    const int64_t T = engine.max_tokens;
    out.expert_recv_rows = expert_recv_rows_for(text, ep, T, parallel.layout.expert_recv_headroom);
    out.exchange = expert_exchange_bytes(text, ep, T, out.expert_recv_rows);
    if (parallel.layout.expert_recv_headroom == 0 && parallel.gpu_memory_bytes > out.total()) {
      // Auto: the memory left raises the capacity, as the engine does before its fit check.
      out.expert_recv_rows = expert_recv_rows_within(text, ep, T, out.expert_recv_rows,
                                                     out.exchange + (parallel.gpu_memory_bytes - out.total()));
      out.exchange = expert_exchange_bytes(text, ep, T, out.expert_recv_rows);
    }
    out.expert_recv_headroom =
        static_cast<double>(out.expert_recv_rows) / static_cast<double>(expert_recv_mean_rows(text, T));
  }
  return out;
}

std::string ParallelMemoryPlan::describe() const {
  std::string out = plan.describe();
  const size_t cut = out.rfind("  total");
  if (cut != std::string::npos) out.erase(cut);
  auto line = [&](const char* what, size_t bytes, const char* note) {
    char row[200];
    std::snprintf(row, sizeof(row), "  %-26s %9.2f GiB%s%s\n", what, gib(bytes), *note ? "  " : "", note);
    out += row;
  };
  if (exchange > 0) {
    char note[120];
    std::snprintf(note, sizeof(note), "receives up to %lld rows per layer (%.2fx the mean)",
                  static_cast<long long>(expert_recv_rows), expert_recv_headroom);
    line("expert exchange buffers", exchange, note);
  }
  line("total", total(), "");
  return out;
}

}  // namespace deltamoe
