// Logging backend: one mutex-guarded write per message so lines from threads never interleave.
#include "core/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace deltamoe {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("DELTAMOE_LOG");
  if (env == nullptr) return LogLevel::info;
  if (std::strcmp(env, "debug") == 0) return LogLevel::debug;
  if (std::strcmp(env, "warn") == 0) return LogLevel::warn;
  if (std::strcmp(env, "error") == 0) return LogLevel::error;
  return LogLevel::info;
}

LogLevel g_level = level_from_env();
std::mutex g_mutex;

}  // namespace

LogLevel log_level() { return g_level; }
void set_log_level(LogLevel level) { g_level = level; }

void log_write(LogLevel level, const std::string& message) {
  static const char* kPrefix[] = {"[debug] ", "", "[warn] ", "[error] "};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%s%s\n", kPrefix[static_cast<int>(level)], message.c_str());
  std::fflush(stderr);
}

}  // namespace deltamoe
