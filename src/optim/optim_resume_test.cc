// Resume test (issue 6): N steps straight == k steps, save, load into a fresh optimizer, N - k
// steps, bitwise for weights, moments and counters; with f32 and bf16 moments, clipping, a
// skipped non-finite step, and a 2-way sharded optimizer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <vector>

#include "core/rng.h"
#include "optim/optimizer_step.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kTotalSteps = 20;
constexpr int64_t kNonFiniteStep = 13;  // this step's gradient holds a NaN and is skipped

ParamLayout make_layout() {
  ParamLayout layout;
  layout.add("embed.weight", {9, 8});
  layout.add("layers.0.input_layernorm.weight", {8});
  layout.add("layers.0.mlp.experts.down_proj", {4, 8, 5});
  layout.add("layers.0.mlp.gate.weight", {4, 8});
  layout.add("lm_head.weight", {9, 8});
  return layout;
}

LrSchedule make_schedule() {
  LrScheduleConfig config;
  config.lr = 5e-2;
  config.min_lr = 5e-3;
  config.total_steps = kTotalSteps;
  config.warmup_ratio = 0.1;
  return LrSchedule(config);
}

// A "model" whose gradient depends on the weights (pull towards a target) plus per-step noise,
// so a resumed run only matches if it restored the weights, not just the moments.
std::vector<float> gradient_at(const std::vector<float>& master, int64_t step) {
  Rng noise(77, static_cast<uint64_t>(step));
  std::vector<float> grad(master.size());
  for (size_t i = 0; i < master.size(); ++i) {
    const float target = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
    grad[i] = 2.0f * (master[i] - target) + static_cast<float>(noise.normal());
  }
  if (step == kNonFiniteStep) grad[5] = std::numeric_limits<float>::quiet_NaN();
  return grad;
}

// One "rank" of training: its optimizer over a shard, its progress counters.
struct Rank {
  std::unique_ptr<AdamW> optimizer;
  OptimizerProgress progress;
};

struct Trainer {
  ParamLayout layout = make_layout();
  LrSchedule schedule = make_schedule();
  std::vector<float> master;  // the full flat buffer; each rank owns its shard of it
  std::vector<Rank> ranks;
  double max_grad_norm = 5.0;  // low enough that most steps clip

  Trainer(DType moment_dtype, int num_ranks) {
    AdamWConfig config;
    config.moment_dtype = moment_dtype;
    config.weight_decay = 0.1;
    Rng init(5);
    master.resize(static_cast<size_t>(layout.total_numel()));
    for (float& value : master) value = static_cast<float>(init.normal() * 0.5);
    for (int r = 0; r < num_ranks; ++r) {
      ranks.push_back({std::make_unique<AdamW>(layout, config, shard_range(layout.total_numel(), r, num_ranks)), {}});
    }
  }

  void train_until(int64_t end_step) {
    while (ranks[0].progress.schedule_step < end_step) {
      std::vector<float> grad = gradient_at(master, ranks[0].progress.schedule_step);
      double sum_of_squares = 0;  // the all-reduce of per-shard partial sums
      for (Rank& rank : ranks) {
        const FlatRange range = rank.optimizer->range();
        sum_of_squares += sum_of_squares_f64(grad.data() + range.begin, range.size());
      }
      const GradClipResult clip = grad_clip_from_sum_of_squares(sum_of_squares, max_grad_norm);
      for (Rank& rank : ranks) {
        const int64_t begin = rank.optimizer->range().begin;
        apply_optimizer_step(*rank.optimizer, schedule, clip, &rank.progress, master.data() + begin,
                             grad.data() + begin);
      }
    }
  }

  void save(const fs::path& dir) const {
    for (size_t r = 0; r < ranks.size(); ++r) {
      save_optimizer_state((dir / ("rank" + std::to_string(r))).string(), *ranks[r].optimizer, ranks[r].progress,
                           master.data() + ranks[r].optimizer->range().begin);
    }
  }

  void load(const fs::path& dir) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      ranks[r].progress = load_optimizer_state((dir / ("rank" + std::to_string(r))).string(), ranks[r].optimizer.get(),
                                               master.data() + ranks[r].optimizer->range().begin);
    }
  }
};

