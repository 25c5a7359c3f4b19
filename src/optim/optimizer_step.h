// One optimizer step as the trainer runs it: learning rate from the schedule, gradient clipping
// by the global norm, the skip policy for a non-finite norm, and the progress counters.
#pragma once

#include "optim/adamw.h"
#include "optim/grad_clip.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer_state.h"

namespace deltamoe {

struct StepReport {
  int64_t step_idx = 0;  // schedule index of this step
  double lr = 0;         // learning rate used (also reported for a skipped step)
  double grad_norm = 0;  // global norm before clipping
  float clip_coef = 1.0f;
  bool skipped = false;  // true when the norm was not finite: weights and moments untouched
};

// Applies the step described by clip (computed by the caller over the GLOBAL gradient: for one
// rank grad_clip_from_sum_of_squares(sum_of_squares_f64(...)), for several the all-reduced sum).
// Policy: a non-finite norm skips the update (weights, moments and adam_step unchanged) but the
// schedule still advances, so the run ends on schedule; progress->skipped_steps counts skips.
// Nothing is logged here: the trainer reports report.skipped once (not once per rank).
// grad (range-local, optimizer.range().size() values) is scaled in place by the clip factor.
StepReport apply_optimizer_step(AdamW& optimizer, const LrSchedule& schedule, const GradClipResult& clip,
                                OptimizerProgress* progress, float* master, float* grad);

// The single-rank case: clip over grad itself with max_grad_norm (<= 0: no clipping), then step.
StepReport clip_and_step(AdamW& optimizer, const LrSchedule& schedule, double max_grad_norm,
                         OptimizerProgress* progress, float* master, float* grad);

}  // namespace deltamoe
