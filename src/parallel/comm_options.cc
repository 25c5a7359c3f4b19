// CommOptions defaults derived from the timeout, and their environment overrides.
#include "parallel/comm_options.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace deltamoe {
namespace {

double seconds_from_env(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  CHECK(end != text && *end == '\0' && std::isfinite(value) && value > 0, name, "='", text,
        "' is not a positive number of seconds");
  return value;
}

}  // namespace

double CommOptions::heartbeat_interval() const {
  return heartbeat_seconds > 0 ? heartbeat_seconds : std::min(5.0, timeout_seconds / 5);
}

double CommOptions::abort_grace() const {
  return abort_grace_seconds > 0 ? abort_grace_seconds : std::min(5.0, timeout_seconds / 2);
}

CommOptions CommOptions::from_env() {
  CommOptions options;
  options.timeout_seconds = seconds_from_env("DELTAMOE_COMM_TIMEOUT", options.timeout_seconds);
  options.rendezvous_timeout_seconds =
      seconds_from_env("DELTAMOE_RDZV_TIMEOUT", options.rendezvous_timeout_seconds);
  options.fault = FaultPlan::from_env();
  return options;
}

}  // namespace deltamoe
