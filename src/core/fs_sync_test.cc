// fsync_tree syncs every file, then every folder bottom-up; a missing path is a clear error.
#include "core/fs_sync.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

TEST(FsSync, TreeSyncsFilesThenFoldersBottomUp) {
  const fs::path root = fs::temp_directory_path() / ("deltamoe_fs_sync_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "sub");
  std::ofstream(root / "a.txt") << "a";
  std::ofstream(root / "sub" / "b.txt") << "b";
  std::vector<std::string> synced;
  set_fsync_observer([&](const std::string& path) { synced.push_back(path); });
  fsync_tree(root.string());
  set_fsync_observer(nullptr);
  ASSERT_EQ(synced.size(), 4u);
  EXPECT_EQ(synced.back(), root.string());
  EXPECT_EQ(synced[2], (root / "sub").string());
  EXPECT_NE(std::find(synced.begin(), synced.end(), (root / "sub" / "b.txt").string()), synced.end());
  try {
    fsync_path((root / "missing").string());
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cannot open " + (root / "missing").string() + " to sync it"),
              std::string::npos)
        << error.what();
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace deltamoe
