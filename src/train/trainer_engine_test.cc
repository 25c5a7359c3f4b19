// The CPU engine inside the loop: gradient accumulation over micro-batches gives the update of one
// big batch, and a saved checkpoint reloads into the same logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>

#include "data/packer.h"
#include "data/sample_builder.h"
#include "data/sft_record.h"
#include "optim/loss_scaling.h"
#include "optim/optimizer_step.h"
#include "tokenizer/tokenizer.h"
#include "train/batch_plan.h"
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

// The accumulated gradient of one global batch (CE only: the aux loss is a statistic of one
// forward pass, so it legitimately depends on the split; docs/optimizer.md).
std::vector<float> accumulated_gradient(const ModelCheckpoint& checkpoint, const TrainableParams& trainable,
                                        const std::vector<MicroBatch>& micro_batches) {
  CpuEngine engine(checkpoint, trainable.layout);
  engine.set_trainable_weights(trainable.master.data());
  GlobalBatchCounts counts;
  counts.num_micro_batches = static_cast<int64_t>(micro_batches.size());
  for (const MicroBatch& batch : micro_batches) counts.num_supervised_tokens += batch.num_supervised;
  GlobalBatchLoss loss(counts, 0.0);
  std::vector<float> grad(trainable.master.size(), 0.0f);
  for (const MicroBatch& batch : micro_batches) {
    const MicroBatchLoss part = engine.forward_backward(batch, loss.ce_token_weight(), loss.aux_weight(), grad.data());
    loss.add_micro_batch(part.ce_sum, part.num_supervised, part.aux_loss);
  }
  return grad;
}

// The update (weights after minus before) of one AdamW step with this gradient; lr 1e-3, eps 1e-8.
std::vector<float> adamw_update(const TrainableParams& trainable, std::vector<float> grad) {
  std::vector<float> master = trainable.master;
  AdamWConfig adamw;
  adamw.weight_decay = 0;
  AdamW optimizer(trainable.layout, adamw);
  LrScheduleConfig schedule_config;
  schedule_config.lr = 1e-3;
  schedule_config.min_lr = 1e-3;
  schedule_config.total_steps = 1;
  const LrSchedule schedule(schedule_config);
  OptimizerProgress progress;
  clip_and_step(optimizer, schedule, 0.0, &progress, master.data(), grad.data());
  for (size_t i = 0; i < master.size(); ++i) master[i] -= trainable.master[i];
  return master;
}

// |a - b|_2 / |a|_2 over the elements that `keep` selects.
template <typename Keep>
double l2_relative(const std::vector<float>& a, const std::vector<float>& b, Keep keep) {
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!keep(i)) continue;
    diff2 += std::pow(static_cast<double>(a[i]) - b[i], 2);
    ref2 += std::pow(static_cast<double>(a[i]), 2);
  }
  return std::sqrt(diff2 / ref2);
}

// Number of elements where a and b are not the same float bit for bit.
int64_t count_bitwise_different(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t different = 0;
  for (size_t i = 0; i < a.size(); ++i) different += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return different;
}

// Acceptance: a global batch of 8 samples as 8 micro-batches of 1 gives the update of 1 of 8, to
// 1e-6 relative over every element. This holds only because the model adds each token's gradient
// straight onto the running total (docs/training.md, "Accumulation"): AdamW's first step is
// lr * g / (|g| + eps), so where g cancels to ~eps any difference in fp32 summation order is
// amplified. The same batch with its samples reversed (a different order) shows the size of that
// effect, and that the check can fail.
TEST_F(TrainerEngineTest, EightMicroBatchesOfOneEqualOneOfEight) {
  const ModelCheckpoint checkpoint = load_model_dir((*root_ / "tiny-vl").string());
  const Tokenizer tokenizer = Tokenizer::load((*root_ / "tiny-vl").string());
  const std::vector<SftSample> samples = build_samples(*root_ / "data" / "train.jsonl", tokenizer, 8);
  ASSERT_EQ(samples.size(), 8u);
  std::vector<MicroBatch> singles;
  for (size_t i = 0; i < 8; ++i) singles.push_back(pack(samples, i, 1));
  const std::vector<MicroBatch> one_batch = {pack(samples, 0, 8)};
  const std::vector<SftSample> reversed(samples.rbegin(), samples.rend());
  const std::vector<MicroBatch> one_batch_reversed = {pack(reversed, 0, 8)};
  ASSERT_FALSE(one_batch[0].image_grid_thw.empty()) << "the global batch should contain images";

  const TrainableParams trainable = build_trainable_params(checkpoint, FreezeOptions{false, false, false});
  const std::vector<float> grad_one = accumulated_gradient(checkpoint, trainable, one_batch);
  const std::vector<float> grad_singles = accumulated_gradient(checkpoint, trainable, singles);
  const std::vector<float> grad_reversed = accumulated_gradient(checkpoint, trainable, one_batch_reversed);
  EXPECT_LT(max_relative_difference("gradient (8 x 1 vs 1 x 8)", grad_one.data(), grad_singles.data(), grad_one.size()),
            1e-6);
  max_relative_difference("gradient (1 x 8 reversed vs 1 x 8)", grad_one.data(), grad_reversed.data(), grad_one.size());

  const std::vector<float> update_one = adamw_update(trainable, grad_one);
  const std::vector<float> update_singles = adamw_update(trainable, grad_singles);
  const std::vector<float> update_reversed = adamw_update(trainable, grad_reversed);
  auto all = [](size_t) { return true; };
  const double accumulation_rel = l2_relative(update_one, update_singles, all);
  const double reorder_rel = l2_relative(update_one, update_reversed, all);
  std::printf("  AdamW update |diff|_2 / |update|_2 over all %zu elements: 8 x 1 vs 1 x 8 %.3e (%lld gradient and\n"
              "    %lld update elements not bitwise equal); 1 x 8 reversed vs 1 x 8 %.3e (same batch, another\n"
              "    fp32 summation order; %lld update elements not bitwise equal)\n",
              grad_one.size(), accumulation_rel, static_cast<long long>(count_bitwise_different(grad_one, grad_singles)),
              static_cast<long long>(count_bitwise_different(update_one, update_singles)), reorder_rel,
              static_cast<long long>(count_bitwise_different(update_one, update_reversed)));
  EXPECT_LT(accumulation_rel, 1e-6);
}

