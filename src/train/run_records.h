// What a run leaves for people besides checkpoints and metrics.jsonl: TensorBoard event files
// (--report_to tensorboard), the progress line's wall-clock time, epoch and elapsed time, and the
// PNG plot of the whole run at its end. The trainer calls it at each step, evaluation and the end.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "train/tensorboard_writer.h"
#include "train/train_metrics.h"
#include "train/train_options.h"

namespace deltamoe {

class RunRecords {
 public:
  // steps_per_epoch: optimizer steps in one pass over the data (0: unknown; the epoch is then the
  // pipeline's whole-epoch count).
  RunRecords(const TrainOptions& options, double steps_per_epoch);

  void on_step(const StepMetrics& step);
  void on_eval(int64_t step, double val_loss, double token_acc);
  // "[14:03:05] step 12/100 | loss ... | ETA 36s | epoch 0.42 | elapsed 3m05s".
  std::string progress_line(const StepMetrics& step) const;
  // Writes OUTPUT_DIR/images/training.png from metrics.jsonl (a failure to draw is logged, not thrown:
  // the run itself is done).
  void finish();

  const std::string& tensorboard_dir() const { return tensorboard_dir_; }

 private:
  double epoch_of(const StepMetrics& step) const;

  std::string output_dir_;
  std::string tensorboard_dir_;
  double steps_per_epoch_ = 0;
  bool plot_ = true;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace deltamoe
