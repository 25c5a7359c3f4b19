// The memory planner on the CPU: the state's bytes follow the parameter table and the freeze
// choice exactly, the vision tower is sized from the token budget and --max_pixels, a frozen ViT
// keeps no backward state, recomputed ViT blocks keep only their input, the intermediates kept from
// the forward (experts' gate/up rows, the GDN forward) cost what their layouts say, and a run that
// does not fit is refused with the plan and what to change.
#include "train/memory_plan.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "kernels/gated_delta_rule/gated_delta_rule_workspace.h"
#include "model/param_table.h"
#include "model/vision/vision_activations.h"
#include "model/vision/vision_tower.h"
#include "train/parallel_layout.h"

namespace deltamoe {
namespace {

// Qwen3.5-35B-A3B widths with 4 text layers (3 GDN + 1 attention) and the whole vision tower.
ModelConfig four_layer_model() {
  ModelConfig config = model_config_preset("qwen3.5-35b-a3b");
  config.text.num_hidden_layers = 4;
  config.text.layer_types = {LayerType::linear_attention, LayerType::linear_attention, LayerType::linear_attention,
                             LayerType::full_attention};
  return config;
}

// Pixels of one merged image token (patch 16 x merge 2 in Qwen3.5: 32 x 32).
int64_t token_pixels(const VisionConfig& vision) {
  const int64_t side = vision.patch_size * vision.spatial_merge_size;
  return side * side;
}

EngineOptions run_options(bool freeze_vision) {
  EngineOptions options;
  options.freeze = FreezeOptions{freeze_vision, freeze_vision, false};
  options.max_tokens = 8192;
  options.max_image_pixels = 1280 * token_pixels(model_config_preset("qwen3.5-35b-a3b").vision);
  return options;
}

int64_t numel_of(const ModelConfig& config, bool vision) {
  int64_t count = 0;
  for (const ParamSpec& spec : build_param_table(config))
    if (spec.name.starts_with("model.visual.") == vision) count += spec.shape.numel();
  return count;
}

int64_t routed_expert_numel(const ModelConfig& config) {
  int64_t count = 0;
  for (const ParamSpec& spec : build_param_table(config))
    if (is_routed_expert_tensor(spec.name)) count += spec.shape.numel();
  return count;
}

TEST(MemoryPlan, StateFollowsTheTableAndTheFreezeChoice) {
  const ModelConfig config = four_layer_model();
  const MemoryPlan all = plan_training_memory(config, run_options(false));
  const MemoryPlan frozen = plan_training_memory(config, run_options(true));
  const int64_t text = numel_of(config, false), vision = numel_of(config, true);
  std::printf("text %.3f B, vision %.3f B parameters\nall trained:\n%sViT and merger frozen:\n%s", text / 1e9,
              vision / 1e9, all.describe().c_str(), frozen.describe().c_str());
  // fp32 moments x2 of every trained element; fp32 master and gradients but for the routed
  // experts, whose split masters keep 2 bytes beside their bf16 weights and whose gradients are
  // bf16; bf16 weights of all (padding to 64 elements per tensor makes them a little larger).
  const int64_t experts = routed_expert_numel(config);
  ASSERT_GT(experts, text / 2);
  const auto master_bytes = [&](int64_t trained) { return static_cast<size_t>(trained - experts) * 4 + experts * 2; };
  EXPECT_GE(all.master, master_bytes(text + vision));
  EXPECT_LE(all.master, master_bytes(text + vision) + (size_t{1} << 20));
  EXPECT_GE(all.gradients, master_bytes(text + vision));
  EXPECT_LE(all.gradients, master_bytes(text + vision) + (size_t{1} << 20));
  EXPECT_EQ(all.gradients, all.master);  // the same 4 or 2 bytes a parameter, the same padding
  EXPECT_GE(all.moments, static_cast<size_t>(text + vision) * 8);
  EXPECT_LE(all.moments, static_cast<size_t>(text + vision) * 8 + (size_t{1} << 21));
  // Frozen vision: no vision master, gradients or moments; only the text model's remain.
  EXPECT_GE(frozen.master, master_bytes(text));
  EXPECT_LT(frozen.master, master_bytes(text) + (size_t{1} << 20));
  EXPECT_EQ(frozen.weights, all.weights);
  EXPECT_GT(frozen.frozen_f32, 0u);  // the vision norms and the position table, read in fp32
  EXPECT_LT(frozen.frozen_f32, size_t{64} << 20);
  // A frozen ViT keeps nothing for a backward: its activations shrink by more than 10x.
  EXPECT_FALSE(frozen.vit_trained);
  EXPECT_LT(frozen.vision.activations * 10, all.vision.activations);
  EXPECT_LT(frozen.total(), all.total());
}

TEST(MemoryPlan, ImageTokensFollowTheTokenBudgetAndMaxPixels) {
  const VisionConfig vision = model_config_preset("qwen3.5-35b-a3b").vision;
  const int64_t px = token_pixels(vision);
  // 1280-token images: 7 of them fill 8192 tokens with their 14 marker tokens.
  EXPECT_EQ(max_image_tokens_in(8192, 1280 * px, vision), 8192 - 14);
  // 100-token images: 80 of them (8000 tokens) and their 160 markers fit; 81 would need 8262
  // tokens, and 81 smaller ones hold at most 8192 - 162 = 8030 image tokens.
  EXPECT_EQ(max_image_tokens_in(8192, 100 * px, vision), 8030);
  EXPECT_EQ(max_image_tokens_in(8192, 0, vision), 8192);  // no bound known
  const MemoryPlan plan = plan_training_memory(four_layer_model(), run_options(false));
  EXPECT_EQ(plan.max_image_tokens, 8192 - 14);
  EXPECT_EQ(plan.max_patches, (8192 - 14) * 4);
  const ModelConfig text_only = [] {
    ModelConfig config = four_layer_model();
    config.has_vision = false;
    return config;
  }();
  EXPECT_EQ(plan_training_memory(text_only, run_options(false)).vision.total(), 0u);
}

// Bytes of one vision block's kept activations besides its input, as vision_activations.h lists
// them, each piece 256-byte aligned: q and k with heads padded to a multiple of 16 (80 for 72).
size_t vision_block_bytes(const VisionConfig& v, int64_t N) {
  auto a256 = [](int64_t bytes) { return static_cast<size_t>((bytes + 255) / 256 * 256); };
  const int64_t C = v.hidden_size, I = v.intermediate_size, H = v.num_heads;
  const int64_t qk = H * ((C / H + 15) / 16 * 16);
  return 4 * a256(N * C * 2) + 2 * a256(N * qk * 2) + 4 * a256(N * 4) + a256(N * H * 4) + a256(N * C * 4) +
         2 * a256(N * I * 2);
}

TEST(MemoryPlan, RecomputedVisionBlocksKeepOnlyTheirInput) {
  const VisionConfig vision = model_config_preset("qwen3.5-35b-a3b").vision;
  const int64_t N = 4096;
  const size_t block = vision_block_bytes(vision, N);
  const size_t kept = estimate_vision_bytes(vision, N, true, true, 0).activations;
  size_t previous = kept;
  for (int64_t r = 1; r <= vision.depth; ++r) {
    const ModelBytes bytes = estimate_vision_bytes(vision, N, true, true, r);
    // r recomputed blocks give up r sets of activations and hold one shared set.
    EXPECT_EQ(bytes.activations + static_cast<size_t>(r - 1) * block, kept) << r;
    if (r > 1) {
      EXPECT_LT(bytes.activations, previous) << r;
    }
    previous = bytes.activations;
    // The estimate is the carve the model makes.
    VisionActivationSpec spec;
    spec.max_patches = N;
    spec.recompute_blocks = r;
    EXPECT_EQ(bytes.activations, vision_activation_bytes(vision, spec)) << r;
  }
  std::printf("vision activations at %lld patches: %.2f GiB kept, %.2f GiB with all %lld blocks recomputed\n",
              static_cast<long long>(N), kept / 1073741824.0, previous / 1073741824.0,
              static_cast<long long>(vision.depth));
  EXPECT_LT(previous * 4, kept);  // a whole recomputed tower holds under a quarter of the kept one
  // A frozen ViT keeps nothing anyway; a count beyond the tower is refused.
  EXPECT_EQ(estimate_vision_bytes(vision, N, false, true, vision.depth).activations,
            estimate_vision_bytes(vision, N, false, true, 0).activations);
  EXPECT_THROW(estimate_vision_bytes(vision, N, true, true, vision.depth + 1), Error);
}

TEST(MemoryPlan, FullRecomputeTakesEveryVisionBlock) {
  const ModelConfig config = four_layer_model();
  EngineOptions options = run_options(false);
  const MemoryPlan none = plan_training_memory(config, options);
  options.recompute.layers = kRecomputeAllLayers;
  options.recompute.vision_blocks = kRecomputeAllLayers;
  const MemoryPlan full = plan_training_memory(config, options);
  EXPECT_EQ(full.vision.activations,
            estimate_vision_bytes(config.vision, full.max_patches, true, true, config.vision.depth).activations);
  EXPECT_LT(full.vision.activations, none.vision.activations);
  EXPECT_LT(full.text.activations, none.text.activations);
  // With the ViT frozen the vision count changes nothing.
  EngineOptions frozen = run_options(true);
  const size_t frozen_bytes = plan_training_memory(config, frozen).vision.activations;
  frozen.recompute.vision_blocks = kRecomputeAllLayers;
  EXPECT_EQ(plan_training_memory(config, frozen).vision.activations, frozen_bytes);
}

// Keeping the experts' rows adds T K x C and T K x 2 I bf16 (each 256-byte aligned) to each layer
// that is not fully recomputed and nothing else; a fully recomputed layer forms them again.
TEST(MemoryPlan, KeptExpertRowsCostEachKeptLayerItsInputAndGateUpRows) {
  const ModelConfig config = four_layer_model();
  const TextConfig& text = config.text;
  const auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t rows = static_cast<size_t>(8192 * text.num_experts_per_tok);
  const size_t rows_bytes = aligned(rows * static_cast<size_t>(text.hidden_size) * 2) +
                            aligned(rows * static_cast<size_t>(2 * text.moe_intermediate_size) * 2);
  for (const int64_t recomputed : {int64_t{0}, int64_t{1}, int64_t{4}}) {
    EngineOptions options = run_options(false);
    options.recompute.layers = recomputed;
    const MemoryPlan recompute_rows = plan_training_memory(config, options);
    options.recompute.keep_expert_rows = true;
    const MemoryPlan keep_rows = plan_training_memory(config, options);
    EXPECT_TRUE(keep_rows.keep_expert_rows);
    EXPECT_FALSE(recompute_rows.keep_expert_rows);
    EXPECT_EQ(keep_rows.text.activations - recompute_rows.text.activations,
              static_cast<size_t>(text.num_hidden_layers - recomputed) * rows_bytes)
        << recomputed << " layers recomputed";
    EXPECT_EQ(keep_rows.text.workspace, recompute_rows.text.workspace);
    EXPECT_EQ(keep_rows.text.inputs, recompute_rows.text.inputs);
  }
}

// Keeping the GDN forward adds the rule's forward workspace layout to each GDN set: every GDN
// layer's own without recompute; with selective recompute the one shared set (which overlays the
// attention set: at most one layout more) and nothing per layer.
TEST(MemoryPlan, KeptGdnForwardCostsEachGdnSetTheRulesForwardWorkspace) {
  const ModelConfig config = four_layer_model();
  const TextConfig& text = config.text;
  EngineOptions options = run_options(false);
  const size_t layout = gated_delta_rule_workspace_layout(8192, planned_max_sequences(options),
                                                          text.linear_num_key_heads, text.linear_num_value_heads,
                                                          text.linear_key_head_dim, text.linear_value_head_dim, false)
                            .total;
  const MemoryPlan recompute_all = plan_training_memory(config, options);
  options.recompute.keep_gdn_forward = true;
  const MemoryPlan keep = plan_training_memory(config, options);
  EXPECT_TRUE(keep.keep_gdn_forward);
  EXPECT_EQ(keep.text.activations - recompute_all.text.activations,
            static_cast<size_t>(text.num_layers_of(LayerType::linear_attention)) * ((layout + 255) / 256 * 256));
  options.recompute.mixers = true;
  const MemoryPlan shared_keep = plan_training_memory(config, options);
  options.recompute.keep_gdn_forward = false;
  const MemoryPlan shared = plan_training_memory(config, options);
  EXPECT_GT(shared_keep.text.activations, shared.text.activations);
  EXPECT_LE(shared_keep.text.activations - shared.text.activations, (layout + 255) / 256 * 256);
  EXPECT_EQ(shared_keep.text.workspace, shared.text.workspace);
}

TEST(MemoryPlan, ARunThatDoesNotFitIsRefusedWithThePlanAndWhatToChange) {
  const ModelConfig config = four_layer_model();
  const EngineOptions options = run_options(false);
  const MemoryPlan plan = plan_training_memory(config, options);
  const size_t h100 = size_t{80} << 30;
  ASSERT_GT(plan.total(), h100) << "the 4-layer model with its vision tower trained needs more than 80 GiB";
  const std::string message = memory_refusal(plan, h100, options, "cuda:0 (NVIDIA H100)");
  std::printf("%s\n", message.c_str());
  for (const char* part : {"does not fit on cuda:0 (NVIDIA H100)", "80.00 GiB are available", "The plan:",
                           "Adam moments", "--optimizer_state_dtype bf16", "--micro_batch_tokens 4096",
                           "--freeze_vit true", "--max_pixels", "more GPUs"}) {
    EXPECT_NE(message.find(part), std::string::npos) << part;
  }
  EXPECT_EQ(memory_refusal(plan, plan.total(), options, "cuda:0"), "");  // exactly enough fits
  EXPECT_NE(memory_refusal(plan, plan.total() - 1, options, "cuda:0"), "");
}

}  // namespace
}  // namespace deltamoe
