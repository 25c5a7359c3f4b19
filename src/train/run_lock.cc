// The output folder's lock file (flock) and the check for an earlier run's files.
#include "train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockFile = ".deltamoe_run.lock";

// The pid the holder wrote into the lock file ("" when unreadable).
std::string holder_of(int fd) {
  char text[32] = {};
  const ssize_t got = ::pread(fd, text, sizeof(text) - 1, 0);
  return got > 0 ? std::string(text, static_cast<size_t>(got)) : std::string();
}

// Names of an earlier run's files in output_dir.
std::vector<fs::path> earlier_run_files(const std::string& output_dir) {
  std::vector<fs::path> found;
  for (const fs::directory_entry& entry : fs::directory_iterator(output_dir)) {
    const std::string name = entry.path().filename().string();
    const bool checkpoint = name.starts_with("checkpoint-") || name.starts_with(".checkpoint-");
    const bool metrics = name == "metrics.jsonl" && entry.is_regular_file() && entry.file_size() > 0;
    if (checkpoint || metrics || name == "metrics.jsonl.tmp") found.push_back(entry.path());
  }
  return found;
}

}  // namespace

RunLock::RunLock(const std::string& output_dir) : path_((fs::path(output_dir) / kLockFile).string()) {
  fs::create_directories(output_dir);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  CHECK(fd_ >= 0, "--output_dir ", output_dir, ": cannot create the lock file ", path_, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = holder_of(fd_);
    ::close(fd_);
    fd_ = -1;
    CHECK(error == EWOULDBLOCK, "--output_dir ", output_dir, ": cannot lock ", path_, ": ", std::strerror(error));
    RAISE("--output_dir ", output_dir, " is in use by another training run",
          holder.empty() ? std::string() : str_cat(" (pid ", holder, ")"),
          "; two runs in one folder would overwrite each other's checkpoints and metrics. Wait for it to end, or "
          "give another --output_dir");
  }
  const std::string pid = std::to_string(::getpid());
  // Best effort: the pid only makes the message above more helpful.
  if (::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) log_debug("cannot write ", path_);
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the only descriptor releases the flock
}

void prepare_fresh_output_dir(const std::string& output_dir, bool overwrite) {
  const std::vector<fs::path> found = earlier_run_files(output_dir);
  if (found.empty()) return;
  if (!overwrite) {
    std::string names;
    for (size_t i = 0; i < found.size() && i < 5; ++i) names += (i ? ", " : "") + found[i].filename().string();
    if (found.size() > 5) names += str_cat(", ... (", found.size(), " in all)");
    RAISE("--output_dir ", output_dir, " holds an earlier run (", names, "); continue it with --resume auto, give a ",
          "new --output_dir, or pass --overwrite_output_dir true to delete it");
  }
  for (const fs::path& path : found) {
    log_warn("train: --overwrite_output_dir: removing ", path.string());
    fs::remove_all(path);
  }
}

}  // namespace deltamoe
