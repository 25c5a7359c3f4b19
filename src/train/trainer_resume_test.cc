// Exact resume and crash-safe saves: 20 steps straight equal 10 + --resume + 10 bit for bit
// (weights, master weights, Adam moments, counters), and a process killed in the middle of a save
// leaves the previous checkpoint loadable and resumable.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "optim/optimizer_state.h"
#include "train/train_checkpoint.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

namespace deltamoe {
namespace {

using namespace train_test;

class TrainerResumeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("trainer_resume"));
    make_tiny_vl_fixture(*root_, 48, 8);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* TrainerResumeTest::root_ = nullptr;

// Names of the regular files directly in `dir`, sorted.
std::vector<std::string> file_names(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// trainer_state.json without its wall-clock field, the one thing two equal runs may differ in.
nlohmann::json trainer_state_without_time(const fs::path& dir) {
  nlohmann::json json = nlohmann::json::parse(read_bytes(dir / "trainer_state.json"));
  EXPECT_TRUE(json.contains("elapsed_s")) << dir;
  json.erase("elapsed_s");
  return json;
}

// The two checkpoint directories hold the same files (neither has one the other lacks), each
// byte-identical (model shards, index, config, tokenizer, optimizer state with its checksums)
// except trainer_state.json, which must be equal but for elapsed_s (global step, tokens seen, data
// and rng positions).
void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  const std::vector<std::string> names = file_names(a);
  ASSERT_EQ(names, file_names(b)) << a << " and " << b << " hold different files";
  size_t num_files = 0;
  for (const std::string& name : names) {
    if (name == "trainer_state.json") continue;  // holds elapsed time; compared below
    EXPECT_TRUE(read_bytes(a / name) == read_bytes(b / name)) << name << " differs";
    ++num_files;
  }
  EXPECT_EQ(trainer_state_without_time(a), trainer_state_without_time(b)) << "trainer_state.json differs";
  const TrainerState state_a = load_trainer_state(a.string()), state_b = load_trainer_state(b.string());
  EXPECT_EQ(state_a.global_step, state_b.global_step);
  EXPECT_EQ(state_a.tokens_seen, state_b.tokens_seen);
  EXPECT_EQ(state_a.data_position, state_b.data_position);
  EXPECT_EQ(state_a.rng_position, state_b.rng_position);
  std::printf("  %zu files in both, %zu compared bit for bit, trainer_state.json but for elapsed_s\n",
              names.size(), num_files);
  EXPECT_GE(num_files, 4u);
}

// The "train" lines of a metrics file have steps 1, 2, ..., num_steps once each (a resumed run
// replaces what the interrupted one wrote after its checkpoint).
void expect_metrics_steps(const fs::path& metrics, int64_t num_steps) {
  std::ifstream in(metrics);
  std::string line;
  int64_t expected = 1;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line);
    if (json.at("type") != "train") continue;
    EXPECT_EQ(json.at("step").get<int64_t>(), expected) << metrics;
    ++expected;
  }
  EXPECT_EQ(expected, num_steps + 1) << metrics;
}

TEST_F(TrainerResumeTest, TwentyStepsEqualTenPlusResumePlusTen) {
  TrainOptions straight = small_run_options(*root_);
  straight.max_steps = 20;
  straight.output_dir = (*root_ / "straight").string();
  const TrainSummary full = run_training(straight, "cpu");
  EXPECT_EQ(full.steps_done, 20);

  TrainOptions first_half = straight;
  first_half.output_dir = (*root_ / "split").string();
  first_half.stop_after_steps = 10;
  const TrainSummary part1 = run_training(first_half, "cpu");
  EXPECT_EQ(part1.steps_done, 10);
  TrainOptions second_half = first_half;
  second_half.stop_after_steps = 0;
  second_half.resume = "auto";
  const TrainSummary part2 = run_training(second_half, "cpu");
  EXPECT_EQ(part2.steps_done, 20);
  EXPECT_EQ(part2.steps_this_run, 10);

  expect_same_checkpoint(*root_ / "straight" / "checkpoint-20", *root_ / "split" / "checkpoint-20");
  expect_metrics_steps(*root_ / "split" / "metrics.jsonl", 20);
  // The training loss moved (the comparison is not between two untrained models).
  std::printf("  loss %.4f -> %.4f\n", full.first_loss, full.last_loss);
  EXPECT_LT(full.last_loss, full.first_loss);
}

TEST_F(TrainerResumeTest, KilledSaveLeavesPreviousCheckpointLoadable) {
  const std::string binary = std::getenv("DELTAMOE_BINARY") != nullptr ? std::getenv("DELTAMOE_BINARY") : "";
  ASSERT_FALSE(binary.empty()) << "DELTAMOE_BINARY is not set (run through ctest)";
  const fs::path out = *root_ / "killed";
  const std::string command =
      str_cat("DELTAMOE_FAIL_SAVE_AT_STEP=4 ", binary, " train --model ", (*root_ / "tiny-vl").string(),
              " --dataset ", (*root_ / "data" / "train.jsonl").string(), " --output_dir ", out.string(),
              " --max_steps 6 --save_steps 2 --lr 1e-3 --max_length 128 --micro_batch_tokens 256",
              " --min_pixels 4096 --max_pixels 4096 --dataloader_num_workers 1 --seed 7 > ", (*root_ / "killed.log").string(),
              " 2>&1");
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 86) << "the injected failure did not end the process; log: "
                                      << read_bytes(*root_ / "killed.log");
  EXPECT_FALSE(fs::exists(out / "checkpoint-4")) << "a half-written save appeared under its final name";
  EXPECT_TRUE(fs::exists(out / ".checkpoint-4.tmp")) << "the save did not get as far as the model files";
  ASSERT_TRUE(fs::exists(out / "checkpoint-2"));

  // The previous checkpoint loads completely: model, trainer state, optimizer state (checksums).
  const ModelCheckpoint model = load_model_dir((out / "checkpoint-2").string());
  EXPECT_TRUE(fs::exists(out / "checkpoint-2" / "tokenizer.json"));
  const TrainerState state = load_trainer_state((out / "checkpoint-2").string());
  EXPECT_EQ(state.global_step, 2);
  EXPECT_EQ(resolve_resume_dir("auto", out.string()), (out / "checkpoint-2").string());

  // And the run continues from it to the end.
  TrainOptions resume = small_run_options(*root_);
  resume.gradient_accumulation_steps = 1;
  resume.schedule = {};
  resume.schedule.lr = 1e-3;
  resume.max_steps = 6;
  resume.save_steps = 2;
  resume.output_dir = out.string();
  resume.freeze = FreezeOptions{};
  resume.resume = "auto";
  const TrainSummary summary = run_training(resume, "cpu");
  EXPECT_EQ(summary.steps_done, 6);
  EXPECT_EQ(summary.steps_this_run, 4);
  EXPECT_TRUE(fs::exists(out / "checkpoint-6" / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(out / ".checkpoint-4.tmp")) << "the leftover temporary save was not cleaned up";
  expect_metrics_steps(out / "metrics.jsonl", 6);
}

}  // namespace
}  // namespace deltamoe
