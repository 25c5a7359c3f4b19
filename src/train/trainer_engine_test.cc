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

// How a step seeds its micro-batches' backward passes.
enum class Seeding {
  kTrainer,            // micro_batch_weights: the gradient of the CE sum, divided by S once at the end
  kMeanPerMicroBatch,  // the scheme before: ce_token_weight 1 / S in every micro-batch, no division
};

// The per-token CE weight the CPU model applies in a micro-batch of n supervised tokens when the
// engine is handed ce_token_weight: the engine seeds fl32(ce_token_weight * n) and
// cross_entropy_backward_ref divides it by n in fp32.
float cpu_per_token_weight(double ce_token_weight, int64_t n) {
  return static_cast<float>(ce_token_weight * static_cast<double>(n)) / static_cast<float>(n);
}

// The accumulated gradient of one global batch (CE only: the aux loss is a statistic of one
// forward pass, so it legitimately depends on the split; docs/optimizer.md).
EngineOptions all_trained() {
  EngineOptions options;
  options.freeze = FreezeOptions{false, false, false};
  return options;
}

std::vector<float> accumulated_gradient(const ModelCheckpoint& checkpoint, const std::vector<MicroBatch>& micro_batches,
                                        Seeding seeding) {
  CpuEngine engine(checkpoint, all_trained());
  GlobalBatchCounts counts;
  counts.num_micro_batches = static_cast<int64_t>(micro_batches.size());
  for (const MicroBatch& batch : micro_batches) counts.num_supervised_tokens += batch.num_supervised;
  GlobalBatchLoss loss(counts, 0.0);
  MicroBatchWeights weights = micro_batch_weights(counts.num_supervised_tokens, counts.num_micro_batches, 0.0);
  if (seeding == Seeding::kMeanPerMicroBatch) weights = {loss.ce_token_weight(), loss.aux_weight(), 1.0};
  std::vector<float> grad(engine.state().master().size(), 0.0f);
  for (const MicroBatch& batch : micro_batches) {
    const MicroBatchLoss part =
        engine.forward_backward(batch, weights.ce_token_weight, weights.aux_weight, grad.data());
    loss.add_micro_batch(part.ce_sum, part.num_supervised, part.aux_loss);
  }
  divide_gradient(grad.data(), grad.size(), weights.gradient_divisor);
  return grad;
}

