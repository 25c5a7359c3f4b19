// Tests of AdamW: a first step worked out by hand, many steps against an independent fp64
// textbook AdamW, no decay on 1-D tensors, bf16 moment rounding, shards, padding, flag checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"

namespace deltamoe {
namespace {

// A layout with matrices, a vector (no decay), a scalar-ish vector and an expert stack.
ParamLayout make_test_layout() {
  ParamLayout layout;
  layout.add("embed.weight", {7, 5});
  layout.add("norm.weight", {13});
  layout.add("experts.down", {3, 4, 6});
  layout.add("gate.bias", {1});
  return layout;
}

std::vector<float> random_values(int64_t count, uint64_t seed, uint64_t stream, double scale) {
  Rng rng(seed, stream);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = static_cast<float>(rng.normal() * scale);
  return values;
}

TEST(AdamW, FirstStepMatchesHandComputation) {
  // After one step m_hat = g and v_hat = g^2, so p1 = p0 * (1 - lr*wd) - lr * g / (|g| + eps).
  ParamLayout layout;
  layout.add("w", {1, 1});
  AdamWConfig config;
  config.beta1 = 0.9;
  config.beta2 = 0.999;
  config.eps = 1e-8;
  config.weight_decay = 0.1;
  AdamW optimizer(layout, config);
  std::vector<float> master = {1.0f};
  std::vector<float> grad = {0.5f};
  const double lr = 1e-3;
  optimizer.step(lr, master.data(), grad.data());
  const double expected = 1.0 * (1 - lr * 0.1) - lr * 0.5 / (0.5 + 1e-8);  // 0.99890000002
  const double error = std::fabs(master[0] - expected);
  std::printf("first step: got %.9g expected %.11g abs error %.3g\n", master[0], expected, error);
  EXPECT_LT(error, 1e-7);
  EXPECT_EQ(optimizer.adam_step(), 1);
  // m1 = (1 - beta1) g = 0.05, v1 = (1 - beta2) g^2 = 0.00025.
  // fp32 holds them to a relative 2^-24 (~6e-8) per rounding; allow a few roundings.
  const double m_rel_error = std::fabs(optimizer.exp_avg_f32()[0] - 0.05) / 0.05;
  const double v_rel_error = std::fabs(optimizer.exp_avg_sq_f32()[0] - 0.00025) / 0.00025;
  std::printf("first step moments: m rel error %.3g, v rel error %.3g\n", m_rel_error, v_rel_error);
  EXPECT_LT(m_rel_error, 2e-7);
  EXPECT_LT(v_rel_error, 2e-7);
}

TEST(AdamW, EpsIsAddedOutsideTheSquareRoot) {
  // g = eps: outside the root the first update is lr * g / (|g| + eps) = lr / 2; inside it
  // would be lr * g / sqrt(g^2 + eps) ~ lr * 1e-4.
  ParamLayout layout;
  layout.add("w", {1});
  AdamWConfig config;
  config.eps = 1e-8;
  config.weight_decay = 0;
  AdamW optimizer(layout, config);
  std::vector<float> master = {0.0f};
  std::vector<float> grad = {1e-8f};
  optimizer.step(1.0, master.data(), grad.data());
  const double error = std::fabs(master[0] - (-0.5));
  std::printf("eps placement: update %.9g, expected -0.5, abs error %.3g\n", master[0], error);
  EXPECT_LT(error, 1e-6);
}

// Textbook AdamW in fp64, written from the paper's form (bias-corrected m_hat and v_hat),
// not from torch's order of operations.
struct ReferenceAdamW {
  AdamWConfig config;
  std::vector<double> m, v;
  int64_t t = 0;
  void step(double lr, std::vector<double>& p, const std::vector<double>& g, const std::vector<bool>& decay) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    for (size_t i = 0; i < p.size(); ++i) {
      m[i] = config.beta1 * m[i] + (1 - config.beta1) * g[i];
      v[i] = config.beta2 * v[i] + (1 - config.beta2) * g[i] * g[i];
      const double m_hat = m[i] / (1 - std::pow(config.beta1, t));
      const double v_hat = v[i] / (1 - std::pow(config.beta2, t));
      const double decayed = decay[i] ? p[i] - lr * config.weight_decay * p[i] : p[i];
      p[i] = decayed - lr * m_hat / (std::sqrt(v_hat) + config.eps);
    }
  }
};

void run_against_reference(DType moment_dtype, double tolerance) {
  ParamLayout layout = make_test_layout();
  AdamWConfig config;
  config.weight_decay = 0.1;
  config.moment_dtype = moment_dtype;
  AdamW optimizer(layout, config);
  ReferenceAdamW reference{config, {}, {}, 0};

  const int64_t n = layout.total_numel();
  std::vector<float> master = random_values(n, 1, 0, 1.0);
  std::vector<double> ref_master(master.begin(), master.end());
  std::vector<bool> decay(static_cast<size_t>(n), false);
  std::vector<bool> in_tensor(static_cast<size_t>(n), false);
  for (const ParamEntry& entry : layout.entries()) {
    for (int64_t i = 0; i < entry.numel; ++i) {
      decay[static_cast<size_t>(entry.offset + i)] = entry.decay;
      in_tensor[static_cast<size_t>(entry.offset + i)] = true;
    }
  }
  LrScheduleConfig schedule_config;
  schedule_config.lr = 1e-2;
  schedule_config.min_lr = 1e-3;
  schedule_config.total_steps = 30;
  schedule_config.warmup_steps = 3;
  LrSchedule schedule(schedule_config);

  double max_abs_error = 0, max_rel_error = 0;
  for (int64_t step = 0; step < schedule_config.total_steps; ++step) {
    std::vector<float> grad = random_values(n, 2, static_cast<uint64_t>(step), 0.01);
    std::vector<double> ref_grad(grad.begin(), grad.end());
    const double lr = schedule.lr_at(step);
    optimizer.step(lr, master.data(), grad.data());
    reference.step(lr, ref_master, ref_grad, decay);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!in_tensor[static_cast<size_t>(i)]) continue;
    const double error = std::fabs(master[static_cast<size_t>(i)] - ref_master[static_cast<size_t>(i)]);
    max_abs_error = std::max(max_abs_error, error);
    max_rel_error = std::max(max_rel_error, error / std::max(1e-3, std::fabs(ref_master[static_cast<size_t>(i)])));
  }
  std::printf("%s moments, 30 steps vs fp64 textbook AdamW: max abs error %.3g, max rel error %.3g\n",
              std::string(dtype_name(moment_dtype)).c_str(), max_abs_error, max_rel_error);
  EXPECT_LT(max_abs_error, tolerance);
  // The total movement is about sum(lr) ~ 0.17, so the errors above are small relative to it.
}

