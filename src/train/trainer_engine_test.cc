// The CPU engine inside the loop: gradient accumulation over micro-batches gives the update of one
// big batch, and a saved checkpoint reloads into the same logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "data/packer.h"
#include "data/sample_builder.h"
#include "data/sft_record.h"
#include "optim/loss_scaling.h"
#include "optim/optimizer_step.h"
#include "tokenizer/tokenizer.h"
#include "train/cpu_engine.h"
#include "train/train_test_util.h"
#include "train/trainable_params.h"
#include "train/trainer.h"

namespace deltamoe {
namespace {

using namespace train_test;

class TrainerEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("trainer_engine"));
    make_tiny_vl_fixture(*root_, 16, 8);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* TrainerEngineTest::root_ = nullptr;

// The first `count` samples of a dataset file, built as the data pipeline builds them.
std::vector<SftSample> build_samples(const fs::path& jsonl, const Tokenizer& tokenizer, int count) {
  SampleOptions options;
  options.max_length = 128;
  options.image_config.min_pixels = options.image_config.max_pixels = 4096;
  const SampleBuilder builder(tokenizer, options);
  std::ifstream in(jsonl);
  std::vector<SftSample> samples;
  std::string line;
  for (int i = 0; i < count && std::getline(in, line); ++i) {
    const std::string where = str_cat(jsonl.string(), ":", i + 1);
    samples.push_back(builder.build(parse_sft_record(line, jsonl.parent_path().string(), where), i, where));
  }
  return samples;
}

// Packs samples [first, first + count) into one micro-batch with the real packer.
MicroBatch pack(const std::vector<SftSample>& samples, size_t first, size_t count) {
  Packer packer(1 << 20, 1);
  size_t next = first;
  auto feed = [&]() -> std::optional<Packer::Slotted> {
    if (next == first + count) return std::nullopt;
    const size_t i = next++;
    return Packer::Slotted{static_cast<int64_t>(i), samples[i]};
  };
  std::optional<MicroBatch> batch = packer.pack(feed);
  EXPECT_TRUE(batch.has_value());
  EXPECT_EQ(batch->num_samples(), static_cast<int64_t>(count));
  return std::move(*batch);
}

// One optimizer step over the global batch `micro_batches`; returns the master weights after it.
std::vector<float> one_step(const ModelCheckpoint& checkpoint, const std::vector<MicroBatch>& micro_batches,
                            std::vector<float>* grad_out) {
  FreezeOptions train_everything{false, false, false};
  TrainableParams trainable = build_trainable_params(checkpoint, train_everything);
  CpuEngine engine(checkpoint, trainable.layout);
  engine.set_trainable_weights(trainable.master.data());
  GlobalBatchCounts counts;
  counts.num_micro_batches = static_cast<int64_t>(micro_batches.size());
  for (const MicroBatch& batch : micro_batches) counts.num_supervised_tokens += batch.num_supervised;
  // The aux loss is a statistic of one forward pass, so it legitimately depends on the split;
  // the accumulation property is about the token-summed CE (docs/optimizer.md).
  GlobalBatchLoss loss(counts, 0.0);
  std::vector<float> grad(trainable.master.size(), 0.0f);
  for (const MicroBatch& batch : micro_batches) {
    const MicroBatchLoss part = engine.forward_backward(batch, loss.ce_token_weight(), loss.aux_weight(), grad.data());
    loss.add_micro_batch(part.ce_sum, part.num_supervised, part.aux_loss);
  }
  *grad_out = grad;
  AdamWConfig adamw;
  adamw.weight_decay = 0;
  AdamW optimizer(trainable.layout, adamw);
  LrScheduleConfig schedule_config;
  schedule_config.lr = 1e-3;
  schedule_config.min_lr = 1e-3;
  schedule_config.total_steps = 1;
  const LrSchedule schedule(schedule_config);
  OptimizerProgress progress;
  clip_and_step(optimizer, schedule, 0.0, &progress, trainable.master.data(), grad.data());
  return trainable.master;
}

TEST_F(TrainerEngineTest, EightMicroBatchesOfOneEqualOneOfEight) {
  const ModelCheckpoint checkpoint = load_model_dir((*root_ / "tiny-vl").string());
  const Tokenizer tokenizer = Tokenizer::load((*root_ / "tiny-vl").string());
  const std::vector<SftSample> samples = build_samples(*root_ / "data" / "train.jsonl", tokenizer, 8);
  ASSERT_EQ(samples.size(), 8u);
  std::vector<MicroBatch> singles;
  for (size_t i = 0; i < 8; ++i) singles.push_back(pack(samples, i, 1));
  const std::vector<MicroBatch> one_batch = {pack(samples, 0, 8)};
  ASSERT_FALSE(one_batch[0].image_grid_thw.empty()) << "the global batch should contain images";

  const FreezeOptions train_everything{false, false, false};
  const std::vector<float> before = build_trainable_params(checkpoint, train_everything).master;
  std::vector<float> grad_singles, grad_one;
  const std::vector<float> after_singles = one_step(checkpoint, singles, &grad_singles);
  const std::vector<float> after_one = one_step(checkpoint, one_batch, &grad_one);

  std::vector<float> update_singles(before.size()), update_one(before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    update_singles[i] = after_singles[i] - before[i];
    update_one[i] = after_one[i] - before[i];
  }
  // The accumulated gradient is what the split into micro-batches may change (only the order of
  // fp32 sums differs): it must agree to 1e-6 relative.
  EXPECT_LT(max_relative_difference("gradient (8 x 1 vs 1 x 8)", grad_one.data(), grad_singles.data(), grad_one.size()),
            1e-6);
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    diff2 += std::pow(static_cast<double>(update_one[i]) - update_singles[i], 2);
    ref2 += std::pow(static_cast<double>(update_one[i]), 2);
  }
  const double update_rel = std::sqrt(diff2 / ref2);
  std::printf("  AdamW update: |diff|_2 / |update|_2 = %.3e\n", update_rel);
  // NOTE: AdamW's first update is lr * g / (|g| + eps) per element, so elements whose gradient is
  // rounding noise (|g| ~ eps, e.g. embedding rows of unused tokens) move by O(lr) either way;
  // this bounds the update difference a few times above the gradient's.
  EXPECT_LT(update_rel, 1e-5);
}

