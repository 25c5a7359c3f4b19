// The memory plan of a LoRA run: the base frozen whole (bf16 weights and the fp32 copies the models
// read, no master, gradient or moments), the adapters (and --modules_to_save) trained; and the plan
// of the headline run (Qwen3.5-35B-A3B, 40 layers, 8,192 tokens, all-linear + expert adapters r 8,
// the vision tower's adapters trained) printed and within one H200 (137 GiB); the adapters' scratch
// and the tower's backward planned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "checkpoint/random_init.h"
#include "kernels/lora/lora_dropout_mask.h"
#include "model/lora/lora_adapters.h"
#include "model/param_table.h"
#include "train/memory_plan.h"
#include "train/trainable_params.h"

namespace deltamoe {
namespace {

constexpr int64_t kAlign = kFlatAlignmentElements;

size_t aligned(int64_t numel) { return static_cast<size_t>((numel + kAlign - 1) / kAlign * kAlign); }

LoraOptions gpu_targets(int64_t rank) {
  LoraOptions options;
  options.rank = rank;
  options.alpha = 32;
  options.target_modules = {"all-linear"};
  options.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  return options;
}

TEST(MemoryPlanLora, BaseFrozenAdaptersTrained) {
  const ModelConfig config = model_config_preset("tiny-vl");
  LoraOptions lora_options = gpu_targets(4);
  lora_options.modules_to_save = {"lm_head"};
  const LoraAdapters lora = init_lora_adapters(config, lora_options, 1);
  size_t base = 0, adapters = 0, lm_head = 0;
  for (const ParamSpec& spec : build_param_table(config)) {
    base += aligned(spec.shape.numel());
    if (spec.name == "lm_head.weight") lm_head = aligned(spec.shape.numel());
  }
  for (const LoraTarget& target : lora.targets) {
    adapters += aligned(target.a_shape(4)[0] * target.a_shape(4)[1]) + aligned(target.b_shape(4)[0] * target.b_shape(4)[1]);
  }
  MemoryPlan full, lora_plan;
  plan_state_bytes(config, FreezeOptions{false, false, false}, DType::f32, &full);
  plan_state_bytes(config, FreezeOptions{false, false, false}, DType::f32, &lora_plan, &lora);
  EXPECT_EQ(lora_plan.weights, 2 * (base + adapters));
  EXPECT_EQ(lora_plan.master, 4 * (adapters + lm_head));
  EXPECT_EQ(lora_plan.gradients, 4 * (adapters + lm_head));
  EXPECT_EQ(lora_plan.moments, 2 * 4 * (adapters + lm_head));
  EXPECT_GT(lora_plan.frozen_f32, full.frozen_f32) << "the frozen base keeps fp32 copies of what is read in fp32";
  EXPECT_TRUE(lora_plan.vit_trained) << "all-linear adapts the tower's blocks";
  EXPECT_TRUE(lora_plan.merger_trained);
  // The layout the state is saved with holds exactly the adapters and lm_head.
  EXPECT_EQ(static_cast<size_t>(lora_layout(random_init_checkpoint(config, 1, DType::bf16), lora).num_tensors()),
            2 * lora.targets.size() + 1);
}

TEST(MemoryPlanLora, The35bHeadlineRunFitsOneH200) {
  const ModelConfig config = model_config_preset("qwen3.5-35b-a3b");
  EngineOptions options;
  // The plan needs the targets only (initialising 0.46 B expert adapter values would take a minute).
  LoraAdapters lora;
  lora.options = gpu_targets(8);
  lora.targets = resolve_lora_targets(config, lora.options);
  options.lora = std::make_shared<const LoraAdapters>(std::move(lora));
  options.max_tokens = 8192;
  options.max_samples = 16;
  options.max_image_pixels = 20 * 24 * 32 * 32;  // the largest image of the acceptance bench (20x24 merged tokens)
  options.adamw.moment_dtype = DType::bf16;
  // Text only: fits as it is.
  EngineOptions text_only = options;
  text_only.max_image_pixels = 0;
  const ModelConfig text_config = [&] {
    ModelConfig c = config;
    c.has_vision = false;
    return c;
  }();
  const MemoryPlan text_plan = plan_training_memory(text_config, text_only);
  std::printf("35B LoRA (all-linear + routed experts, r 8), 8192 text tokens:\n%s", text_plan.describe().c_str());
  EXPECT_LE(text_plan.total(), size_t{137} << 30);
  // With images, the tower's adapters keep its backward state for a micro-batch that could be all
  // image tokens (the plan's worst case): that fits with the mixers recomputed (--recompute selective).
  const MemoryPlan plan = plan_training_memory(config, options);
  options.recompute.mixers = true;  // --recompute selective
  const MemoryPlan recompute = plan_training_memory(config, options);
  std::printf("with images up to 20x24 merged tokens: %.2f GiB; with --recompute selective:\n%s",
              static_cast<double>(plan.total()) / (1 << 30), recompute.describe().c_str());
  EXPECT_TRUE(plan.vit_trained);
  EXPECT_LE(recompute.total(), size_t{137} << 30);
  EXPECT_LT(plan.master, size_t{4} << 30) << "only adapters have a master";
}

// Adapters in the vision tower make its parts run a backward (their activations are planned), as a
// trained tensor there does; adapters on the LLM only leave the tower frozen.
TEST(MemoryPlanLora, VisionAdaptersPlanTheTowersBackward) {
  const ModelConfig config = model_config_preset("tiny-vl");
  LoraOptions all_linear;
  all_linear.rank = 4;
  all_linear.alpha = 8;
  all_linear.target_modules = {"all-linear"};
  const LoraAdapters lora = init_lora_adapters(config, all_linear, 1);
  MemoryPlan plan;
  plan_state_bytes(config, FreezeOptions{true, true, false}, DType::f32, &plan, &lora);
  EXPECT_TRUE(plan.vit_trained);
  EXPECT_TRUE(plan.merger_trained);
  LoraOptions merger_only = all_linear;
  merger_only.target_modules = {"merger.linear_fc1", "merger.linear_fc2"};
  const LoraAdapters merger = init_lora_adapters(config, merger_only, 1);
  MemoryPlan merger_plan;
  plan_state_bytes(config, FreezeOptions{true, true, false}, DType::f32, &merger_plan, &merger);
  EXPECT_FALSE(merger_plan.vit_trained);
  EXPECT_TRUE(merger_plan.merger_trained);
}

// The adapters' scratch is in the plan: the text workspace grows by estimate_text_lora_bytes, which
// holds at least the routed experts' fp32 low-rank product [T K, 2 I] and per-expert B copies; the
// vision workspace by the tower's rows when it carries adapters, and not otherwise.
TEST(MemoryPlanLora, CountsTheAdaptersScratch) {
  const ModelConfig config = model_config_preset("tiny-vl");
  EngineOptions options;
  options.max_tokens = 512;
  options.max_image_pixels = 8 * 8 * 32 * 32;
  const MemoryPlan full = plan_training_memory(config, options);
  LoraOptions lora_options;
  lora_options.rank = 8;
  lora_options.alpha = 16;
  lora_options.target_modules = {"all-linear"};
  lora_options.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  options.lora = std::make_shared<const LoraAdapters>(init_lora_adapters(config, lora_options, 1));
  const MemoryPlan lora = plan_training_memory(config, options);
  const TextConfig& text = config.text;
  const size_t scratch = estimate_text_lora_bytes(text, options.max_tokens, 8);
  EXPECT_EQ(lora.text.workspace, full.text.workspace + scratch);
  const size_t experts_product =
      static_cast<size_t>(options.max_tokens * text.num_experts_per_tok * 2 * text.moe_intermediate_size) * 4;
  const size_t b_copies = static_cast<size_t>(text.num_experts * 2 * text.moe_intermediate_size * 8) * (2 + 4);
  EXPECT_GE(scratch, experts_product + b_copies);
  ASSERT_GT(lora.max_patches, 0);
  EXPECT_EQ(lora.vision.workspace, full.vision.workspace + estimate_vision_lora_bytes(lora.max_patches, 8));
  EXPECT_EQ(estimate_vision_lora_bytes(lora.max_patches, 8), static_cast<size_t>(2 * lora.max_patches * 8 * 2));

  // LoRA dropout (all-linear, no experts): each side's dropping adapters' scratch, [rows, widest
  // dense input] fp32: the text model's widest input is one of hidden, GDN value width, attention
  // heads x head_dim, shared expert width; the tower's the merger's merged width.
  LoraOptions dropout_options = lora_options;
  dropout_options.target_parameters.clear();
  const MemoryPlan no_dropout = plan_training_memory(
      config, [&] {
        EngineOptions o = options;
        o.lora = std::make_shared<const LoraAdapters>(init_lora_adapters(config, dropout_options, 1));
        return o;
      }());
  dropout_options.dropout = 0.1;
  EngineOptions dropping = options;
  dropping.lora = std::make_shared<const LoraAdapters>(init_lora_adapters(config, dropout_options, 1));
  const MemoryPlan with_dropout = plan_training_memory(config, dropping);
  const int64_t text_in = std::max({text.hidden_size, text.linear_num_value_heads * text.linear_value_head_dim,
                                    text.num_attention_heads * text.head_dim, text.shared_expert_intermediate_size});
  EXPECT_EQ(lora_dense_max_in_features(dropping.lora->targets, false), text_in);
  EXPECT_EQ(lora_dense_max_in_features(dropping.lora->targets, true), config.vision.merged_dim());
  EXPECT_EQ(with_dropout.text.workspace,
            no_dropout.text.workspace + lora_dropout_scratch_bytes(options.max_tokens, text_in));
  EXPECT_EQ(with_dropout.vision.workspace,
            no_dropout.vision.workspace + lora_dropout_scratch_bytes(with_dropout.max_patches, config.vision.merged_dim()));

  lora_options.target_modules = {"q_proj", "v_proj"};
  options.lora = std::make_shared<const LoraAdapters>(init_lora_adapters(config, lora_options, 1));
  const MemoryPlan llm_only = plan_training_memory(config, options);
  EXPECT_EQ(llm_only.vision.workspace, full.vision.workspace) << "no adapter in the tower: no tower scratch";
  EXPECT_FALSE(llm_only.vit_trained);
}

}  // namespace
}  // namespace deltamoe
