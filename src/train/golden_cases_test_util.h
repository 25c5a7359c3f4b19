// The golden cases under tests/golden that the parity tests iterate: one folder per case with
// model/, inputs.safetensors and expected.safetensors (tools/golden/README.md), found from
// DELTAMOE_SOURCE_DIR (the repository root; "." when unset), in name order.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace deltamoe::golden_test {

inline std::string golden_dir() {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  return (std::filesystem::path(source != nullptr ? source : ".") / "tests" / "golden").string();
}

inline std::vector<std::filesystem::path> golden_cases() {
  namespace fs = std::filesystem;
  std::vector<fs::path> cases;
  if (!fs::is_directory(golden_dir())) return cases;
  for (const auto& entry : fs::directory_iterator(golden_dir())) {
    const fs::path dir = entry.path();
    if (fs::exists(dir / "expected.safetensors") && fs::exists(dir / "inputs.safetensors") &&
        fs::is_directory(dir / "model"))
      cases.push_back(dir);
  }
  std::sort(cases.begin(), cases.end());
  return cases;
}

}  // namespace deltamoe::golden_test
