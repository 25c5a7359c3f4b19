// Tests of the learning-rate schedule: the documented formula point by point, the HF step
// indexing (lr 0 at step 0 with warmup, min_lr at step N), warmup_ratio rounding, flag errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "optim/lr_schedule.h"

namespace deltamoe {
namespace {

// The schedule written independently: cosine interpolation between lr and min_lr.
double expected_lr(double lr, double min_lr, int64_t warmup, int64_t total, int64_t step) {
  if (step < warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
  // max(1, .) keeps warmup == total defined (HF does the same).
  const double decay_steps = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / decay_steps);
  return min_lr + (lr - min_lr) * (1 + std::cos(M_PI * progress)) / 2;
}

TEST(LrSchedule, FollowsTheDocumentedFormula) {
  double max_rel_error = 0;
  for (int64_t total : {1, 2, 10, 97}) {
    for (int64_t warmup : {int64_t{0}, int64_t{1}, total / 3, total - 1}) {
      if (warmup < 0 || warmup > total) continue;
      LrScheduleConfig config;
      config.lr = 2e-5;
      config.min_lr = 2e-6;
      config.total_steps = total;
      config.warmup_steps = warmup;
      LrSchedule schedule(config);
      for (int64_t step = 0; step <= total + 2; ++step) {
        const double expected = expected_lr(config.lr, config.min_lr, warmup, total, step);
        const double got = schedule.lr_at(step);
        const double rel_error = std::fabs(got - expected) / std::max(expected, 1e-30);
        if (expected == 0) {
          EXPECT_EQ(got, 0.0);
        } else {
          max_rel_error = std::max(max_rel_error, rel_error);
        }
      }
    }
  }
  std::printf("schedule vs independent formula: max rel error %.3g\n", max_rel_error);
  EXPECT_LT(max_rel_error, 1e-12);
}

TEST(LrSchedule, StepIndexingAtTheEnds) {
  LrScheduleConfig config;
  config.lr = 1e-4;
  config.min_lr = 1e-5;
  config.total_steps = 100;
  config.warmup_steps = 10;
  LrSchedule schedule(config);
  EXPECT_EQ(schedule.lr_at(0), 0.0);                    // the first update runs at lr 0, as in HF
  EXPECT_DOUBLE_EQ(schedule.lr_at(5), 0.5e-4);          // halfway up the warmup
  EXPECT_DOUBLE_EQ(schedule.lr_at(10), 1e-4);           // peak right after warmup
  EXPECT_DOUBLE_EQ(schedule.lr_at(55), 0.5 * (1e-4 + 1e-5));  // cosine midpoint
  EXPECT_GT(schedule.lr_at(99), 1e-5);                  // the last step is still above min_lr
  EXPECT_LT(schedule.lr_at(99), 1e-5 * 1.01);
  EXPECT_DOUBLE_EQ(schedule.lr_at(100), 1e-5);          // min_lr is reached at s = N
  EXPECT_DOUBLE_EQ(schedule.lr_at(1000), 1e-5);         // and held after
  for (int64_t step = 10; step < 100; ++step) EXPECT_LE(schedule.lr_at(step + 1), schedule.lr_at(step));
}

TEST(LrSchedule, NoWarmupAndConstant) {
  LrScheduleConfig config;
  config.lr = 3e-4;
  config.min_lr = 3e-4;
  config.total_steps = 20;
  config.warmup_steps = 0;
  LrSchedule schedule(config);
  for (int64_t step = 0; step < 25; ++step) EXPECT_DOUBLE_EQ(schedule.lr_at(step), 3e-4);
}

TEST(LrSchedule, WarmupRatioRoundsUpLikeTransformers) {
  LrScheduleConfig config;
  config.total_steps = 100;
  config.warmup_ratio = 0.03;
  EXPECT_EQ(resolve_warmup_steps(config), 3);  // 100 * 0.03 == 3.0 exactly in fp64
  config.warmup_ratio = 0.07;
  EXPECT_EQ(resolve_warmup_steps(config), 8);  // 100 * 0.07 == 7.000000000000001 -> ceil 8
  config.warmup_ratio = 0.05;
  config.total_steps = 7;
  EXPECT_EQ(resolve_warmup_steps(config), 1);  // 0.35 -> 1
  config.warmup_steps = 2;                     // explicit steps win over the ratio
  EXPECT_EQ(resolve_warmup_steps(config), 2);
}

void expect_error_mentions(const LrScheduleConfig& config, const std::string& flag) {
  try {
    LrSchedule schedule(config);
    FAIL() << "accepted a bad " << flag;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(flag), std::string::npos) << error.what();
  }
}

TEST(LrSchedule, RejectsBadFlags) {
  LrScheduleConfig good;
  good.lr = 1e-4;
  good.total_steps = 10;
  LrScheduleConfig config = good;
  config.lr = -1;
  expect_error_mentions(config, "--lr");
  config = good;
  config.min_lr = 2e-4;
  expect_error_mentions(config, "--min_lr");
  config = good;
  config.warmup_ratio = 1.5;
  expect_error_mentions(config, "--warmup_ratio");
  config = good;
  config.warmup_steps = 11;
  expect_error_mentions(config, "--warmup_steps");
  config = good;
  config.total_steps = 0;
  expect_error_mentions(config, "optimizer steps");
  LrSchedule schedule(good);
  EXPECT_THROW(schedule.lr_at(-1), Error);
}

}  // namespace
}  // namespace deltamoe
