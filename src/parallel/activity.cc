// RankActivity: label and operation bookkeeping, and the fault-injection trigger points.
#include "parallel/activity.h"

#include <cstdio>

#include "core/error.h"

namespace deltamoe {

void RankActivity::set_label(std::string label) {
  std::function<void()> callback;
  bool fire = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (label == label_) return;
    label_ = std::move(label);
    callback = label_callback_;
    fire = fault_ && fault_->at_op == 0 && fault_->at_label == label_;
  }
  if (callback) callback();
  if (fire) inject_fault(*fault_, str_cat("label '", fault_->at_label, "'"));
}

std::string RankActivity::label() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return label_;
}

uint64_t RankActivity::begin_op(std::string description) {
  uint64_t number;
  bool fire = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    number = ++op_count_;
    op_description_ = std::move(description);
    in_op_ = true;
    since_ = Clock::now();
    fire = fault_ && fault_->at_op == number;
  }
  if (fire) inject_fault(*fault_, str_cat("operation #", number, ": ", op_description_));
  return number;
}

void RankActivity::end_op() {
  std::lock_guard<std::mutex> lock(mutex_);
  in_op_ = false;
  since_ = Clock::now();
}

uint64_t RankActivity::op_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return op_count_;
}

bool RankActivity::in_op() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_op_;
}

std::string RankActivity::describe() const {
  std::lock_guard<std::mutex> lock(mutex_);
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f s",
                std::chrono::duration<double>(Clock::now() - since_).count());
  std::string text;
  if (in_op_) {
    text = str_cat("in ", op_description_, " for ", seconds);
  } else if (op_count_ == 0) {
    text = str_cat("outside communication for ", seconds, " (no operation yet)");
  } else {
    text = str_cat("outside communication for ", seconds, " since ", op_description_);
  }
  if (!label_.empty()) text += str_cat(", label '", label_, "'");
  return text;
}

void RankActivity::arm_fault(const FaultPlan& plan) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (plan.rank == world_rank_) fault_ = plan;
}

void RankActivity::on_label_change(std::function<void()> callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  label_callback_ = std::move(callback);
}

}  // namespace deltamoe
