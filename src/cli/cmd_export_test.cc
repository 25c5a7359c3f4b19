// `deltamoe export`: refusals with their reasons (no --merge_lora, a folder that is not an adapter,
// a non-empty output, an adapter that does not fit the base model). The merge itself is checked in
// lora_train_test (logits) and lora_golden_test (against PEFT).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/peft_adapter.h"
#include "checkpoint/random_init.h"
#include "testing/run_deltamoe.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

TEST(CmdExport, RefusesWhatItCannotMerge) {
  const fs::path root = fs::temp_directory_path() / ("deltamoe_export_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  const ModelConfig config = model_config_preset("tiny");
  save_model_dir(random_init_checkpoint(config, 0, DType::f32), (root / "base").string());
  LoraOptions options;
  options.rank = 2;
  options.target_modules = {"q_proj"};
  fs::create_directories(root / "adapter");
  save_peft_adapter((root / "adapter").string(), init_lora_adapters(config, options, 3), (root / "base").string());

  const std::string adapter = (root / "adapter").string(), out = (root / "out").string();
  CommandResult r = run_deltamoe("export --adapters " + adapter + " --output_dir " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("give --merge_lora true"), std::string::npos) << r.output;
  r = run_deltamoe("export --adapters " + (root / "base").string() + " --merge_lora true --output_dir " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no adapter_config.json"), std::string::npos) << r.output;
  fs::create_directories(root / "full");
  std::ofstream(root / "full" / "x") << "x";
  r = run_deltamoe("export --adapters " + adapter + " --merge_lora true --output_dir " + (root / "full").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("exists and is not empty"), std::string::npos) << r.output;
  // An adapter of q_proj does not fit a model without full-attention layers of that name.
  ModelConfig other = config;
  for (LayerType& type : other.text.layer_types) type = LayerType::linear_attention;
  save_model_dir(random_init_checkpoint(other, 0, DType::f32), (root / "other").string());
  r = run_deltamoe("export --adapters " + adapter + " --merge_lora true --model " + (root / "other").string() +
                   " --output_dir " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("adapter_config.json does not fit the base model"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("self_attn.q_proj matches no module"), std::string::npos) << r.output;
  // And the good case writes a model directory.
  r = run_deltamoe("export --adapters " + adapter + " --merge_lora true --output_dir " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(out) / "config.json"));
  fs::remove_all(root);
}

}  // namespace
}  // namespace deltamoe
