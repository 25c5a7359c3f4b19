// TensorBoard scalars, the progress line's context and the end-of-run plot (see run_records.h).
#include "train/run_records.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "core/log.h"
#include "train/training_plot.h"

namespace deltamoe {

namespace fs = std::filesystem;

RunRecords::RunRecords(const TrainOptions& options, double steps_per_epoch)
    : output_dir_(options.output_dir), steps_per_epoch_(steps_per_epoch), plot_(options.plot) {
  if (std::find(options.report_to.begin(), options.report_to.end(), "tensorboard") != options.report_to.end()) {
    tensorboard_dir_ = options.logging_dir.empty() ? (fs::path(options.output_dir) / "runs").string() : options.logging_dir;
    tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir_);
    log_info("train: TensorBoard events in ", tensorboard_->path(), " (tensorboard --logdir ", tensorboard_dir_, ")");
  }
}

double RunRecords::epoch_of(const StepMetrics& step) const {
  return steps_per_epoch_ > 0 ? static_cast<double>(step.step) / steps_per_epoch_ : static_cast<double>(step.epoch);
}

void RunRecords::on_step(const StepMetrics& step) {
  if (!tensorboard_) return;
  // transformers' Trainer names, so dashboards made for ms-swift runs show these too.
  tensorboard_->add_scalar("train/loss", step.loss, step.step);
  tensorboard_->add_scalar("train/ce_loss", step.ce_loss, step.step);
  tensorboard_->add_scalar("train/aux_loss", step.aux_loss, step.step);
  tensorboard_->add_scalar("train/learning_rate", step.lr, step.step);
  tensorboard_->add_scalar("train/grad_norm", step.grad_norm, step.step);
  if (step.token_acc >= 0) tensorboard_->add_scalar("train/token_acc", step.token_acc, step.step);
  tensorboard_->add_scalar("train/tokens_per_s", step.tokens_per_s, step.step);
  tensorboard_->add_scalar("train/epoch", epoch_of(step), step.step);
  if (step.mfu >= 0) tensorboard_->add_scalar("train/mfu", step.mfu, step.step);
  if (step.peak_mem_gib >= 0) tensorboard_->add_scalar("train/peak_mem_gib", step.peak_mem_gib, step.step);
}

void RunRecords::on_eval(int64_t step, double val_loss, double token_acc) {
  if (!tensorboard_) return;
  tensorboard_->add_scalar("eval/loss", val_loss, step);
  if (token_acc >= 0) tensorboard_->add_scalar("eval/token_acc", token_acc, step);
}

std::string RunRecords::progress_line(const StepMetrics& step) const {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char clock[16];
  std::strftime(clock, sizeof(clock), "%H:%M:%S", &local);
  char epoch[32];
  std::snprintf(epoch, sizeof(epoch), "%.2f", epoch_of(step));
  return str_cat("[", clock, "] ", format_progress_line(step), " | epoch ", epoch, " | elapsed ",
                 format_duration(step.elapsed_s));
}

void RunRecords::finish() {
  if (!plot_) return;
  const std::string png = (fs::path(output_dir_) / "images" / "training.png").string();
  try {
    if (write_training_plot((fs::path(output_dir_) / "metrics.jsonl").string(), png)) log_info("train: plot ", png);
  } catch (const std::exception& error) {
    log_warn("train: the plot could not be written: ", error.what());
  }
}

}  // namespace deltamoe
