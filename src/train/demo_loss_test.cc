// The README's demo as a test: tools/demo/run_demo.sh (tiny-vl + demo tokenizer + generated image
// and text chats, 60 training steps, fixed seed) must halve the validation loss within 10 minutes,
// in full fine-tuning and in LoRA mode (DEMO_TUNER=lora on the CPU engine).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train/train_test_util.h"

namespace deltamoe {
namespace {

using namespace train_test;

// Runs the demo with env (VAR=value ...) and checks that the validation loss halves.
void run_demo_and_check(const std::string& env, const std::string& name, bool lora) {
  ASSERT_TRUE(deltamoe_binary_set());
  const std::string binary = deltamoe_binary();
  const fs::path out = fresh_temp_dir(name);
  const auto start = std::chrono::steady_clock::now();
  const std::string command = str_cat("cd ", source_dir(), " && ", env, " bash tools/demo/run_demo.sh ", binary, " ",
                                      (out / "demo").string(), " > ", (out / "demo.log").string(), " 2>&1");
  const int status = std::system(command.c_str());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string log = read_bytes(out / "demo.log");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the demo failed:\n" << log;

  std::vector<double> val_losses;
  std::ifstream metrics(out / "demo" / "run" / "metrics.jsonl");
  std::string line;
  while (std::getline(metrics, line)) {
    const nlohmann::json json = nlohmann::json::parse(line);
    if (json.at("type") == "eval") val_losses.push_back(json.at("val_loss").get<double>());
  }
  ASSERT_GE(val_losses.size(), 2u);
  std::printf("  demo: %.1f s, validation loss %.4f -> %.4f (ratio %.3f)\n", seconds, val_losses.front(),
              val_losses.back(), val_losses.back() / val_losses.front());
  EXPECT_LE(val_losses.back(), 0.5 * val_losses.front());
  EXPECT_LT(seconds, 600.0) << "the demo must finish in under 10 minutes";
  if (lora) {
    EXPECT_NE(log.find("train: LoRA r 8"), std::string::npos) << log;
    EXPECT_TRUE(fs::exists(out / "demo" / "run" / "checkpoint-60" / "adapter_model.safetensors"));
    EXPECT_FALSE(fs::exists(out / "demo" / "run" / "checkpoint-60" / "model.safetensors"));
  }
  fs::remove_all(out);
}

TEST(DemoLoss, ValidationLossHalvesWithinTenMinutes) { run_demo_and_check("", "demo", false); }

TEST(DemoLoss, LoraValidationLossHalvesWithinTenMinutes) {
  run_demo_and_check("DEMO_TUNER=lora DEMO_DEVICE=cpu", "demo_lora", true);
}

}  // namespace
}  // namespace deltamoe
