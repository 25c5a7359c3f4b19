// The README's demo as a test: tools/demo/run_demo.sh (tiny-vl + demo tokenizer + generated image
// and text chats, 60 training steps, fixed seed) must halve the validation loss within 10 minutes.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train/train_test_util.h"

namespace deltamoe {
namespace {

using namespace train_test;

TEST(DemoLoss, ValidationLossHalvesWithinTenMinutes) {
  const char* binary = std::getenv("DELTAMOE_BINARY");
  ASSERT_NE(binary, nullptr) << "DELTAMOE_BINARY is not set (run through ctest)";
  const fs::path out = fresh_temp_dir("demo");
  const auto start = std::chrono::steady_clock::now();
  const std::string command = str_cat("cd ", source_dir(), " && bash tools/demo/run_demo.sh ", binary, " ",
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
  fs::remove_all(out);
}

}  // namespace
}  // namespace deltamoe
