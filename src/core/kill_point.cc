// Reads DELTAMOE_KILL_AT on every call (a getenv per save phase costs nothing).
#include "core/kill_point.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace deltamoe {

void kill_point(const char* point, int64_t step) {
  const char* spec = std::getenv("DELTAMOE_KILL_AT");
  if (spec == nullptr) return;
  const std::string text = spec;
  const size_t at = text.find('@');
  if (text.substr(0, at) != point) return;
  if (at != std::string::npos && std::atoll(text.c_str() + at + 1) != step) return;
  std::fprintf(stderr, "DELTAMOE_KILL_AT=%s: killing the process (SIGKILL)\n", spec);
  std::fflush(nullptr);
  ::kill(::getpid(), SIGKILL);
  ::pause();
}

}  // namespace deltamoe
