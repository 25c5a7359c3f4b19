// Versioned run folders (see run_folder.h).
#include "train/run_folder.h"

#include <ctime>
#include <filesystem>

#include "core/error.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

// N of a "vN-..." folder name, or -1.
int64_t version_of(const std::string& name) {
  if (name.size() < 3 || name[0] != 'v') return -1;
  int64_t value = 0;
  size_t i = 1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) value = value * 10 + (name[i] - '0');
  return i > 1 && i < name.size() && name[i] == '-' ? value : -1;
}

}  // namespace

std::string new_version_dir(const std::string& output_dir) {
  int64_t next = 0;
  if (fs::is_directory(output_dir)) {
    for (const auto& entry : fs::directory_iterator(output_dir)) {
      if (entry.is_directory()) next = std::max(next, version_of(entry.path().filename().string()) + 1);
    }
  }
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &local);
  return (fs::path(output_dir) / str_cat("v", next, "-", stamp)).string();
}

std::string newest_version_dir_with_checkpoint(const std::string& output_dir) {
  std::string best;
  int64_t best_version = -1;
  if (!fs::is_directory(output_dir)) return best;
  for (const auto& entry : fs::directory_iterator(output_dir)) {
    const int64_t version = version_of(entry.path().filename().string());
    if (version <= best_version || !entry.is_directory()) continue;
    bool has_checkpoint = false;
    for (const auto& inner : fs::directory_iterator(entry.path())) {
      has_checkpoint = has_checkpoint || inner.path().filename().string().starts_with("checkpoint-");
    }
    if (has_checkpoint) {
      best = entry.path().string();
      best_version = version;
    }
  }
  return best;
}

}  // namespace deltamoe
