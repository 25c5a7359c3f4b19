// The memory plan of a LoRA run: the base frozen whole (bf16 weights and the fp32 copies the models
// read, no master, gradient or moments), the adapters (and --modules_to_save) trained; and the plan
// of the headline run (Qwen3.5-35B-A3B, 40 layers, 8,192 tokens, attention + GDN + expert adapters r 8)
// printed and within one H200 (137 GiB).
#include <gtest/gtest.h>

#include <cstdio>
#include <utility>

#include "checkpoint/random_init.h"
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
  options.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv",
                            "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"};
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
  EXPECT_FALSE(lora_plan.vit_trained);
  EXPECT_FALSE(lora_plan.merger_trained);
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
  const MemoryPlan plan = plan_training_memory(config, options);
  std::printf("35B LoRA (attention + GDN + routed experts, r 8), 8192 tokens, images up to 20x24 merged tokens:\n%s",
              plan.describe().c_str());
  EXPECT_LE(plan.total(), size_t{137} << 30);
  EXPECT_LT(plan.master, size_t{4} << 30) << "only adapters have a master";
}

}  // namespace
}  // namespace deltamoe
