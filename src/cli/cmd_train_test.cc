// `deltamoe train` through the binary: bad flags, paths and combinations fail before any work with
// a message naming the flag; a config file supplies flags and the command line overrides them.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <fstream>

#include "testing/run_deltamoe.h"
#include "train/train_test_util.h"

namespace deltamoe {
namespace {

using namespace train_test;

class CmdTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("cmd_train"));
    make_tiny_vl_fixture(*root_, 8, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }

  static CommandResult run(const std::string& flags) { return run_deltamoe("train " + flags); }
  // Flags of a valid short run; cases replace one of them.
  static std::string good(const std::string& extra = "") {
    return str_cat("--model ", (*root_ / "tiny-vl").string(), " --dataset ", (*root_ / "data" / "train.jsonl").string(),
                   " --output_dir ", (*root_ / "out").string(), " --max_length 128 --min_pixels 4096 --max_pixels 4096 ",
                   extra);
  }
  static fs::path* root_;
};
fs::path* CmdTrainTest::root_ = nullptr;

TEST_F(CmdTrainTest, BadInputFailsBeforeAnyWork) {
  struct Case {
    std::string flags;
    std::string message;
  };
  const std::string model = (*root_ / "tiny-vl").string();
  const std::string data = (*root_ / "data" / "train.jsonl").string();
  const std::string out = (*root_ / "out").string();
  const std::vector<Case> cases = {
      {good("--learning_rat 1e-4"), "did you mean --learning_rate"},
      {str_cat("--model ", model, " --output_dir ", out), "needs --dataset"},
      {str_cat("--model ", model, " --dataset /nonexistent/a.jsonl --output_dir ", out), "--dataset: no such file '/nonexistent/a.jsonl'"},
      {str_cat("--model ", root_->string(), " --dataset ", data, " --output_dir ", out), "no config.json"},
      {str_cat("--model ", model, " --dataset ", data, " --output_dir ", model), "--output_dir must differ from --model"},
      {good("--lr -1"), "--lr must be positive"},
      {good("--lr abc"), "--lr"},
      {good("--micro_batch_tokens 64"), "--micro_batch_tokens (64) must be at least --max_length (128)"},
      {good("--eval_steps 5"), "--eval_steps needs --val_dataset or --split_dataset_ratio"},
      {good("--freeze_vit maybe"), "--freeze_vit takes true or false"},
      {good("--warmup_ratio 2"), "warmup"},
      {good("--adam_beta2 1.5"), "--adam_beta2"},
      {good("--tuner_type lora --lora_dropout 1"), "--lora_dropout must be in [0, 1)"},
      {good("--tuner_type lora --lora_dropout 0.05 --target_parameters mlp.experts.down_proj"),
       "PEFT's ParamWrapper refuses lora_dropout"},
      {good("--tuner_type lora --target_modules gate"), "is not a Linear layer in transformers"},
      {good("--lora_rank 4"), "--lora_rank is a LoRA setting; it needs --tuner_type lora"},
      {good("--tuner_type qlora"), "--tuner_type qlora is not supported"},
      {good("--split_dataset_ratio 1.5"), "--split_dataset_ratio must be in [0, 1)"},
      {good(str_cat("--split_dataset_ratio 0.2 --val_dataset ", data)), "not both"},
      {good("--resume /tmp"), "not a training checkpoint"},
      {good("--resume auto"), "no complete checkpoint-N directory"},
      {good("--device tpu"), "--device must be auto, cpu or cuda"},
#if !defined(DELTAMOE_WITH_CUDA)
      {good("--device cuda"), "--device cuda: this build has no GPU training engine"},
#endif
      {good("--optimizer_state_dtype f16"), "--optimizer_state_dtype must be f32 or bf16"},
      {good("--config /nonexistent.json"), "--config: cannot read /nonexistent.json"},
  };
  for (const Case& c : cases) {
    const CommandResult result = run(c.flags);
    EXPECT_EQ(result.exit_code, 1) << c.flags << "\n" << result.output;
    EXPECT_NE(result.output.find(c.message), std::string::npos)
        << "expected '" << c.message << "' for: " << c.flags << "\ngot: " << result.output;
    EXPECT_EQ(result.output.find("step 1/"), std::string::npos) << "training started for: " << c.flags;
  }
}

