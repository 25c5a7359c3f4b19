// Divergence detection: counts training steps in a row whose loss or gradient norm is NaN/Inf.
// Such a step's update is skipped by the optimizer; a few in a row mean the run has diverged (or
// its weights already hold Inf), and saving would only overwrite the last good checkpoint.
#pragma once

#include <cstdint>
#include <string>

namespace deltamoe {

class NonFiniteStreak {
 public:
  // limit: steps in a row that stop the run (--max_nonfinite_steps); 0 never stops.
  explicit NonFiniteStreak(int64_t limit);

  // Records one step (its total loss and gradient norm before clipping). Returns true when the
  // run must stop: this step made `limit` non-finite steps in a row.
  bool record(int64_t step, double loss, double grad_norm);

  // The last recorded step was non-finite: no checkpoint should be written now.
  bool in_streak() const { return length_ > 0; }
  int64_t length() const { return length_; }

  // Why the run stops (after record returned true) / why a save was refused, for the error.
  std::string stop_message() const;
  std::string refused_save_message() const;

 private:
  int64_t limit_;
  int64_t length_ = 0;
  int64_t first_step_ = 0;  // first step of the current streak
  int64_t last_step_ = 0;
  double last_loss_ = 0, last_grad_norm_ = 0;
};

}  // namespace deltamoe
