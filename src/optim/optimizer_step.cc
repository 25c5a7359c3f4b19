// The trainer's optimizer step: schedule lookup, clipping, skip policy, counters.
#include "optim/optimizer_step.h"

#include "core/error.h"

namespace deltamoe {

StepReport apply_optimizer_step(AdamW& optimizer, const LrSchedule& schedule, const GradClipResult& clip,
                                OptimizerProgress* progress, float* master, float* grad) {
  CHECK(progress != nullptr, "apply_optimizer_step: progress is null");
  StepReport report;
  report.step_idx = progress->schedule_step;
  report.lr = schedule.lr_at(progress->schedule_step);
  report.grad_norm = clip.grad_norm;
  report.clip_coef = clip.clip_coef;
  if (!clip.finite) {
    report.skipped = true;
    ++progress->skipped_steps;  // the trainer logs the skip (once, not per rank) from the report
  } else {
    if (clip.clipped()) scale_in_place(grad, optimizer.range().size(), clip.clip_coef);
    optimizer.step(report.lr, master, grad);
  }
  ++progress->schedule_step;
  return report;
}

StepReport clip_and_step(AdamW& optimizer, const LrSchedule& schedule, double max_grad_norm,
                         OptimizerProgress* progress, float* master, float* grad) {
  const GradClipResult clip =
      grad_clip_from_sum_of_squares(sum_of_squares_f64(grad, optimizer.range().size()), max_grad_norm);
  return apply_optimizer_step(optimizer, schedule, clip, progress, master, grad);
}

}  // namespace deltamoe