TEST(AdamW, MatchesFp64TextbookAdamWOverManySteps) { run_against_reference(DType::f32, 2e-6); }

TEST(AdamW, Bf16MomentsStayCloseToFp64Reference) {
  // bf16 keeps 8 mantissa bits: the update direction m/sqrt(v) is off by ~2^-8 relative.
  run_against_reference(DType::bf16, 3e-3);
}

TEST(AdamW, OneDimensionalTensorsGetNoDecay) {
  ParamLayout layout = make_test_layout();
  AdamWConfig config;
  config.weight_decay = 0.5;
  AdamW optimizer(layout, config);
  std::vector<float> master = random_values(layout.total_numel(), 3, 0, 1.0);
  const std::vector<float> before = master;
  // Zero gradient: m = v = 0, so the Adam part is 0 / (0 + eps) = 0 and only decay acts.
  std::vector<float> grad(master.size(), 0.0f);
  const double lr = 0.1;
  optimizer.step(lr, master.data(), grad.data());
  const float decay_factor = static_cast<float>(1.0 - lr * 0.5);
  for (const ParamEntry& entry : layout.entries()) {
    EXPECT_EQ(entry.decay, entry.shape.size() >= 2) << entry.name;
    for (int64_t i = entry.offset; i < entry.offset + entry.numel; ++i) {
      const float expected = entry.decay ? before[static_cast<size_t>(i)] * decay_factor : before[static_cast<size_t>(i)];
      ASSERT_EQ(master[static_cast<size_t>(i)], expected) << entry.name << " element " << i - entry.offset;
    }
  }
  // An explicit flag overrides the rank rule.
  ParamLayout overridden;
  overridden.add("lora_A", {4, 4}, false);
  EXPECT_FALSE(overridden.entry(0).decay);
}

TEST(AdamW, Bf16MomentsAreStoredRoundedToNearestEven) {
  ParamLayout layout;
  layout.add("w", {64});
  AdamWConfig config;
  config.moment_dtype = DType::bf16;
  AdamW optimizer(layout, config);
  std::vector<float> master = random_values(64, 4, 0, 1.0);
  std::vector<float> grad = random_values(64, 4, 1, 1.0);
  optimizer.step(1e-3, master.data(), grad.data());
  const auto* m_bits = static_cast<const uint16_t*>(optimizer.exp_avg().data);
  const auto* v_bits = static_cast<const uint16_t*>(optimizer.exp_avg_sq().data);
  const float one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  const float one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  int num_inexact = 0;
  for (size_t i = 0; i < 64; ++i) {
    // From zero moments: m = 0 + w * (g - 0), v = 0 * beta2 + ((1 - beta2) * g) * g.
    const float m = one_minus_beta1 * grad[i];
    const float v = one_minus_beta2 * grad[i] * grad[i];
    ASSERT_EQ(m_bits[i], float_to_bf16_bits(m)) << i;
    ASSERT_EQ(v_bits[i], float_to_bf16_bits(v)) << i;
    num_inexact += round_to_bf16(m) != m;
  }
  EXPECT_GT(num_inexact, 32);  // the rounding really happened, so the check above meant something
}

