// Tests of global-norm clipping: the norm against an independent long-double sum, torch's
// coefficient, no clipping below max_norm, sharded partial sums, and the non-finite policy.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "optim/grad_clip.h"
#include "optim/optimizer_step.h"

namespace deltamoe {
namespace {

std::vector<float> random_grad(int64_t count, uint64_t seed, double scale) {
  Rng rng(seed);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = static_cast<float>(rng.normal() * scale);
  return values;
}

long double norm_long_double(const std::vector<float>& values) {
  long double sum = 0;
  for (float value : values) sum += static_cast<long double>(value) * value;
  return std::sqrt(sum);
}

TEST(GradClip, ClipsToMaxNormWhenAbove) {
  std::vector<float> grad = random_grad(10007, 1, 3.0);
  const std::vector<float> original = grad;
  const long double expected_norm = norm_long_double(grad);
  GradClipResult result = clip_grad_norm(grad.data(), static_cast<int64_t>(grad.size()), 1.0);
  const double norm_rel_error = std::fabs(result.grad_norm - static_cast<double>(expected_norm)) / static_cast<double>(expected_norm);
  std::printf("norm %.6f vs long double %.6Lf: rel error %.3g\n", result.grad_norm, expected_norm, norm_rel_error);
  EXPECT_LT(norm_rel_error, 1e-12);  // fp64 summation of 1e4 terms
  EXPECT_TRUE(result.finite);
  ASSERT_TRUE(result.clipped());
  EXPECT_EQ(result.clip_coef, static_cast<float>(1.0 / (static_cast<double>(expected_norm) + 1e-6)));
  for (size_t i = 0; i < grad.size(); ++i) ASSERT_EQ(grad[i], original[i] * result.clip_coef) << i;
  const double clipped_norm = static_cast<double>(norm_long_double(grad));
  std::printf("norm after clipping to 1.0: %.9f (abs error %.3g)\n", clipped_norm, std::fabs(clipped_norm - 1.0));
  EXPECT_NEAR(clipped_norm, 1.0, 1e-5);
}

TEST(GradClip, LeavesSmallGradientsAloneButReportsTheNorm) {
  std::vector<float> grad = random_grad(1000, 2, 1e-3);
  const std::vector<float> original = grad;
  GradClipResult result = clip_grad_norm(grad.data(), static_cast<int64_t>(grad.size()), 1.0);
  EXPECT_FALSE(result.clipped());
  EXPECT_EQ(result.clip_coef, 1.0f);
  EXPECT_NEAR(result.grad_norm, static_cast<double>(norm_long_double(original)), 1e-12);
  EXPECT_EQ(grad, original);
  // max_norm <= 0 disables clipping even for a large gradient; the norm is still reported.
  std::vector<float> large = random_grad(1000, 3, 10.0);
  const std::vector<float> large_original = large;
  result = clip_grad_norm(large.data(), static_cast<int64_t>(large.size()), 0.0);
  EXPECT_FALSE(result.clipped());
  EXPECT_GT(result.grad_norm, 100.0);
  EXPECT_EQ(large, large_original);
}

TEST(GradClip, ShardedPartialSumsGiveTheSameNorm) {
  std::vector<float> grad = random_grad(4099, 4, 1.0);
  const double whole = sum_of_squares_f64(grad.data(), static_cast<int64_t>(grad.size()));
  double parts = 0;
  for (int64_t begin = 0; begin < 4099; begin += 1000) {
    parts += sum_of_squares_f64(grad.data() + begin, std::min<int64_t>(1000, 4099 - begin));
  }
  const double rel_error = std::fabs(std::sqrt(parts) - std::sqrt(whole)) / std::sqrt(whole);
  std::printf("sharded vs whole norm: rel error %.3g\n", rel_error);
  EXPECT_LT(rel_error, 1e-12);
}

TEST(GradClip, NonFiniteNormSkipsTheStep) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> grad = random_grad(100, 5, 1.0);
    grad[17] = bad;
    const std::vector<float> original = grad;
    GradClipResult result = clip_grad_norm(grad.data(), static_cast<int64_t>(grad.size()), 1.0);
    EXPECT_FALSE(result.finite);
    EXPECT_FALSE(result.clipped());
    for (size_t i = 0; i < grad.size(); ++i) {
      if (i != 17) {
        ASSERT_EQ(grad[i], original[i]);  // not multiplied by NaN
      }
    }
  }
  // Squares that overflow fp32 stay finite in fp64: a gradient of 1e30 is not "non-finite".
  std::vector<float> huge(4, 1e30f);
  GradClipResult result = clip_grad_norm(huge.data(), 4, 1.0);
  EXPECT_TRUE(result.finite);
  EXPECT_NEAR(result.grad_norm, 2e30, 2e30 * 1e-6);
}

TEST(GradClip, SkippedStepLeavesWeightsAndMomentsButAdvancesTheSchedule) {
  ParamLayout layout;
  layout.add("w", {4, 8});
  AdamW optimizer(layout, AdamWConfig{});
  LrScheduleConfig schedule_config;
  schedule_config.lr = 1e-3;
  schedule_config.total_steps = 10;
  LrSchedule schedule(schedule_config);
  OptimizerProgress progress;
  std::vector<float> master = random_grad(layout.total_numel(), 6, 1.0);
  std::vector<float> grad = random_grad(layout.total_numel(), 7, 1.0);
  StepReport report = clip_and_step(optimizer, schedule, 1.0, &progress, master.data(), grad.data());
  EXPECT_FALSE(report.skipped);
  EXPECT_EQ(optimizer.adam_step(), 1);
  const std::vector<float> master_before = master;
  const std::vector<uint8_t> m_before = optimizer.exp_avg_bytes();
  grad[3] = std::numeric_limits<float>::quiet_NaN();
  report = clip_and_step(optimizer, schedule, 1.0, &progress, master.data(), grad.data());
  EXPECT_TRUE(report.skipped);
  EXPECT_TRUE(std::isnan(report.grad_norm));
  EXPECT_EQ(report.step_idx, 1);
  EXPECT_EQ(master, master_before);
  EXPECT_EQ(optimizer.exp_avg_bytes(), m_before);
  EXPECT_EQ(optimizer.adam_step(), 1);
  EXPECT_EQ(progress.schedule_step, 2);
  EXPECT_EQ(progress.skipped_steps, 1);
}

}  // namespace
}  // namespace deltamoe
