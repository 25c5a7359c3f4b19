// Reads DELTAMOE_KILL_AT on every call (a getenv per save phase costs nothing).
#include "core/kill_point.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

namespace deltamoe {
namespace {

// Calls so far of each point that DELTAMOE_KILL_AT named (for <point>#<n>).
int64_t count_call(const std::string& point) {
  static std::mutex mutex;
  static std::map<std::string, int64_t> calls;
  std::lock_guard lock(mutex);
  return ++calls[point];
}

}  // namespace

void kill_point(const char* point, int64_t step) {
  const char* spec = std::getenv("DELTAMOE_KILL_AT");
  if (spec == nullptr) return;
  const std::string text = spec;
  const size_t at = text.find_first_of("@#");
  if (text.substr(0, at) != point) return;
  if (at != std::string::npos) {
    const int64_t wanted = std::atoll(text.c_str() + at + 1);
    if (text[at] == '@' && wanted != step) return;
    if (text[at] == '#' && count_call(point) != wanted) return;
  }
  std::fprintf(stderr, "DELTAMOE_KILL_AT=%s: killing the process (SIGKILL)\n", spec);
  std::fflush(nullptr);
  ::kill(::getpid(), SIGKILL);
  ::pause();
}

}  // namespace deltamoe
