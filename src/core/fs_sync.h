// fsync for files and directories, so that a checkpoint renamed into place survives a power loss
// or kernel crash: the data of every file is on disk before the rename, and the rename itself
// (a directory entry) is on disk after it.
#pragma once

#include <functional>
#include <string>

namespace deltamoe {

// fsync of one file or directory; throws naming the path when it cannot be opened or synced.
void fsync_path(const std::string& path);

// fsync of every regular file under dir (recursively), then of each directory, dir last.
void fsync_tree(const std::string& dir);

// Test hook: called with every path fsync_path syncs (nullptr: none). Not thread safe to change.
void set_fsync_observer(std::function<void(const std::string&)> observer);

}  // namespace deltamoe
