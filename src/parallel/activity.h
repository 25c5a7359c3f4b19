// What one rank is doing, for the messages of a failed or stuck job: the caller's label ("step 3:
// layer 17 dispatch") and the communication operation in flight or last finished. One object per
// rank, shared by all its communicators; read by the control plane's heartbeat thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "parallel/fault_injection.h"

namespace deltamoe {

class RankActivity {
 public:
  explicit RankActivity(int world_rank) : world_rank_(world_rank) {}

  int world_rank() const { return world_rank_; }

  // The caller's description of the current phase; kept until replaced.
  void set_label(std::string label);
  std::string label() const;

  // Start / end of a communication operation described as "all_reduce #12 on 'world' (1024 x f32,
  // sum)". Returns the rank's operation number (1, 2, ... over all its communicators).
  uint64_t begin_op(std::string description);
  void end_op();
  uint64_t op_count() const;
  // Whether the rank is inside a communication operation (then it is waiting on others, not busy).
  bool in_op() const;

  // "in all_reduce #12 on 'world' (1024 x f32, sum) for 2.1 s, label 'step 3'" or
  // "outside communication for 0.4 s since all_reduce #12 on 'world' ..., label 'step 3'".
  std::string describe() const;

  // Arms fault injection (process-per-rank backends only); fires in begin_op / set_label.
  void arm_fault(const FaultPlan& plan);
  // Called whenever the label changes (the TCP control plane forwards it to rank 0 at once).
  void on_label_change(std::function<void()> callback);

 private:
  using Clock = std::chrono::steady_clock;
  const int world_rank_;
  mutable std::mutex mutex_;
  std::string label_;
  std::string op_description_;  // current or last operation
  bool in_op_ = false;
  uint64_t op_count_ = 0;
  Clock::time_point since_ = Clock::now();
  std::optional<FaultPlan> fault_;
  std::function<void()> label_callback_;
};

}  // namespace deltamoe