// The same property through the trainer's sample-counted flags: --global_batch_size 8 with
// --micro_batch_size 1 (8 micro-batches) and 8 (one) train on the same 8 samples and take the same step.
TEST_F(TrainerEngineTest, GlobalBatchSizeInSamplesGivesTheSameStepForAnyMicroBatchSize) {
  std::map<int64_t, std::vector<float>> master_after;
  std::map<int64_t, std::string> step_line;
  std::map<int64_t, int64_t> accumulation;
  TrainableParams initial;
  for (const int64_t micro : {int64_t{1}, int64_t{8}}) {
    TrainOptions options = small_run_options(*root_);
    options.micro_batch_tokens = 0;
    options.gradient_accumulation_steps = 0;
    options.global_batch_size = 8;
    options.micro_batch_size = micro;
    options.max_steps = 1;
    options.schedule.warmup_ratio = 0;
    options.schedule.min_lr = options.schedule.lr;
    options.adamw.weight_decay = 0;
    options.max_grad_norm = 0;
    options.router_aux_loss_coef = 0.0;  // a per-forward statistic: depends on the split
    options.output_dir = (*root_ / str_cat("global8_micro", micro)).string();
    accumulation[micro] = plan_batches(options).accumulation;
    const TrainSummary summary = run_training(options, "cpu");
    ASSERT_EQ(summary.steps_done, 1);
    const ModelCheckpoint base = load_model_dir(options.model_dir);
    initial = build_trainable_params(base, options.freeze);
    TrainableParams trained = build_trainable_params(base, options.freeze);
    AdamW optimizer(trained.layout, options.adamw);
    load_optimizer_state(summary.last_checkpoint + "/optimizer.safetensors", &optimizer, trained.master.data());
    master_after[micro] = trained.master;
    // The step's token counts (not its timings) must match: the same 8 samples in both runs.
    const std::string metrics = read_bytes(fs::path(options.output_dir) / "metrics.jsonl");
    const size_t tokens = metrics.find("\"tokens\":");
    const size_t supervised = metrics.find("\"supervised_tokens\":");
    ASSERT_NE(tokens, std::string::npos);
    ASSERT_NE(supervised, std::string::npos);
    step_line[micro] = metrics.substr(tokens, metrics.find_first_of(",}", tokens) - tokens) + " " +
                       metrics.substr(supervised, metrics.find_first_of(",}", supervised) - supervised);
  }
  std::printf("  step 1 with micro 1: %s; micro 8: %s\n", step_line[1].c_str(), step_line[8].c_str());
  EXPECT_EQ(step_line[1], step_line[8]);
  std::vector<float> update_micro1(initial.master.size()), update_micro8(initial.master.size());
  for (size_t i = 0; i < initial.master.size(); ++i) {
    update_micro1[i] = master_after[1][i] - initial.master[i];
    update_micro8[i] = master_after[8][i] - initial.master[i];
  }
  const double rel = l2_relative(update_micro8, update_micro1, [](size_t) { return true; });
  // |u| = lr |g| / (|g| + eps) >= lr * 10 / 11 exactly when |g| >= 10 eps: the elements whose update
  // cannot amplify rounding, found from the update itself.
  const double lr = 1e-3;
  int64_t num_small = 0;
  for (const float u : update_micro8) num_small += u != 0.0f && std::abs(u) < lr * 10 / 11;
  const double resolvable_rel =
      l2_relative(update_micro8, update_micro1, [&](size_t i) { return std::abs(update_micro8[i]) >= lr * 10 / 11; });
  std::printf("  AdamW update |diff|_2 / |update|_2, micro 1 (%lld micro-batches) vs micro 8 (%lld): %.3e over all\n"
              "    %zu elements (%lld not bitwise equal); without the %lld elements with 0 < |g| < 10 eps: %.3e\n",
              static_cast<long long>(accumulation[1]), static_cast<long long>(accumulation[8]), rel,
              update_micro8.size(), static_cast<long long>(count_bitwise_different(update_micro8, update_micro1)),
              static_cast<long long>(num_small), resolvable_rel);
  // The runs must really split the batch differently, or agreement would prove nothing.
  EXPECT_EQ(accumulation[1], 8);
  EXPECT_EQ(accumulation[8], 1);
  EXPECT_LT(resolvable_rel, 1e-6);
  EXPECT_LT(rel, 1e-4);
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
