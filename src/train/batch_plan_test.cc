// Batch-size flags: samples (--global_batch_size / --micro_batch_size) and tokens
// (--micro_batch_tokens) resolve to the right accumulation, and contradictions fail with a message
// that names the flags.
#include <gtest/gtest.h>

#include <string>

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

}  // namespace
}  // namespace deltamoe
