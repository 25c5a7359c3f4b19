// The streak counter and its messages.
#include "train/nonfinite_streak.h"

#include <cmath>

#include "core/error.h"

namespace deltamoe {

NonFiniteStreak::NonFiniteStreak(int64_t limit) : limit_(limit) {
  CHECK(limit >= 0, "--max_nonfinite_steps must be >= 0, got ", limit);
}

bool NonFiniteStreak::record(int64_t step, double loss, double grad_norm) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) {
    length_ = 0;
    return false;
  }
  if (length_ == 0) first_step_ = step;
  ++length_;
  last_step_ = step;
  last_loss_ = loss;
  last_grad_norm_ = grad_norm;
  return limit_ > 0 && length_ >= limit_;
}

std::string NonFiniteStreak::stop_message() const {
  return str_cat("training diverged: steps ", first_step_, "..", last_step_, " (", length_,
                 " in a row, --max_nonfinite_steps ", limit_, ") had a non-finite loss or gradient norm (last: loss ",
                 last_loss_, ", grad_norm ", last_grad_norm_, "); stopped without saving, so the newest checkpoint is ",
                 "the last good one. Lower --lr, check --max_grad_norm and the data, then --resume auto");
}

std::string NonFiniteStreak::refused_save_message() const {
  return str_cat("not saving at step ", last_step_, ": the last ", length_,
                 " step(s) had a non-finite loss or gradient norm (last: loss ", last_loss_, ", grad_norm ",
                 last_grad_norm_, "), so the weights may be damaged; the newest checkpoint is the last good one");
}

}  // namespace deltamoe
