// ms-swift's run folders: with --add_version each fresh run writes into OUTPUT_DIR/vN-YYYYMMDD-HHMMSS
// (N one more than the highest there), so two runs never share a folder; --resume auto continues
// the newest one that holds a checkpoint.
#pragma once

#include <string>

namespace deltamoe {

// "OUTPUT_DIR/vN-YYYYMMDD-HHMMSS" for a new run (the folder is not created).
std::string new_version_dir(const std::string& output_dir);

// The vN-* folder of output_dir with the highest N that holds a checkpoint-* folder, or "" when
// none does.
std::string newest_version_dir_with_checkpoint(const std::string& output_dir);

}  // namespace deltamoe