TEST_F(CmdTrainTest, ConfigFileSuppliesFlagsAndCommandLineWins) {
  const fs::path config = *root_ / "run.json";
  {
    std::ofstream file(config);
    file << "{\"model\": \"" << (*root_ / "tiny-vl").string() << "\", \"dataset\": [\""
         << (*root_ / "data" / "train.jsonl").string() << "\"], \"output_dir\": \"" << (*root_ / "from_config").string()
         << "\", \"max_steps\": 5, \"lr\": 1e-3, \"freeze_vit\": false, \"max_length\": 128, \"min_pixels\": 4096,"
         << " \"max_pixels\": 4096, \"save_steps\": 1, \"save_total_limit\": 1}";
  }
  const CommandResult result = run(str_cat("--config ", config.string(), " --max_steps 2"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("step 2/2"), std::string::npos) << result.output;
  EXPECT_TRUE(fs::exists(*root_ / "from_config" / "checkpoint-2" / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(*root_ / "from_config" / "checkpoint-1")) << "--save_total_limit 1 kept an older checkpoint";
  EXPECT_TRUE(fs::exists(*root_ / "from_config" / "metrics.jsonl"));

  std::ofstream bad(*root_ / "bad.json");
  bad << "{\"lr\": [1, 2]}";
  bad.close();
  const CommandResult bad_result = run(good(str_cat("--config ", (*root_ / "bad.json").string())));
  EXPECT_EQ(bad_result.exit_code, 1);
  EXPECT_NE(bad_result.output.find("'lr' must be a list of strings"), std::string::npos) << bad_result.output;
}

TEST_F(CmdTrainTest, SplitDatasetRatioHoldsOutSeededValidationSamples) {
  const fs::path out = *root_ / "split_run";
  const CommandResult result = run(str_cat("--model ", (*root_ / "tiny-vl").string(), " --dataset ",
                                        (*root_ / "data" / "train.jsonl").string(), " --output_dir ", out.string(),
                                        " --max_length 128 --min_pixels 4096 --max_pixels 4096 --max_steps 1",
                                        " --split_dataset_ratio 0.25 --seed 3"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("eval step 0/1"), std::string::npos) << result.output;
  auto lines_of = [](const fs::path& path) {
    std::vector<std::string> lines;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  };
  const auto train = lines_of(out / "dataset_split" / "train.jsonl");
  const auto val = lines_of(out / "dataset_split" / "val.jsonl");
  std::printf("  split: %zu train, %zu val\n", train.size(), val.size());
  EXPECT_EQ(train.size(), 6u);
  EXPECT_EQ(val.size(), 2u);
  // Images now carry absolute paths that exist (the split files live elsewhere than the data).
  size_t num_images = 0;
  for (const auto* lines : {&train, &val}) {
    for (const std::string& line : *lines) {
      const std::string key = "\"image\":\"";
      for (size_t at = line.find(key); at != std::string::npos; at = line.find(key, at + 1)) {
        const size_t begin = at + key.size(), end = line.find('"', begin);
        const fs::path image = line.substr(begin, end - begin);
        EXPECT_TRUE(image.is_absolute() && fs::exists(image)) << image;
        ++num_images;
      }
    }
  }
  EXPECT_EQ(num_images, 4u) << "the fixture has 4 samples with one image each";
}

TEST_F(CmdTrainTest, SigtermFinishesTheStepSavesAndResumes) {
  ASSERT_TRUE(deltamoe_binary_set());
  const std::string binary = deltamoe_binary();
  const fs::path out = *root_ / "sigterm";
  const fs::path log = *root_ / "sigterm.log";
  const std::string flags = str_cat("--model ", (*root_ / "tiny-vl").string(), " --dataset ",
                                    (*root_ / "data" / "train.jsonl").string(), " --output_dir ", out.string(),
                                    " --max_length 128 --min_pixels 4096 --max_pixels 4096 --max_steps 500");
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string command = str_cat("exec ", binary, " train ", flags, " > ", log.string(), " 2>&1");
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for the first step, then ask the run to stop as a cluster scheduler would.
  bool started = false;
  for (int i = 0; i < 1200 && !started; ++i) {
    started = read_bytes(log).find("step 1/500") != std::string::npos;
    if (!started) usleep(100000);
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(started) << read_bytes(log);
  ASSERT_TRUE(WIFEXITED(status)) << "the process did not exit normally after SIGTERM:\n" << read_bytes(log);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_bytes(log);
  int64_t saved_step = -1;
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("checkpoint-")) saved_step = std::stoll(name.substr(11));
  }
  std::printf("  stopped and saved at step %lld of 500\n", static_cast<long long>(saved_step));
  ASSERT_GE(saved_step, 1) << read_bytes(log);
  EXPECT_LT(saved_step, 500);
  const CommandResult resumed = run(str_cat(flags, " --resume auto --stop_after_steps 1"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(fs::exists(out / str_cat("checkpoint-", saved_step + 1))) << resumed.output;
}

}  // namespace
}  // namespace deltamoe
