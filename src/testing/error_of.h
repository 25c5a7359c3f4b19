// Test helper: runs an action and returns the message of the deltamoe::Error it throws, or "" when
// it throws none, so that a test can check what an error says. Header-only, tests only.
#pragma once

#include <functional>
#include <string>

#include "core/error.h"

namespace deltamoe {

inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

}  // namespace deltamoe
