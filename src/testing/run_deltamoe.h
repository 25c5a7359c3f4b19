// Test helper: runs the built `deltamoe` program (path in DELTAMOE_BINARY, set by ctest) with a
// command line and returns its exit code and combined stdout/stderr. Header-only, tests only.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace deltamoe {

struct RunResult {
  int exit_code = -1;
  std::string output;
};

inline RunResult run_deltamoe(const std::string& args) {
  const char* binary = std::getenv("DELTAMOE_BINARY");
  EXPECT_NE(binary, nullptr) << "DELTAMOE_BINARY is not set (run through ctest)";
  RunResult result;
  if (binary == nullptr) return result;
  const std::string command = std::string(binary) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << command;
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

}  // namespace deltamoe
