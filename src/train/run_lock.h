// One training run per output folder: an exclusive flock on OUTPUT_DIR/.deltamoe_run.lock for the
// run's lifetime, and the refusal of a fresh run into a folder that holds an earlier run's
// checkpoints or metrics. The kernel drops the lock when the process ends however it ends
// (kill -9 included), so a crashed run never blocks its own --resume.
#pragma once

#include <string>

namespace deltamoe {

class RunLock {
 public:
  // Creates output_dir if needed and locks it. Throws, naming the folder and the pid that holds
  // it, when another process (or another RunLock in this one) has it.
  explicit RunLock(const std::string& output_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// A fresh run (no --resume) must not mix with an earlier one: checkpoint-N folders (which
// --resume auto would pick up), unfinished saves and a non-empty metrics.jsonl are refused, or
// removed when `overwrite` (--overwrite_output_dir). Call while holding the RunLock.
void prepare_fresh_output_dir(const std::string& output_dir, bool overwrite);

}  // namespace deltamoe
