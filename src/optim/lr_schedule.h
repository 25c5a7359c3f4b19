// Learning-rate schedule: linear warmup from 0 to --lr, then cosine decay to --min_lr, the same
// numbers as transformers' get_cosine_with_min_lr_schedule_with_warmup (what ms-swift runs).
#pragma once

#include <cstdint>

namespace deltamoe {

struct LrScheduleConfig {
  double lr = 1e-5;           // --lr: peak learning rate, reached at the end of warmup
  double min_lr = 0.0;        // --min_lr: floor of the cosine
  int64_t total_steps = 0;    // optimizer steps of the whole run (N)
  int64_t warmup_steps = -1;  // --warmup_steps; < 0 means "derive from warmup_ratio"
  double warmup_ratio = 0.0;  // --warmup_ratio, used when warmup_steps < 0
};

// Warmup length W: warmup_steps when given (>= 0), else ceil(total_steps * warmup_ratio) in fp64,
// exactly as transformers' TrainingArguments.get_warmup_steps (so 100 * 0.07 -> 8, as there).
int64_t resolve_warmup_steps(const LrScheduleConfig& config);

// Checks the flags and throws an error naming the flag: lr >= 0, 0 <= min_lr <= lr,
// total_steps > 0, 0 <= warmup_ratio <= 1, warmup steps <= total_steps.
void validate_lr_schedule(const LrScheduleConfig& config);

// The learning rate of optimizer step s (0-based: s = 0 is the first update, s = N - 1 the last).
//   s <  W:  lr * s / max(1, W)                      (step 0 runs at lr 0 when W > 0, as in HF)
//   s >= W:  progress = (s - W) / max(1, N - W), clamped to [0, 1]
//            lr * (r + (1 - r) * 0.5 * (1 + cos(pi * progress))),  r = min_lr / lr
// so the first post-warmup step runs at lr, the last at slightly above min_lr, and min_lr is the
// value at s = N (and after, where HF's cosine would rise again and ours stays at min_lr).
class LrSchedule {
 public:
  explicit LrSchedule(const LrScheduleConfig& config);
  double lr_at(int64_t step) const;
  int64_t warmup_steps() const { return warmup_steps_; }
  const LrScheduleConfig& config() const { return config_; }

 private:
  LrScheduleConfig config_;
  int64_t warmup_steps_;
};

}  // namespace deltamoe
