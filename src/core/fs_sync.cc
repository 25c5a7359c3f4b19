// fsync_path / fsync_tree over open(O_RDONLY) descriptors (directories included, as POSIX allows).
#include "core/fs_sync.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

std::function<void(const std::string&)>& observer() {
  static std::function<void(const std::string&)> hook;
  return hook;
}

}  // namespace

void set_fsync_observer(std::function<void(const std::string&)> hook) { observer() = std::move(hook); }

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0, "cannot open ", path, " to sync it to disk: ", std::strerror(errno));
  int result;
  do {
    result = ::fsync(fd);
  } while (result != 0 && errno == EINTR);
  const int error = errno;
  ::close(fd);
  // EINVAL: a file system without fsync (some FUSE mounts); nothing more can be done there.
  CHECK(result == 0 || error == EINVAL, "syncing ", path, " to disk failed: ", std::strerror(error),
        " (disk full or failing?)");
  if (observer()) observer()(path);
}

void fsync_tree(const std::string& dir) {
  std::vector<std::string> dirs;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_directory()) {
      dirs.push_back(entry.path().string());
    } else if (entry.is_regular_file()) {
      fsync_path(entry.path().string());
    }
  }
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) fsync_path(*it);
  fsync_path(dir);
}

}  // namespace deltamoe