// Freezing a part skips its weight products but must not change the gradients of the rest.
TEST_F(TrainerEngineTest, FrozenPartsLeaveTheOtherGradientsUnchanged) {
  const ModelCheckpoint checkpoint = load_model_dir((*root_ / "tiny-vl").string());
  const Tokenizer tokenizer = Tokenizer::load((*root_ / "tiny-vl").string());
  const MicroBatch batch = pack(build_samples(*root_ / "data" / "train.jsonl", tokenizer, 4), 0, 4);
  ASSERT_FALSE(batch.image_grid_thw.empty());
  auto gradients = [&](const FreezeOptions& freeze) {
    TrainableParams params = build_trainable_params(checkpoint, freeze);
    CpuEngine engine(checkpoint, params.layout);
    engine.set_trainable_weights(params.master.data());
    std::vector<float> grad(params.master.size(), 0.0f);
    engine.forward_backward(batch, 1.0 / batch.num_supervised, 0.01, grad.data());
    std::map<std::string, std::vector<float>> by_name;
    for (const ParamEntry& entry : params.layout.entries()) {
      by_name[entry.name].assign(grad.begin() + entry.offset, grad.begin() + entry.offset + entry.numel);
    }
    return by_name;
  };
  const auto all = gradients({false, false, false});
  for (const FreezeOptions& freeze : {FreezeOptions{true, true, false}, FreezeOptions{false, false, true},
                                      FreezeOptions{true, false, true}, FreezeOptions{false, true, false}}) {
    const auto part = gradients(freeze);
    ASSERT_FALSE(part.empty());
    double worst = 0;
    for (const auto& [name, values] : part) {
      const std::vector<float>& reference = all.at(name);
      double max_diff = 0, max_ref = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        max_diff = std::max(max_diff, std::abs(static_cast<double>(values[i]) - reference[i]));
        max_ref = std::max(max_ref, std::abs(static_cast<double>(reference[i])));
      }
      worst = std::max(worst, max_diff / std::max(max_ref, 1e-30));
    }
    std::printf("  freeze vit=%d aligner=%d llm=%d: %zu tensors, worst rel %.3e\n", freeze.freeze_vit,
                freeze.freeze_aligner, freeze.freeze_llm, part.size(), worst);
    EXPECT_EQ(worst, 0.0);
  }
}

