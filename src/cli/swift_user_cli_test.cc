// A user coming from ms-swift, through the binary on the tiny-vl model: ms-swift's Qwen3.5-35B-A3B
// example (full fine-tuning, local paths, its environment variables) goes through in one run and
// leaves args.json, TensorBoard events, the plot and HF side files; runs never mix in one folder;
// --resume refuses a changed --lr; a dataset that would lose too much fails before step 1; an
// unknown chat template is refused; mtp.* tensors pass through saves unchanged; a hub id is found in
// a local cache.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "checkpoint/model_checkpoint.h"
#include "train/train_test_util.h"

namespace deltamoe {
namespace {

using namespace train_test;

class SwiftUserTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("swift_user"));
    make_tiny_vl_fixture(*root_, 16, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  // Runs `env deltamoe <command>` from the fixture folder (so relative paths are the user's).
  static CommandResult run(const std::string& command, const std::string& env = "") {
    if (!deltamoe_binary_set()) return {};
    return run_command(str_cat("cd ", root_->string(), " && ", env, " timeout 300 ", deltamoe_binary(), " ", command));
  }
  static std::string base(const std::string& out) {
    return str_cat("train --model tiny-vl --dataset data/train.jsonl --output_dir ", out,
                   " --max_length 128 --min_pixels 4096 --max_pixels 4096 --lr 1e-3 ");
  }
  static fs::path* root_;
};
fs::path* SwiftUserTest::root_ = nullptr;

void expect_has(const CommandResult& result, const std::string& text) {
  EXPECT_NE(result.output.find(text), std::string::npos) << "expected '" << text << "' in:\n" << result.output;
}

// ms-swift's examples/models/qwen3_5/transformers.sh with --tuner_type full instead of LoRA (and the
// LoRA flags dropped; their refusal is FlagCompat.SwiftLoraExampleStopsOnceListingWhatItCannotHonour),
// local paths, and --add_version / --report_to tensorboard as ms-swift writes runs.
TEST_F(SwiftUserTest, SwiftQwen35ExampleGoesThroughInOneRun) {
  const std::string env = "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' MAX_PIXELS=4096 VIDEO_MAX_PIXELS=50176 FPS_MAX_FRAMES=12";
  const CommandResult result = run(
      "train --model tiny-vl --tuner_type full --dataset 'data/train.jsonl#24' --load_from_cache_file true"
      " --add_non_thinking_prefix true --split_dataset_ratio 0.2 --torch_dtype bfloat16 --num_train_epochs 1"
      " --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --learning_rate 1e-4 --experts_impl grouped_mm"
      " --router_aux_loss_coef 1e-3 --gradient_accumulation_steps 1 --group_by_length true --output_dir output/Qwen3.5"
      " --eval_steps 2 --save_steps 2 --save_total_limit 2 --logging_steps 1 --max_length 2048 --warmup_ratio 0.05"
      " --dataset_num_proc 4 --dataloader_num_workers 4 --deepspeed zero3 --add_version --report_to tensorboard"
      " --min_pixels 4096",
      env);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  expect_has(result, "--experts_impl grouped_mm: no effect in deltamoe");
  expect_has(result, "VIDEO_MAX_PIXELS=50176: no effect");
  expect_has(result, "| epoch ");
  expect_has(result, "| elapsed ");
  fs::path run_dir;
  for (const auto& entry : fs::directory_iterator(*root_ / "output" / "Qwen3.5")) run_dir = entry.path();
  ASSERT_TRUE(run_dir.filename().string().starts_with("v0-")) << run_dir;
  EXPECT_TRUE(fs::exists(run_dir / "args.json"));
  EXPECT_TRUE(fs::exists(run_dir / "images" / "training.png"));
  bool has_events = false;
  for (const auto& entry : fs::directory_iterator(run_dir / "runs")) {
    has_events = has_events || entry.path().filename().string().starts_with("events.out.tfevents.");
  }
  EXPECT_TRUE(has_events);
  // 24 samples, 20% held out: 19 train / 5 val; 4 per step: 5 steps, saved at 2, 4 and 5, the newest 2 kept.
  const fs::path checkpoint = run_dir / "checkpoint-5";
  ASSERT_TRUE(fs::exists(checkpoint)) << result.output;
  for (const char* name : {"args.json", "generation_config.json", "chat_template.jinja", "config.json", "tokenizer.json",
                           "trainer_state.json"}) {
    EXPECT_TRUE(fs::exists(checkpoint / name)) << name;
  }
  const std::string args = read_bytes(checkpoint / "args.json");
  EXPECT_NE(args.find("\"micro_batch_size\": 4"), std::string::npos) << args;
  EXPECT_NE(args.find("\"max_pixels\": 4096"), std::string::npos) << "MAX_PIXELS was read: " << args;
  EXPECT_NE(args.find("\"add_non_thinking_prefix\": true"), std::string::npos) << args;
  const std::string generation = read_bytes(checkpoint / "generation_config.json");
  EXPECT_NE(generation.find("4065"), std::string::npos) << "<|im_end|> of the tiny tokenizer: " << generation;
}

TEST_F(SwiftUserTest, RunsNeverMixInOneFolder) {
  const CommandResult first = run(base("versions") + "--max_steps 2 --add_version");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  fs::path first_dir;
  for (const auto& entry : fs::directory_iterator(*root_ / "versions")) first_dir = entry.path();
  const std::string first_metrics = read_bytes(first_dir / "metrics.jsonl");
  const std::string first_weights = read_bytes(first_dir / "checkpoint-2" / "model.safetensors");
  const CommandResult second = run(base("versions") + "--max_steps 3 --add_version --seed 5");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(*root_ / "versions")) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 2u);
  EXPECT_TRUE(names[0].starts_with("v0-") && names[1].starts_with("v1-")) << names[0] << " " << names[1];
  EXPECT_EQ(read_bytes(first_dir / "metrics.jsonl"), first_metrics) << "the first run's metrics changed";
  EXPECT_EQ(read_bytes(first_dir / "checkpoint-2" / "model.safetensors"), first_weights);
  EXPECT_FALSE(fs::exists(first_dir / "checkpoint-3"));
  // Without --add_version a fresh run into a used folder is refused, and nothing of it changes.
  const CommandResult plain = run(base("versions/" + names[0]) + "--max_steps 1");
  EXPECT_EQ(plain.exit_code, 1) << plain.output;
  EXPECT_EQ(read_bytes(first_dir / "metrics.jsonl"), first_metrics);
}