void expect_bitwise_equal(const Trainer& a, const Trainer& b) {
  ASSERT_EQ(a.master.size(), b.master.size());
  EXPECT_EQ(0, std::memcmp(a.master.data(), b.master.data(), a.master.size() * sizeof(float))) << "master weights";
  for (size_t r = 0; r < a.ranks.size(); ++r) {
    EXPECT_EQ(a.ranks[r].optimizer->exp_avg_bytes(), b.ranks[r].optimizer->exp_avg_bytes()) << "exp_avg rank " << r;
    EXPECT_EQ(a.ranks[r].optimizer->exp_avg_sq_bytes(), b.ranks[r].optimizer->exp_avg_sq_bytes()) << "exp_avg_sq rank " << r;
    EXPECT_EQ(a.ranks[r].optimizer->adam_step(), b.ranks[r].optimizer->adam_step());
    EXPECT_EQ(a.ranks[r].progress.schedule_step, b.ranks[r].progress.schedule_step);
    EXPECT_EQ(a.ranks[r].progress.skipped_steps, b.ranks[r].progress.skipped_steps);
  }
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double max_difference = 0;
  for (size_t i = 0; i < a.size(); ++i) max_difference = std::max(max_difference, std::fabs(double(a[i]) - b[i]));
  return max_difference;
}

struct ResumeCase {
  DType moment_dtype;
  int num_ranks;
  int64_t save_step;
};

class Resume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(Resume, StraightRunEqualsSaveLoadContinue) {
  const ResumeCase param = GetParam();
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_optim_resume_" + std::to_string(::getpid()) + "_" +
                                                    std::string(dtype_name(param.moment_dtype)) + "_" +
                                                    std::to_string(param.num_ranks) + "_" + std::to_string(param.save_step));
  fs::create_directories(dir);

  Trainer straight(param.moment_dtype, param.num_ranks);
  const std::vector<float> initial = straight.master;
  straight.train_until(kTotalSteps);

  Trainer first_half(param.moment_dtype, param.num_ranks);
  first_half.train_until(param.save_step);
  first_half.save(dir);
  // A fresh process: new optimizers with zero moments and a scrambled weight buffer.
  Trainer resumed(param.moment_dtype, param.num_ranks);
  for (float& value : resumed.master) value = 123.0f;
  resumed.load(dir);
  resumed.train_until(kTotalSteps);

  expect_bitwise_equal(straight, resumed);
  EXPECT_EQ(straight.ranks[0].progress.skipped_steps, 1);  // the NaN step really was skipped
  EXPECT_EQ(straight.ranks[0].optimizer->adam_step(), kTotalSteps - 1);
  const double moved = max_abs_difference(initial, straight.master);
  std::printf("%s moments, %d rank(s), save at %lld: weights moved up to %.4f; resumed vs straight bitwise equal\n",
              std::string(dtype_name(param.moment_dtype)).c_str(), param.num_ranks,
              static_cast<long long>(param.save_step), moved);
  EXPECT_GT(moved, 0.05);

  // Control: continuing without restoring the optimizer state does not reproduce the run,
  // so the bitwise comparison above can fail.
  Trainer not_restored(param.moment_dtype, param.num_ranks);
  not_restored.master = first_half.master;
  for (Rank& rank : not_restored.ranks) rank.progress = first_half.ranks[0].progress;
  not_restored.train_until(kTotalSteps);
  const double control_difference = max_abs_difference(straight.master, not_restored.master);
  std::printf("  control without optimizer state: max abs weight difference %.3g\n", control_difference);
  EXPECT_GT(control_difference, 1e-4);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Optim, Resume,
                         ::testing::Values(ResumeCase{DType::f32, 1, 10}, ResumeCase{DType::bf16, 1, 10},
                                           ResumeCase{DType::f32, 2, 10}, ResumeCase{DType::bf16, 2, 13},
                                           ResumeCase{DType::f32, 1, 14}, ResumeCase{DType::f32, 1, 1}));

}  // namespace
}  // namespace deltamoe