// The update (weights after minus before) of one AdamW step with this gradient; lr 1e-3, eps 1e-8.
std::vector<float> adamw_update(const HostTrainState& initial, std::vector<float> grad) {
  std::vector<float> master = initial.master();
  AdamWConfig adamw;
  adamw.weight_decay = 0;
  AdamW optimizer(initial.layout(), adamw);
  LrScheduleConfig schedule_config;
  schedule_config.lr = 1e-3;
  schedule_config.min_lr = 1e-3;
  schedule_config.total_steps = 1;
  const LrSchedule schedule(schedule_config);
  OptimizerProgress progress;
  clip_and_step(optimizer, schedule, 0.0, &progress, master.data(), grad.data());
  for (size_t i = 0; i < master.size(); ++i) master[i] -= initial.master()[i];
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

// Acceptance: a global batch of 8 samples as 8 micro-batches of 1 gives bit for bit the gradient
// and AdamW update of 1 micro-batch of 8. Two things make it hold (docs/training.md, "Accumulation"):
// the model adds each token's gradient straight onto the running total, and every token of the
// step gets the same fp32 CE weight whatever micro-batch it is in (the trainer's Seeding). AdamW's
// first step is lr * g / (|g| + eps), so where g cancels to ~eps any rounding difference is
// amplified. Two controls show the count of unequal elements can fail: the batch seeded per
// micro-batch with 1 / S (a per-token weight 1 ulp off for some micro-batch sizes, chosen so here),
// and the same batch with its samples reversed (another fp32 summation order).
TEST_F(TrainerEngineTest, EightMicroBatchesOfOneEqualOneOfEight) {
  const ModelCheckpoint checkpoint = load_model_dir((*root_ / "tiny-vl").string());
  const Tokenizer tokenizer = Tokenizer::load((*root_ / "tiny-vl").string());
  const std::vector<SftSample> all_samples = build_samples(*root_ / "data" / "train.jsonl", tokenizer, 16);
  ASSERT_EQ(all_samples.size(), 16u);
  // The first 8 consecutive samples with images where seeding 1 / S per micro-batch of one sample
  // moves some token's CE weight off fl32(1 / S): only then can that control fail.
  std::vector<SftSample> samples;
  int64_t total_supervised = 0, moved_samples = 0;
  for (size_t first = 0; first + 8 <= all_samples.size() && samples.empty(); ++first) {
    int64_t supervised = 0, moved = 0;
    bool has_image = false;
    for (size_t i = first; i < first + 8; ++i) supervised += all_samples[i].num_supervised;
    for (size_t i = first; i < first + 8; ++i) {
      const int64_t n = all_samples[i].num_supervised;
      moved += n > 0 && cpu_per_token_weight(1.0 / supervised, n) != cpu_per_token_weight(1.0 / supervised, supervised);
      has_image = has_image || !all_samples[i].images.empty();
    }
    if (moved == 0 || !has_image) continue;
    const auto begin = all_samples.begin() + static_cast<ptrdiff_t>(first);
    samples.assign(begin, begin + 8);
    total_supervised = supervised;
    moved_samples = moved;
    std::printf("  samples %zu..%zu: %lld supervised tokens; seeded with 1 / S per sample, %lld of them get a CE\n"
                "    weight other than fl32(1 / %lld) = %.9g:", first, first + 7, static_cast<long long>(supervised),
                static_cast<long long>(moved), static_cast<long long>(supervised),
                1.0f / static_cast<float>(supervised));
    for (const SftSample& sample : samples) {
      std::printf(" n=%lld:%.9g", static_cast<long long>(sample.num_supervised),
                  cpu_per_token_weight(1.0 / supervised, sample.num_supervised));
    }
    std::printf("\n");
  }
  ASSERT_FALSE(samples.empty()) << "no 8 consecutive samples of the fixture exercise the per-micro-batch control";
  std::vector<MicroBatch> singles;
  for (size_t i = 0; i < 8; ++i) singles.push_back(pack(samples, i, 1));
  const std::vector<MicroBatch> one_batch = {pack(samples, 0, 8)};
  const std::vector<SftSample> reversed(samples.rbegin(), samples.rend());
  const std::vector<MicroBatch> one_batch_reversed = {pack(reversed, 0, 8)};
  ASSERT_FALSE(one_batch[0].image_grid_thw.empty()) << "the global batch should contain images";
  ASSERT_EQ(one_batch[0].num_supervised, total_supervised);

  CpuEngine initial(checkpoint, all_trained());
  const HostTrainState& trainable = initial.state();
  const std::vector<float> grad_one = accumulated_gradient(checkpoint, one_batch, Seeding::kTrainer);
  const std::vector<float> grad_singles = accumulated_gradient(checkpoint, singles, Seeding::kTrainer);
  const std::vector<float> grad_reversed = accumulated_gradient(checkpoint, one_batch_reversed, Seeding::kTrainer);
  const std::vector<float> grad_one_mean = accumulated_gradient(checkpoint, one_batch, Seeding::kMeanPerMicroBatch);
  const std::vector<float> grad_singles_mean = accumulated_gradient(checkpoint, singles, Seeding::kMeanPerMicroBatch);
  max_relative_difference("gradient (8 x 1 vs 1 x 8)", grad_one.data(), grad_singles.data(), grad_one.size());
  max_relative_difference("gradient (1 x 8 reversed vs 1 x 8)", grad_one.data(), grad_reversed.data(), grad_one.size());
  max_relative_difference("gradient (1/S per micro-batch: 8 x 1 vs 1 x 8)", grad_one_mean.data(),
                          grad_singles_mean.data(), grad_one.size());
  max_relative_difference("gradient (1/S per micro-batch vs trainer, 1 x 8)", grad_one.data(), grad_one_mean.data(),
                          grad_one.size());

  const std::vector<float> update_one = adamw_update(trainable, grad_one);
  const std::vector<float> update_singles = adamw_update(trainable, grad_singles);
  const std::vector<float> update_reversed = adamw_update(trainable, grad_reversed);
  const std::vector<float> update_one_mean = adamw_update(trainable, grad_one_mean);
  const std::vector<float> update_singles_mean = adamw_update(trainable, grad_singles_mean);
  auto all = [](size_t) { return true; };
  const int64_t grad_unequal = count_bitwise_different(grad_one, grad_singles);
  const int64_t update_unequal = count_bitwise_different(update_one, update_singles);
  const int64_t reversed_unequal = count_bitwise_different(update_one, update_reversed);
  const int64_t mean_unequal = count_bitwise_different(update_one_mean, update_singles_mean);
  std::printf("  AdamW update |diff|_2 / |update|_2 over all %zu elements, and elements not bitwise equal:\n"
              "    8 x 1 vs 1 x 8 (trainer seeding):      %.3e, %lld gradient / %lld update elements\n"
              "    1 x 8 reversed vs 1 x 8:               %.3e, %lld update elements (another summation order)\n"
              "    8 x 1 vs 1 x 8 (1/S per micro-batch):  %.3e, %lld update elements (%lld of 8 samples'\n"
              "      weights moved)\n",
              grad_one.size(), l2_relative(update_one, update_singles, all), static_cast<long long>(grad_unequal),
              static_cast<long long>(update_unequal), l2_relative(update_one, update_reversed, all),
              static_cast<long long>(reversed_unequal), l2_relative(update_one_mean, update_singles_mean, all),
              static_cast<long long>(mean_unequal), static_cast<long long>(moved_samples));
  EXPECT_EQ(grad_unequal, 0);
  EXPECT_EQ(update_unequal, 0);
  // The controls: the same comparison fails where the per-token weight or the order differs.
  EXPECT_GT(mean_unequal, 0);
  EXPECT_GT(reversed_unequal, 0);
}

// The same property through the trainer's sample-counted flags: --global_batch_size 8 with
// --micro_batch_size 1, 2, 4 and 8 (8, 4, 2 and 1 micro-batches) train on the same 8 samples and take
// bit for bit the same step, with everything trained and with ms-swift's default freeze (vision
// tower and aligner frozen, so the vision backward is skipped).
TEST_F(TrainerEngineTest, GlobalBatchSizeInSamplesGivesTheSameStepForAnyMicroBatchSize) {
  for (const bool freeze_vision : {false, true}) {
    std::map<int64_t, std::vector<float>> master_after;
    std::map<int64_t, std::string> step_line;
    std::vector<float> initial;
    for (const int64_t micro : {int64_t{8}, int64_t{4}, int64_t{2}, int64_t{1}}) {
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
      options.freeze.freeze_vit = options.freeze.freeze_aligner = freeze_vision;
      options.output_dir = (*root_ / str_cat("global8_micro", micro, freeze_vision ? "_frozen_vision" : "")).string();
      // The runs must really split the batch differently, or agreement would prove nothing.
      EXPECT_EQ(plan_batches(options).accumulation, 8 / micro);
      const TrainSummary summary = run_training(options, "cpu");
      ASSERT_EQ(summary.steps_done, 1);
      const ModelCheckpoint base = load_model_dir(options.model_dir);
      EngineOptions engine_options;
      engine_options.freeze = options.freeze;
      engine_options.adamw = options.adamw;
      CpuEngine trained(base, engine_options);
      initial = trained.state().master();
      load_optimizer_state(summary.last_checkpoint + "/optimizer.safetensors", &trained.state());
      master_after[micro] = trained.state().master();
      // The step's token counts (not its timings) must match: the same 8 samples in every run.
      const std::string metrics = read_bytes(fs::path(options.output_dir) / "metrics.jsonl");
      const size_t tokens = metrics.find("\"tokens\":");
      const size_t supervised = metrics.find("\"supervised_tokens\":");
      ASSERT_NE(tokens, std::string::npos);
      ASSERT_NE(supervised, std::string::npos);
      step_line[micro] = metrics.substr(tokens, metrics.find_first_of(",}", tokens) - tokens) + " " +
                         metrics.substr(supervised, metrics.find_first_of(",}", supervised) - supervised);
    }
    std::vector<float> update_micro8(initial.size());
    for (size_t i = 0; i < initial.size(); ++i) update_micro8[i] = master_after[8][i] - initial[i];
    for (const int64_t micro : {int64_t{4}, int64_t{2}, int64_t{1}}) {
      std::vector<float> update(initial.size());
      for (size_t i = 0; i < initial.size(); ++i) update[i] = master_after[micro][i] - initial[i];
      const int64_t unequal = count_bitwise_different(update_micro8, update);
      std::printf("  %s: micro %lld (%lld micro-batches; %s) vs micro 8 (%s): AdamW update |diff|_2 / |update|_2\n"
                  "    %.3e over %zu elements, %lld not bitwise equal\n",
                  freeze_vision ? "vision frozen" : "all trained", static_cast<long long>(micro),
                  static_cast<long long>(8 / micro), step_line[micro].c_str(), step_line[8].c_str(),
                  l2_relative(update_micro8, update, [](size_t) { return true; }), update.size(),
                  static_cast<long long>(unequal));
      EXPECT_EQ(step_line[micro], step_line[8]);
      EXPECT_EQ(unequal, 0) << "micro " << micro << (freeze_vision ? ", vision frozen" : ", all trained");
    }
  }
}

// Freezing a part skips its weight products but must not change the gradients of the rest.
TEST_F(TrainerEngineTest, FrozenPartsLeaveTheOtherGradientsUnchanged) {
  const ModelCheckpoint checkpoint = load_model_dir((*root_ / "tiny-vl").string());
  const Tokenizer tokenizer = Tokenizer::load((*root_ / "tiny-vl").string());
  const MicroBatch batch = pack(build_samples(*root_ / "data" / "train.jsonl", tokenizer, 4), 0, 4);
  ASSERT_FALSE(batch.image_grid_thw.empty());
  auto gradients = [&](const FreezeOptions& freeze) {
    EngineOptions options;
    options.freeze = freeze;
    CpuEngine engine(checkpoint, options);
    std::vector<float> grad(engine.state().master().size(), 0.0f);
    engine.forward_backward(batch, 1.0 / batch.num_supervised, 0.01, grad.data());
    std::map<std::string, std::vector<float>> by_name;
    for (const ParamEntry& entry : engine.state().layout().entries()) {
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
  EngineOptions trained_options;
  trained_options.freeze = options.freeze;
  trained_options.adamw = options.adamw;
  CpuEngine trained(base, trained_options);
  load_optimizer_state(summary.last_checkpoint + "/optimizer.safetensors", &trained.state());
  // What a save writes: master rounded to the on-disk dtype (bf16 here).
  const ModelCheckpoint as_saved = checkpoint_with_state(base, trained.state());
  const ModelCheckpoint reloaded = load_model_dir(summary.last_checkpoint);

  const Tokenizer tokenizer = Tokenizer::load(summary.last_checkpoint);
  const std::vector<SftSample> samples = build_samples(*root_ / "data" / "val.jsonl", tokenizer, 4);
  const MicroBatch batch = pack(samples, 0, samples.size());
  std::vector<float> logits_saved, logits_reloaded, logits_master;
  const FreezeOptions none{false, false, false};
  MicroBatchLoss reloaded_loss;
  for (auto [checkpoint, logits] : {std::pair{&as_saved, &logits_saved}, std::pair{&reloaded, &logits_reloaded}}) {
    EngineOptions engine_options;
    engine_options.freeze = none;
    CpuEngine engine(*checkpoint, engine_options);
    reloaded_loss = engine.evaluate(batch, logits);
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
  trained.evaluate(batch, &logits_master);
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