TEST_F(TrainerEngineTest, SavedCheckpointReloadsIntoTheSameLogits) {
  TrainOptions options = small_run_options(*root_);
  options.max_steps = 3;
  options.output_dir = (*root_ / "run").string();
  const TrainSummary summary = run_training(options, "cpu");
  ASSERT_EQ(summary.last_checkpoint, (*root_ / "run" / "checkpoint-3").string());

  // The in-memory model after the run: the optimizer state's fp32 master weights.
  const ModelCheckpoint base = load_model_dir(options.model_dir);
  TrainableParams trained = build_trainable_params(base, options.freeze);
  AdamW optimizer(trained.layout, options.adamw);
  load_optimizer_state(summary.last_checkpoint + "/optimizer.safetensors", &optimizer, trained.master.data());
  // What a save writes: master rounded to the on-disk dtype (bf16 here).
  const ModelCheckpoint as_saved = checkpoint_with_master(base, trained.layout, trained.master.data());
  const ModelCheckpoint reloaded = load_model_dir(summary.last_checkpoint);

  const Tokenizer tokenizer = Tokenizer::load(summary.last_checkpoint);
  const std::vector<SftSample> samples = build_samples(*root_ / "data" / "val.jsonl", tokenizer, 4);
  const MicroBatch batch = pack(samples, 0, samples.size());
  std::vector<float> logits_saved, logits_reloaded, logits_master;
  const FreezeOptions none{false, false, false};
  MicroBatchLoss reloaded_loss;
  for (auto [checkpoint, logits] : {std::pair{&as_saved, &logits_saved}, std::pair{&reloaded, &logits_reloaded}}) {
    TrainableParams params = build_trainable_params(*checkpoint, none);
    CpuEngine engine(*checkpoint, params.layout);
    engine.set_trainable_weights(params.master.data());
    reloaded_loss = engine.forward(batch, logits);
  }
  // The engine's token accuracy and CE agree with the logits it returned (argmax and log-softmax
  // of each supervised row, labels shifted inside each sample).
  const int64_t vocab = reloaded.config.text.vocab_size;
  const std::vector<int64_t> shifted = shift_packed_labels(batch);
  int64_t correct = 0, supervised = 0;
  double ce_sum = 0;
  for (size_t t = 0; t < shifted.size(); ++t) {
    if (shifted[t] == kIgnoreLabel) continue;
    const float* row = logits_reloaded.data() + t * vocab;
    const float max_logit = *std::max_element(row, row + vocab);
    double sum_exp = 0;
    for (int64_t v = 0; v < vocab; ++v) sum_exp += std::exp(static_cast<double>(row[v]) - max_logit);
    ce_sum += max_logit + std::log(sum_exp) - row[shifted[t]];
    correct += row[shifted[t]] == max_logit;
    ++supervised;
  }
  std::printf("  token accuracy %lld/%lld, CE sum %.6f (engine %.6f)\n", static_cast<long long>(correct),
              static_cast<long long>(supervised), ce_sum, reloaded_loss.ce_sum);
  EXPECT_EQ(reloaded_loss.num_supervised, supervised);
  EXPECT_EQ(reloaded_loss.num_correct, correct);
  EXPECT_NEAR(reloaded_loss.ce_sum, ce_sum, 1e-5 * ce_sum);
  {
    CpuEngine engine(base, trained.layout);
    engine.set_trainable_weights(trained.master.data());
    engine.forward(batch, &logits_master);
  }
  ASSERT_EQ(logits_saved.size(), logits_reloaded.size());
  const double reload_error =
      max_relative_difference("logits: reloaded vs saved weights", logits_saved.data(), logits_reloaded.data(),
                              logits_saved.size());
  EXPECT_EQ(reload_error, 0.0) << "reloading a checkpoint must reproduce its logits exactly";
  // bf16 rounding of the fp32 master weights is the only difference to the training model.
  EXPECT_LT(max_relative_difference("logits: bf16 checkpoint vs fp32 master", logits_master.data(),
                                    logits_reloaded.data(), logits_master.size()),
            5e-2);
  for (const char* file : {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}) {
    EXPECT_TRUE(fs::exists(fs::path(summary.last_checkpoint) / file)) << file << " missing from the checkpoint";
  }
}

}  // namespace
}  // namespace deltamoe