TEST(AdamW, LrScaleActsLikeAScaledLearningRate) {
  // A tensor with lr_scale 0.25 under lr must move exactly as the same tensor under lr * 0.25.
  ParamLayout scaled_layout;
  scaled_layout.add("llm.w", {4, 4});
  scaled_layout.add("vit.w", {4, 4});
  scaled_layout.set_lr_scale(1, 0.25);
  ParamLayout single_layout;
  single_layout.add("vit.w", {4, 4});
  AdamW scaled(scaled_layout, AdamWConfig{});
  AdamW single(single_layout, AdamWConfig{});
  std::vector<float> master = random_values(scaled_layout.total_numel(), 8, 0, 1.0);
  const int64_t vit_offset = scaled_layout.entry(1).offset;
  std::vector<float> single_master(master.begin() + vit_offset, master.end());
  const std::vector<float> llm_before(master.begin(), master.begin() + 16);
  for (int step = 0; step < 4; ++step) {
    std::vector<float> grad = random_values(scaled_layout.total_numel(), 9, static_cast<uint64_t>(step), 0.1);
    std::vector<float> single_grad(grad.begin() + vit_offset, grad.end());
    scaled.step(1e-2, master.data(), grad.data());
    single.step(1e-2 * 0.25, single_master.data(), single_grad.data());
  }
  EXPECT_EQ(0, std::memcmp(master.data() + vit_offset, single_master.data(), 16 * sizeof(float)));
  EXPECT_NE(0, std::memcmp(master.data(), llm_before.data(), 16 * sizeof(float)));
  EXPECT_THROW(scaled_layout.set_lr_scale(0, -1.0), Error);
}

TEST(AdamW, ShardsGiveBitwiseTheSameResultAsTheWhole) {
  ParamLayout layout = make_test_layout();
  AdamWConfig config;
  AdamW whole(layout, config);
  const int64_t n = layout.total_numel();
  std::vector<float> master = random_values(n, 5, 0, 1.0);
  std::vector<float> shard_master = master;
  const int num_shards = 3;  // boundaries fall inside tensors
  std::vector<AdamW> shards;
  for (int s = 0; s < num_shards; ++s) shards.emplace_back(layout, config, shard_range(n, s, num_shards));
  for (int step = 0; step < 5; ++step) {
    std::vector<float> grad = random_values(n, 6, static_cast<uint64_t>(step), 0.1);
    whole.step(1e-2, master.data(), grad.data());
    for (AdamW& shard : shards) {
      const int64_t begin = shard.range().begin;
      shard.step(1e-2, shard_master.data() + begin, grad.data() + begin);
    }
  }
  EXPECT_EQ(0, std::memcmp(master.data(), shard_master.data(), master.size() * sizeof(float)));
  std::vector<float> whole_m = whole.exp_avg_f32();
  for (const AdamW& shard : shards) {
    std::vector<float> shard_m = shard.exp_avg_f32();
    EXPECT_EQ(0, std::memcmp(whole_m.data() + shard.range().begin, shard_m.data(), shard_m.size() * sizeof(float)));
  }
}

TEST(AdamW, PaddingIsNotTouched) {
  ParamLayout layout;
  layout.add("a", {3});
  layout.add("b", {2, 2});
  ASSERT_EQ(layout.entry(1).offset, kFlatAlignmentElements);
  ASSERT_EQ(layout.total_numel(), kFlatAlignmentElements + 4);
  AdamW optimizer(layout, AdamWConfig{});
  std::vector<float> master(static_cast<size_t>(layout.total_numel()), 7.0f);
  std::vector<float> grad(master.size(), 1.0f);
  optimizer.step(0.1, master.data(), grad.data());
  for (int64_t i = 3; i < kFlatAlignmentElements; ++i) ASSERT_EQ(master[static_cast<size_t>(i)], 7.0f) << i;
  EXPECT_NE(master[0], 7.0f);
  EXPECT_NE(master[static_cast<size_t>(kFlatAlignmentElements)], 7.0f);
}

TEST(AdamW, RejectsBadSettings) {
  ParamLayout layout = make_test_layout();
  AdamWConfig config;
  config.beta2 = 1.0;
  EXPECT_THROW(AdamW(layout, config), Error);
  config = AdamWConfig{};
  config.eps = 0;
  EXPECT_THROW(AdamW(layout, config), Error);
  config = AdamWConfig{};
  config.moment_dtype = DType::f16;
  EXPECT_THROW(AdamW(layout, config), Error);
  config = AdamWConfig{};
  EXPECT_THROW(AdamW(layout, config, FlatRange{0, layout.total_numel() + 1}), Error);
  try {
    config.weight_decay = -1;
    AdamW bad(layout, config);
    FAIL() << "negative weight decay accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--weight_decay"), std::string::npos) << error.what();
  }
  EXPECT_THROW(layout.add("norm.weight", {4}), Error);  // duplicate name
  EXPECT_THROW(layout.add("", {4}), Error);
}

TEST(ParamLayout, ShardRangesCoverTheBufferExactly) {
  for (int num_shards : {1, 2, 3, 7}) {
    int64_t next = 0;
    for (int s = 0; s < num_shards; ++s) {
      FlatRange range = shard_range(100, s, num_shards);
      EXPECT_EQ(range.begin, next);
      EXPECT_LE(range.size() - 100 / num_shards, 1);
      next = range.end;
    }
    EXPECT_EQ(next, 100);
  }
}

}  // namespace
}  // namespace deltamoe
