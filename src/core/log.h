// Minimal levelled logging to stderr: log_info(parts...), log_warn, log_error, log_debug.
// The level comes from DELTAMOE_LOG (debug|info|warn|error), default info.
#pragma once

#include <string>

#include "core/error.h"

namespace deltamoe {

enum class LogLevel { debug = 0, info = 1, warn = 2, error = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);
void log_write(LogLevel level, const std::string& message);

template <typename... Args>
void log_debug(Args&&... args) {
  if (log_level() <= LogLevel::debug) log_write(LogLevel::debug, str_cat(std::forward<Args>(args)...));
}
template <typename... Args>
void log_info(Args&&... args) {
  if (log_level() <= LogLevel::info) log_write(LogLevel::info, str_cat(std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(Args&&... args) {
  if (log_level() <= LogLevel::warn) log_write(LogLevel::warn, str_cat(std::forward<Args>(args)...));
}
template <typename... Args>
void log_error(Args&&... args) {
  log_write(LogLevel::error, str_cat(std::forward<Args>(args)...));
}

}  // namespace deltamoe
