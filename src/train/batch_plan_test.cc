// Batch-size flags: samples (--global_batch_size / --micro_batch_size) and tokens
// (--micro_batch_tokens) resolve to the right accumulation, and contradictions fail with a message
// that names the flags. The micro-batch loss weights give every token the same weight in any split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "train/batch_plan.h"
#include "train/train_options.h"

namespace deltamoe {
namespace {

TrainOptions batch_options(int64_t global, int64_t micro, int64_t accumulation, int64_t ranks = 1) {
  TrainOptions options;
  options.max_length = 128;
  options.global_batch_size = global;
  options.micro_batch_size = micro;
  options.gradient_accumulation_steps = accumulation;
  options.data_parallel_size = ranks;
  return options;
}

std::string error_of(const TrainOptions& options) {
  try {
    plan_batches(options);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(BatchPlan, SamplesGiveAccumulationGlobalOverMicroTimesRanks) {
  struct Case {
    int64_t global, micro, accumulation, ranks;
    int64_t want_accumulation, want_micro, want_global;
  };
  for (const Case& c : {Case{8, 1, 0, 1, 8, 1, 8}, Case{8, 0, 0, 1, 8, 1, 8}, Case{8, 8, 0, 1, 1, 8, 8},
                        Case{16, 2, 0, 2, 4, 2, 16}, Case{16, 2, 8, 1, 8, 2, 16}, Case{0, 4, 3, 1, 3, 4, 12},
                        Case{0, 4, 0, 2, 1, 4, 8}}) {
    const BatchPlan plan = plan_batches(batch_options(c.global, c.micro, c.accumulation, c.ranks));
    EXPECT_EQ(plan.accumulation, c.want_accumulation) << c.global << "/" << c.micro << "x" << c.ranks;
    EXPECT_EQ(plan.micro_batch_samples, c.want_micro);
    EXPECT_EQ(plan.global_batch_samples, c.want_global);
    // Every sample of a micro-batch fits at max_length, so only the sample count limits it.
    EXPECT_EQ(plan.token_budget, c.want_micro * 128);
  }
}

TEST(BatchPlan, TokensAreTheAlternative) {
  TrainOptions options = batch_options(0, 0, 0);
  BatchPlan plan = plan_batches(options);
  EXPECT_EQ(plan.accumulation, 1);
  EXPECT_EQ(plan.micro_batch_samples, 0);
  EXPECT_EQ(plan.global_batch_samples, 0);
  EXPECT_EQ(plan.token_budget, 128);
  options.gradient_accumulation_steps = 4;
  options.micro_batch_tokens = 512;
  plan = plan_batches(options);
  EXPECT_EQ(plan.accumulation, 4);
  EXPECT_EQ(plan.token_budget, 512);
  EXPECT_EQ(plan.micro_batch_samples, 0);
}

TEST(BatchPlan, ContradictionsNameTheFlags) {
  struct Case {
    TrainOptions options;
    std::string expected;
  };
  TrainOptions with_tokens = batch_options(8, 2, 0);
  with_tokens.micro_batch_tokens = 512;
  const Case cases[] = {
      {batch_options(10, 4, 0), "--global_batch_size 10 is not a multiple of --micro_batch_size 4 x 1 "
                                "data-parallel rank(s) = 4; use 8 or 12"},
      {batch_options(2, 4, 0), "--global_batch_size 2 is not a multiple of --micro_batch_size 4 x 1 data-parallel "
                               "rank(s) = 4; use 4, or change"},
      {batch_options(12, 2, 0, 4), "--global_batch_size 12 is not a multiple of --micro_batch_size 2 x 4 "
                                   "data-parallel rank(s) = 8; use 8 or 16"},
      {batch_options(16, 2, 4), "--gradient_accumulation_steps 4 contradicts --global_batch_size 16 / "
                                "(--micro_batch_size 2 x 1 data-parallel rank(s)) = 8"},
      {with_tokens, "--micro_batch_tokens (512) cannot be combined with --global_batch_size / --micro_batch_size"},
      {batch_options(-8, 1, 0), "--global_batch_size must be >= 0"},
      {batch_options(8, -1, 0), "--micro_batch_size must be >= 0"},
      {batch_options(0, 0, -2), "--gradient_accumulation_steps must be >= 0"},
  };
  for (const Case& c : cases) {
    const std::string message = error_of(c.options);
    EXPECT_NE(message.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in '" << message << "'";
  }
}

// The per-token CE weight the CPU model applies in a micro-batch of n supervised tokens: the engine
// seeds fl32(ce_token_weight * n) and cross_entropy_backward_ref divides that by n in fp32.
float cpu_per_token_weight(double ce_token_weight, int64_t n) {
  return static_cast<float>(ce_token_weight * static_cast<double>(n)) / static_cast<float>(n);
}

// Whatever the step's S and a micro-batch's n, the trainer's seeding gives each token the weight 1
// (the division by S comes once, after the sum). The old seeding, 1 / S per micro-batch, gives
// fl32(1 / S) only for some n: 12 of S = 76 (the trainer_engine_test run) gets 1 ulp less.
TEST(BatchPlan, MicroBatchWeightsGiveEveryTokenTheSameWeightInAnySplit) {
  constexpr int64_t kMaxSupervised = 1500;
  int64_t pairs = 0, trainer_moved = 0, old_moved = 0;
  for (int64_t total = 1; total <= kMaxSupervised; ++total) {
    const MicroBatchWeights weights = micro_batch_weights(total, 1, 0.0);
    ASSERT_EQ(weights.gradient_divisor, static_cast<double>(total));
    const float old_whole = cpu_per_token_weight(1.0 / total, total);
    for (int64_t n = 1; n <= total; ++n) {
      ++pairs;
      trainer_moved += cpu_per_token_weight(weights.ce_token_weight, n) != 1.0f;
      old_moved += cpu_per_token_weight(1.0 / total, n) != old_whole;
    }
  }
  std::printf("  per-token CE weight depends on the micro-batch in %lld of %lld (S, n) pairs with the trainer's\n"
              "  seeding, in %lld with 1 / S per micro-batch (S <= %lld)\n", static_cast<long long>(trainer_moved),
              static_cast<long long>(pairs), static_cast<long long>(old_moved),
              static_cast<long long>(kMaxSupervised));
  EXPECT_EQ(trainer_moved, 0);
  EXPECT_GT(old_moved, 0);  // the control: the old seeding does depend on the split
  EXPECT_NE(cpu_per_token_weight(1.0 / 76, 12), cpu_per_token_weight(1.0 / 76, 76));
}

TEST(BatchPlan, MicroBatchWeightsScaleTheAuxLossAndHandleNoSupervisedTokens) {
  const MicroBatchWeights weights = micro_batch_weights(76, 8, 0.01);
  EXPECT_EQ(weights.ce_token_weight, 1.0);
  EXPECT_EQ(weights.gradient_divisor, 76.0);
  const double aux_error = std::abs(weights.aux_weight / weights.gradient_divisor - 0.01 / 8) / (0.01 / 8);
  std::printf("  aux weight after the division: relative error %.3e\n", aux_error);
  EXPECT_LT(aux_error, 1e-15);
  // No supervised token: only the aux loss trains and nothing is divided.
  const MicroBatchWeights aux_only = micro_batch_weights(0, 4, 0.01);
  EXPECT_EQ(aux_only.ce_token_weight, 0.0);
  EXPECT_EQ(aux_only.gradient_divisor, 1.0);
  EXPECT_EQ(aux_only.aux_weight, 0.01 / 4);
  auto message = [](auto call) -> std::string {
    try {
      call();
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(message([] { micro_batch_weights(-1, 1, 0.0); }).find("-1 supervised tokens"), std::string::npos);
  EXPECT_NE(message([] { micro_batch_weights(5, 0, 0.0); }).find("at least one micro-batch"), std::string::npos);
  EXPECT_NE(message([] { micro_batch_weights(5, 1, std::nan("")); }).find("--router_aux_loss_coef"),
            std::string::npos);
  std::vector<float> grad = {1.0f};
  EXPECT_NE(message([&] { divide_gradient(grad.data(), grad.size(), 0.0); }).find("divisor must be positive"),
            std::string::npos);
}

TEST(BatchPlan, DivideGradientDividesEachElement) {
  // Multiples of the divisor come out exact; the rest within half an fp32 ulp of the true quotient.
  const double divisor = 76;
  std::vector<float> grad = {76.0f * 3, -76.0f * 5, 0.0f, 1.0f, -0.3f, 1e-30f, 5e30f};
  const std::vector<float> before = grad;
  divide_gradient(grad.data(), grad.size(), divisor);
  EXPECT_EQ(grad[0], 3.0f);
  EXPECT_EQ(grad[1], -5.0f);
  EXPECT_EQ(grad[2], 0.0f);
  double worst_ulps = 0;
  for (size_t i = 0; i < grad.size(); ++i) {
    const double exact = static_cast<double>(before[i]) / divisor;
    const double ulp = std::nextafter(std::abs(grad[i]), std::numeric_limits<float>::infinity()) - std::abs(grad[i]);
    if (exact != 0) worst_ulps = std::max(worst_ulps, std::abs(grad[i] - exact) / ulp);
  }
  std::printf("  divide_gradient: worst error %.3f fp32 ulp\n", worst_ulps);
  EXPECT_LE(worst_ulps, 0.5 + 1e-9);
  // Divisor 1 (a step without supervised tokens) leaves every bit as it was.
  std::vector<float> same = before;
  divide_gradient(same.data(), same.size(), 1.0);
  EXPECT_EQ(same, before);
}

}  // namespace
}  // namespace deltamoe
