// SIGTERM / SIGINT / SIGHUP handlers that only record the request (async-signal-safe).
#include "train/stop_signal.h"

namespace deltamoe {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int signal) {
  g_stop_signal = signal;
  // A second Ctrl-C should not wait for the step to finish.
  if (signal == SIGINT) std::signal(SIGINT, SIG_DFL);
}

}  // namespace

StopSignalGuard::StopSignalGuard() {
  g_stop_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, &previous_term_);
  sigaction(SIGINT, &action, &previous_int_);
  sigaction(SIGHUP, &action, &previous_hup_);
}

StopSignalGuard::~StopSignalGuard() {
  sigaction(SIGTERM, &previous_term_, nullptr);
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGHUP, &previous_hup_, nullptr);
}

int StopSignalGuard::stop_signal() { return g_stop_signal; }

}  // namespace deltamoe
