// What a run reports: the one-line progress (step/total, loss, lr, grad norm, tokens/s, ETA), one
// JSON object per line in output_dir/metrics.jsonl, and the summary at the end.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace deltamoe {

struct StepMetrics {
  int64_t step = 0;  // 1-based: steps done after this one
  int64_t total_steps = 0;
  int64_t epoch = 0;
  double loss = 0;      // ce_loss + weighted aux loss
  double ce_loss = 0;   // token mean over the global batch
  double aux_loss = 0;  // coefficient * mean aux over micro-batches
  double lr = 0;
  double grad_norm = 0;
  double token_acc = -1;  // supervised tokens predicted right (teacher forcing); -1: not computed
  bool skipped = false;
  int64_t num_tokens = 0;
  int64_t num_supervised = 0;
  double step_s = 0;
  double tokens_per_s = 0;
  double eta_s = 0;
  double elapsed_s = 0;
};

// "step 12/100 | loss 3.2104 | acc 0.412 | lr 9.51e-05 | grad_norm 1.234 | 2.1k tok/s | 0.41 s/step | ETA 36s"
// (acc: token accuracy of the step's supervised tokens, when the engine reports it).
std::string format_progress_line(const StepMetrics& metrics);
// "1h02m", "3m05s", "12s".
std::string format_duration(double seconds);

// Appends JSON lines to a file (kept open; flushed after every line so a crash loses nothing).
class MetricsLog {
 public:
  // keep_up_to_step < 0: start a new file. Otherwise (a resumed run) keep the earlier lines of
  // steps <= keep_up_to_step and drop later ones, which a run killed after its last checkpoint
  // wrote and the resumed run is about to write again.
  MetricsLog(const std::string& path, int64_t keep_up_to_step);
  void write_step(const StepMetrics& metrics);
  // token_acc < 0 is written as null.
  void write_eval(int64_t step, double val_loss, double token_acc, int64_t num_supervised);
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& line);
  std::string path_;
  std::ofstream out_;
};

}  // namespace deltamoe
