// Graceful stop on SIGTERM / SIGINT / SIGHUP (cluster preemption, Ctrl-C, a closed terminal or ssh
// session): the trainer finishes the step in flight, saves a checkpoint and returns; a second
// SIGINT ends the process at once.
#pragma once

#include <csignal>

namespace deltamoe {

// Installs the handlers for its lifetime and restores the previous ones afterwards.
class StopSignalGuard {
 public:
  StopSignalGuard();
  ~StopSignalGuard();
  StopSignalGuard(const StopSignalGuard&) = delete;
  StopSignalGuard& operator=(const StopSignalGuard&) = delete;

  // The signal received (SIGTERM, SIGINT or SIGHUP), or 0.
  static int stop_signal();

 private:
  struct sigaction previous_term_ {};
  struct sigaction previous_int_ {};
  struct sigaction previous_hup_ {};
};

}  // namespace deltamoe