TEST_F(SwiftUserTest, ResumeRefusesAChangedLearningRate) {
  const CommandResult first = run(base("resume_lr") + "--max_steps 4 --save_steps 1 --stop_after_steps 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const CommandResult changed = run(base("resume_lr") + "--max_steps 4 --save_steps 1 --resume auto --lr 5e-4");
  EXPECT_EQ(changed.exit_code, 1) << changed.output;
  expect_has(changed, "--lr 0.001 -> 0.0005");
  expect_has(changed, "--ignore_args_check");
  EXPECT_EQ(changed.output.find("step 3/4"), std::string::npos) << "refused before training";
  // Options that do not change what is trained may change.
  const CommandResult same = run(base("resume_lr") + "--max_steps 4 --save_steps 1 --resume auto --logging_steps 2 --stop_after_steps 1");
  EXPECT_EQ(same.exit_code, 0) << same.output;
  expect_has(same, "step 3/4");
  const CommandResult ignored = run(base("resume_lr") + "--max_steps 4 --save_steps 1 --resume auto --lr 5e-4 --ignore_args_check");
  EXPECT_EQ(ignored.exit_code, 0) << ignored.output;
  expect_has(ignored, "options that change what is trained (--ignore_args_check)");
  expect_has(ignored, "step 4/4");
}

TEST_F(SwiftUserTest, ADatasetThatWouldLoseTooMuchFailsBeforeStepOne) {
  std::string text = read_bytes(*root_ / "data" / "train.jsonl");
  for (int i = 0; i < 4; ++i) text += "not json\n";
  std::ofstream(*root_ / "data" / "lossy.jsonl") << text;  // 4 of 20 lines bad: 20%
  const std::string flags = str_cat("train --model tiny-vl --dataset data/lossy.jsonl --max_length 128 --min_pixels 4096",
                                    " --max_pixels 4096 --max_steps 2 --output_dir ");
  const CommandResult refused = run(flags + "lossy_out");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  expect_has(refused, "--max_skip_ratio: 4 of the 20 lines of the training data (20%) would be skipped");
  expect_has(refused, "malformed_json 4");
  EXPECT_EQ(refused.output.find("step 1/"), std::string::npos) << refused.output;
  const CommandResult allowed = run(flags + "lossy_out2 --max_skip_ratio 0.25");
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
  const CommandResult strict = run(flags + "lossy_out3 --strict");
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  expect_has(strict, "--strict: malformed_json: data/lossy.jsonl:");  // the first bad line in the shuffled order
  expect_has(strict, "not valid JSON");
}

TEST_F(SwiftUserTest, AChatTemplateTheRendererDoesNotReproduceIsRefused) {
  const fs::path model = *root_ / "other_template";
  fs::remove_all(model);
  fs::copy(*root_ / "tiny-vl", model);
  std::ofstream(model / "chat_template.jinja") << "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
  const std::string flags = str_cat("train --model other_template --dataset data/train.jsonl --max_length 128",
                                    " --min_pixels 4096 --max_pixels 4096 --max_steps 1 --output_dir ");
  const CommandResult refused = run(flags + "template_out");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  expect_has(refused, "other_template/chat_template.jinja (fingerprint ");
  expect_has(refused, "--template");
  const CommandResult chosen = run(flags + "template_out2 --template qwen3_5");
  EXPECT_EQ(chosen.exit_code, 0) << chosen.output;
}

TEST_F(SwiftUserTest, MtpTensorsPassThroughEverySaveUnchanged) {
  const fs::path model = *root_ / "with_mtp";
  fs::remove_all(model);
  ModelCheckpoint checkpoint = load_model_dir((*root_ / "tiny-vl").string());
  HostTensor fc(DType::f32, Shape{64, 128});
  HostTensor norm(DType::f32, Shape{64});
  for (int64_t i = 0; i < fc.numel(); ++i) fc.as<float>()[i] = 0.01f * static_cast<float>(i % 97);
  for (int64_t i = 0; i < norm.numel(); ++i) norm.as<float>()[i] = 0.5f + static_cast<float>(i);
  checkpoint.passthrough["mtp.fc.weight"] = StoredTensor::from_host(fc.to_dtype(DType::bf16));
  checkpoint.passthrough["mtp.norm.weight"] = StoredTensor::from_host(norm);
  save_model_dir(checkpoint, model.string());
  copy_side_files((*root_ / "tiny-vl").string(), model.string());
  const CommandResult result =
      run(str_cat("train --model with_mtp --dataset data/train.jsonl --output_dir mtp_out --max_length 128",
                  " --min_pixels 4096 --max_pixels 4096 --max_steps 2 --save_steps 1 --freeze_llm false"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const ModelCheckpoint input = load_model_dir(model.string());
  for (const char* step : {"checkpoint-1", "checkpoint-2"}) {
    const ModelCheckpoint saved = load_model_dir((*root_ / "mtp_out" / step).string());
    ASSERT_EQ(saved.passthrough.size(), 2u) << step;
    for (const auto& [name, tensor] : input.passthrough) {
      const HostTensor want = tensor.to_host(), got = saved.passthrough.at(name).to_host();
      ASSERT_EQ(got.dtype(), want.dtype()) << name;
      ASSERT_EQ(got.nbytes(), want.nbytes()) << name;
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0) << name << " changed in " << step;
    }
  }
}

TEST_F(SwiftUserTest, AHubIdIsFoundInTheLocalCacheOrTheDownloadIsNamed) {
  const fs::path snapshot = *root_ / "hf" / "models--Tiny--tiny-vl" / "snapshots" / "abc123";
  fs::create_directories(snapshot.parent_path());
  fs::remove_all(snapshot);
  fs::copy(*root_ / "tiny-vl", snapshot);
  const std::string env = str_cat("HF_HUB_CACHE=", (*root_ / "hf").string());
  const CommandResult found = run("data --model Tiny/tiny-vl --dataset data/val.jsonl --num_workers 1", env);
  EXPECT_EQ(found.exit_code, 0) << found.output;
  expect_has(found, "max_length 8192");  // the model's max_position_embeddings, as in `train`
  const CommandResult missing = run("data --model Tiny/not-there --dataset data/val.jsonl", env);
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  expect_has(missing, "huggingface-cli download Tiny/not-there");
}

}  // namespace
}  // namespace deltamoe
