// Test helper: runs a shell command line and returns its exit code, combined stdout/stderr and wall
// time; plus the command prefix that lets mpirun run as root in containers. Header-only, tests only.
#pragma once

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace deltamoe {

struct CommandResult {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

inline CommandResult run_command(const std::string& command_line) {
  CommandResult result;
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen((command_line + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// The deltamoe program under test (DELTAMOE_BINARY, set by ctest).
inline std::string deltamoe_binary() {
  const char* binary = std::getenv("DELTAMOE_BINARY");
  return binary ? binary : "deltamoe-binary-not-set";
}

// mpirun for tests: allowed as root (CI containers run as root) and with more ranks than cores.
inline std::string mpirun_prefix(int ranks) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np " + std::to_string(ranks);
}

}  // namespace deltamoe
