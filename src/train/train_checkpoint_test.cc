// The save path's guarantees: --save_only_model writes the model directory only and --resume
// refuses it with a message; a save that would not fit is refused before it writes, naming both
// sizes; a save that fails half-way leaves the previous checkpoints as they were and no temporary
// files.
#include <gtest/gtest.h>

#include <cstdlib>

#include "optim/host_train_state.h"
#include "testing/error_of.h"
#include "train/train_checkpoint.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

namespace deltamoe {
namespace {

using namespace train_test;

class TrainCheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("train_checkpoint"));
    make_tiny_vl_fixture(*root_, 8, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* TrainCheckpointTest::root_ = nullptr;

TEST_F(TrainCheckpointTest, SaveOnlyModelWritesTheModelAndCannotBeResumed) {
  TrainOptions options = small_run_options(*root_);
  options.output_dir = (*root_ / "model_only").string();
  options.max_steps = 2;
  options.save_only_model = true;
  const TrainSummary summary = run_training(options, "cpu");
  const fs::path dir = summary.last_checkpoint;
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "config.json"));
  EXPECT_TRUE(fs::exists(dir / "tokenizer.json"));
  EXPECT_FALSE(fs::exists(dir / "optimizer.safetensors"));
  EXPECT_TRUE(load_trainer_state(dir.string()).model_only);
  // The weights are the trained ones: they differ from the starting model.
  const ModelCheckpoint before = load_model_dir(options.model_dir), after = load_model_dir(dir.string());
  const std::string name = "lm_head.weight";
  EXPECT_FALSE(before.params.at(name).bitwise_equal(after.params.at(name)));

  options.resume = "auto";
  options.max_steps = 3;
  const std::string message = error_of([&] { run_training(options, "cpu"); });
  std::printf("resume error: %s\n", message.c_str());
  EXPECT_NE(message.find("--save_only_model"), std::string::npos) << message;
  options.resume = dir.string();
  const std::string direct = error_of([&] { run_training(options, "cpu"); });
  std::printf("resume error: %s\n", direct.c_str());
  EXPECT_NE(direct.find("--save_only_model"), std::string::npos) << direct;
}

TEST_F(TrainCheckpointTest, ASaveThatDoesNotFitIsRefusedBeforeWriting) {
  TrainOptions options = small_run_options(*root_);
  options.output_dir = (*root_ / "no_space").string();
  options.max_steps = 2;
  options.save_steps = 1;
  ::setenv("DELTAMOE_TEST_FREE_BYTES", "1000", 1);
  const std::string message = error_of([&] { run_training(options, "cpu"); });
  ::unsetenv("DELTAMOE_TEST_FREE_BYTES");
  std::printf("save error: %s\n", message.c_str());
  EXPECT_NE(message.find("checkpoint-1 needs"), std::string::npos) << message;
  EXPECT_NE(message.find("0.00 GiB are free"), std::string::npos) << message;
  EXPECT_NE(message.find("--save_only_model"), std::string::npos) << message;
  for (const auto& entry : fs::directory_iterator(options.output_dir))
    EXPECT_EQ(entry.path().filename().string().find("checkpoint"), std::string::npos) << entry.path();
}

// A state whose master cannot be read back after a few tensors (a device copy that fails).
class BrokenState : public HostTrainState {
 public:
  using HostTrainState::HostTrainState;
  void read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const override {
    if (kind == StateKind::exp_avg_sq) RAISE("simulated failure while reading the state");
    HostTrainState::read_state(kind, index, first, count, host);
  }
};

TEST_F(TrainCheckpointTest, AFailedSaveLeavesThePreviousCheckpointsAndNoTemporaryFiles) {
  TrainOptions options = small_run_options(*root_);
  options.output_dir = (*root_ / "failed_save").string();
  options.max_steps = 1;
  const TrainSummary summary = run_training(options, "cpu");
  const std::string before = read_bytes(fs::path(summary.last_checkpoint) / "optimizer.safetensors");

  const ModelCheckpoint model = load_model_dir(options.model_dir);
  ParamLayout layout;
  layout.add("lm_head.weight", model.params.at("lm_head.weight").shape().to_vector());
  BrokenState state(layout, AdamWConfig{});
  for (const int64_t step : {int64_t{1}, int64_t{2}}) {  // over the existing checkpoint-1, and a new one
    CheckpointPayload payload;
    payload.model = &model;
    payload.side_files_dir = options.model_dir;
    payload.train_state = &state;
    payload.state.global_step = step;
    payload.state.total_steps = 2;
    const std::string message = error_of([&] { save_training_checkpoint(options.output_dir, payload); });
    EXPECT_NE(message.find("simulated failure"), std::string::npos) << message;
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(options.output_dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) std::printf("  left in the output folder: %s\n", name.c_str());
  EXPECT_EQ(std::count(names.begin(), names.end(), "checkpoint-1"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "checkpoint-2"), 0);
  for (const std::string& name : names) EXPECT_EQ(name.find(".tmp"), std::string::npos) << name;
  EXPECT_EQ(read_bytes(fs::path(summary.last_checkpoint) / "optimizer.safetensors"), before);
}

}  // namespace
}  // namespace deltamoe
