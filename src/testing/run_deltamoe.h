// Test helper: runs the built `deltamoe` program (path in DELTAMOE_BINARY, set by ctest) with a
// command line and returns its exit code and combined stdout/stderr (run_command.h). Header-only,
// tests only.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "testing/run_command.h"

namespace deltamoe {

using RunResult = CommandResult;

inline RunResult run_deltamoe(const std::string& args) {
  EXPECT_NE(std::getenv("DELTAMOE_BINARY"), nullptr) << "DELTAMOE_BINARY is not set (run through ctest)";
  if (std::getenv("DELTAMOE_BINARY") == nullptr) return {};
  return run_command(deltamoe_binary() + " " + args);
}

}  // namespace deltamoe
