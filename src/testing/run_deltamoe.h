// Test helper: runs the built `deltamoe` program (path in DELTAMOE_BINARY, set by ctest) with a
// command line and returns its exit code and combined stdout/stderr (run_command.h). Header-only,
// tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "testing/run_command.h"

namespace deltamoe {

// Whether DELTAMOE_BINARY is set (ctest sets it); a test failure saying so where it is not.
inline bool deltamoe_binary_set() {
  const bool set = std::getenv("DELTAMOE_BINARY") != nullptr;
  EXPECT_TRUE(set) << "DELTAMOE_BINARY is not set (run through ctest)";
  return set;
}

inline CommandResult run_deltamoe(const std::string& args) {
  if (!deltamoe_binary_set()) return {};
  return run_command(deltamoe_binary() + " " + args);
}

}  // namespace deltamoe
