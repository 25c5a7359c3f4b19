// Warmup + cosine-to-min_lr schedule, written in the same fp64 order as transformers' lambda.
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace deltamoe {

int64_t resolve_warmup_steps(const LrScheduleConfig& config) {
  if (config.warmup_steps >= 0) return config.warmup_steps;
  return static_cast<int64_t>(std::ceil(static_cast<double>(config.total_steps) * config.warmup_ratio));
}

void validate_lr_schedule(const LrScheduleConfig& config) {
  CHECK(std::isfinite(config.lr) && config.lr >= 0, "--lr must be a non-negative number, got ", config.lr);
  CHECK(std::isfinite(config.min_lr) && config.min_lr >= 0 && config.min_lr <= config.lr,
        "--min_lr must be in [0, --lr] = [0, ", config.lr, "], got ", config.min_lr);
  CHECK(config.total_steps > 0, "the run has ", config.total_steps,
        " optimizer steps; it needs at least one (check --num_train_epochs / --max_steps and the dataset size)");
  CHECK(config.warmup_ratio >= 0 && config.warmup_ratio <= 1, "--warmup_ratio must be in [0, 1], got ",
        config.warmup_ratio);
  const int64_t warmup = resolve_warmup_steps(config);
  CHECK(warmup <= config.total_steps, "--warmup_steps ", warmup, " is more than the ", config.total_steps,
        " optimizer steps of the run");
}

LrSchedule::LrSchedule(const LrScheduleConfig& config) : config_(config) {
  validate_lr_schedule(config);
  warmup_steps_ = resolve_warmup_steps(config);
}

double LrSchedule::lr_at(int64_t step) const {
  CHECK(step >= 0, "LrSchedule::lr_at: negative step ", step);
  const int64_t warmup = warmup_steps_;
  if (step < warmup) {
    return config_.lr * (static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup)));
  }
  const double decay_steps = static_cast<double>(std::max<int64_t>(1, config_.total_steps - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / decay_steps);
  // HF: factor = 0.5 * (1 + cos(pi * num_cycles * 2 * progress)) with num_cycles = 0.5.
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress));
  if (config_.lr == 0) return 0.0;
  const double min_lr_rate = config_.min_lr / config_.lr;
  const double factor = std::max(0.0, cosine * (1.0 - min_lr_rate) + min_lr_rate);
  return config_.lr * factor;
}

}  // namespace deltamoe
