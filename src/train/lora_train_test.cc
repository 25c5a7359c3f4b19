// LoRA training on the CPU engine (tiny-vl, all-linear + the experts): only the adapters are in the
// training state, a checkpoint is a PEFT adapter directory that loads back to the state's values,
// 8 steps straight equal 4 + --resume + 4 bit for bit, and `deltamoe export --merge_lora` writes
// the merged model, whose logits equal the adapter model's (f32 base); with --lora_dropout, resume
// stays bit-exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "checkpoint/peft_adapter.h"
#include "checkpoint/random_init.h"
#include "train/parity.h"
#include "train/train_checkpoint.h"
#include "train/train_test_util.h"
#include "train/trainable_params.h"
#include "train/trainer.h"

namespace deltamoe {
namespace {

using namespace train_test;

class LoraTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("lora_train"));
    make_tiny_vl_fixture(*root_, 32, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* LoraTrainTest::root_ = nullptr;

TrainOptions lora_options(const fs::path& root, const std::string& out, const std::string& model = "tiny-vl") {
  TrainOptions options = small_run_options(root);
  options.model_dir = (root / model).string();
  options.output_dir = (root / out).string();
  options.tuner_type = "lora";
  options.lora.rank = 4;
  options.lora.alpha = 8;
  options.lora.target_modules = {"all-linear"};
  options.lora.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  options.schedule.lr = 1e-2;
  options.freeze = FreezeOptions{};
  return options;
}

std::vector<std::string> file_names(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(LoraTrainTest, CheckpointsArePeftAdaptersAndResumeIsBitExact) {
  TrainOptions straight = lora_options(*root_, "straight");
  straight.max_steps = 8;
  straight.save_steps = 4;
  const TrainSummary full = run_training(straight, "cpu");
  EXPECT_EQ(full.steps_done, 8);
  std::printf("  loss %.4f -> %.4f\n", full.first_loss, full.last_loss);
  EXPECT_LT(full.last_loss, full.first_loss);

  const fs::path ckpt = *root_ / "straight" / "checkpoint-8";
  const std::vector<std::string> names = file_names(ckpt);
  EXPECT_TRUE(std::count(names.begin(), names.end(), "adapter_model.safetensors"));
  EXPECT_TRUE(std::count(names.begin(), names.end(), "adapter_config.json"));
  EXPECT_FALSE(std::count(names.begin(), names.end(), "model.safetensors")) << "a LoRA checkpoint holds no base weights";
  EXPECT_EQ(checkpoint_problem(ckpt.string()), "");
  // The adapter loads back; its B moved away from zero; the optimizer state holds the adapters only.
  const ModelCheckpoint base = load_model_dir((*root_ / "tiny-vl").string());
  const LoraAdapters loaded = load_peft_adapter(ckpt.string(), base.config);
  const LoraAdapters expected = init_lora_adapters(base.config, straight.lora, straight.seed);
  EXPECT_EQ(loaded.targets.size(), expected.targets.size());
  double max_b = 0;
  for (const LoraTarget& t : loaded.targets) {
    const HostTensor& b = loaded.tensors.at(t.b_name());
    for (int64_t i = 0; i < b.numel(); ++i) max_b = std::max(max_b, double(std::abs(b.as<float>()[i])));
  }
  EXPECT_GT(max_b, 1e-4);
  const ParamLayout layout = lora_layout(base, loaded);
  EXPECT_EQ(layout.num_tensors(), static_cast<int>(2 * loaded.targets.size()));
  EXPECT_EQ(peft_adapter_base_model(ckpt.string()), fs::absolute(straight.model_dir).string());

  TrainOptions first = lora_options(*root_, "split");
  first.max_steps = 8;
  first.save_steps = 4;
  first.stop_after_steps = 4;
  EXPECT_EQ(run_training(first, "cpu").steps_done, 4);
  TrainOptions second = first;
  second.stop_after_steps = 0;
  second.resume = "auto";
  const TrainSummary part2 = run_training(second, "cpu");
  EXPECT_EQ(part2.steps_done, 8);
  EXPECT_EQ(part2.steps_this_run, 4);
  const fs::path resumed = *root_ / "split" / "checkpoint-8";
  ASSERT_EQ(file_names(resumed), names);
  for (const char* file : {"adapter_model.safetensors", "optimizer.safetensors", "adapter_config.json"}) {
    EXPECT_TRUE(read_bytes(ckpt / file) == read_bytes(resumed / file)) << file << " differs after --resume";
  }
}

// --lora_dropout > 0 (all-linear; PEFT refuses dropout on the experts): the masks come from (seed,
// optimizer step, micro-batch, adapter, row, column), so 6 steps straight equal 3 + --resume + 3 bit
// for bit with no RNG state saved, and the dropout changes what is learned.
TEST_F(LoraTrainTest, DropoutRunsResumeBitExact) {
  auto dropout_options = [&](const std::string& out, double p) {
    TrainOptions options = lora_options(*root_, out);
    options.lora.target_parameters.clear();
    options.lora.dropout = p;
    options.max_steps = 6;
    options.save_steps = 3;
    return options;
  };
  const TrainSummary full = run_training(dropout_options("dropout_straight", 0.2), "cpu");
  EXPECT_EQ(full.steps_done, 6);
  std::printf("  dropout 0.2: loss %.4f -> %.4f\n", full.first_loss, full.last_loss);
  EXPECT_LT(full.last_loss, full.first_loss);
  const fs::path ckpt = *root_ / "dropout_straight" / "checkpoint-6";
  EXPECT_NE(read_bytes(ckpt / "adapter_config.json").find("\"lora_dropout\": 0.2"), std::string::npos);

  TrainOptions first = dropout_options("dropout_split", 0.2);
  first.stop_after_steps = 3;
  EXPECT_EQ(run_training(first, "cpu").steps_done, 3);
  TrainOptions second = first;
  second.stop_after_steps = 0;
  second.resume = "auto";
  EXPECT_EQ(run_training(second, "cpu").steps_this_run, 3);
  const fs::path resumed = *root_ / "dropout_split" / "checkpoint-6";
  for (const char* file : {"adapter_model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(read_bytes(ckpt / file) == read_bytes(resumed / file)) << file << " differs after --resume";
  }
  run_training(dropout_options("dropout_none", 0.0), "cpu");
  EXPECT_FALSE(read_bytes(ckpt / "adapter_model.safetensors") ==
               read_bytes(*root_ / "dropout_none" / "checkpoint-6" / "adapter_model.safetensors"))
      << "--lora_dropout 0.2 trained the same adapters as 0";
}

TEST_F(LoraTrainTest, MergedExportGivesTheAdapterModelsLogits) {
  // An f32 copy of the fixture's model, so the merged weights are not rounded to bf16.
  const ModelCheckpoint bf16 = load_model_dir((*root_ / "tiny-vl").string());
  const ModelCheckpoint f32 = random_init_checkpoint(bf16.config, 0, DType::f32);
  save_model_dir(f32, (*root_ / "tiny-vl-f32").string());
  copy_side_files((*root_ / "tiny-vl").string(), (*root_ / "tiny-vl-f32").string());
  TrainOptions options = lora_options(*root_, "f32run", "tiny-vl-f32");
  options.max_steps = 3;
  run_training(options, "cpu");
  const fs::path ckpt = *root_ / "f32run" / "checkpoint-3";
  const fs::path merged_dir = *root_ / "merged";
  ASSERT_TRUE(deltamoe_binary_set());
  const std::string binary = deltamoe_binary();
  run_or_fail(str_cat(binary, " export --adapters ", ckpt.string(), " --merge_lora true --output_dir ",
                      merged_dir.string(), " > /dev/null"));
  const ModelCheckpoint base = load_model_dir((*root_ / "tiny-vl-f32").string());
  const ModelCheckpoint merged = load_model_dir(merged_dir.string());
  const LoraAdapters adapters = load_peft_adapter(ckpt.string(), base.config);

  ParityInputs inputs;
  const int64_t seq = 24;
  inputs.input_ids = HostTensor(DType::i64, Shape{1, seq});
  inputs.labels = HostTensor(DType::i64, Shape{1, seq});
  for (int64_t i = 0; i < seq; ++i) {
    inputs.input_ids.as<int64_t>()[i] = (i * 37 + 11) % 3000;
    inputs.labels.as<int64_t>()[i] = i < 6 ? -100 : (i * 37 + 11) % 3000;
  }
  TrainableParts frozen{false, false, false};
  const ParityResult with_adapter = run_parity_cpu(base, inputs, {}, &adapters);
  const ParityResult plain = run_parity_cpu(base, inputs, frozen);
  const ParityResult from_export = run_parity_cpu(merged, inputs, frozen);
  const int64_t n = with_adapter.logits.numel();
  const double diff = max_relative_difference("merged vs adapter logits", from_export.logits.as<float>(),
                                              with_adapter.logits.as<float>(), n);
  const double effect = max_relative_difference("adapter vs base logits", plain.logits.as<float>(),
                                                with_adapter.logits.as<float>(), n);
  EXPECT_LT(diff, 1e-5);
  EXPECT_GT(effect, 1e-3) << "the adapter changes nothing: the comparison would test nothing";
  EXPECT_EQ(with_adapter.grads.size(), 2 * adapters.targets.size());
}

}  // namespace
}  // namespace deltamoe
