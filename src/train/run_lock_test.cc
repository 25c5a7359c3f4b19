// One run per output folder: a second lock on the folder fails naming the holder's pid, the lock
// goes with its owner (also when the owner is killed), and a fresh run refuses a folder holding an
// earlier run unless told to overwrite it.
#include "train/run_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "testing/error_of.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_run_lock_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

TEST(RunLock, ASecondLockOnTheFolderFailsNamingTheHolder) {
  const fs::path dir = fresh_dir("second");
  {
    const RunLock first(dir.string());
    EXPECT_TRUE(fs::is_directory(dir));
    const std::string message = error_of([&] { RunLock second(dir.string()); });
    EXPECT_NE(message.find("is in use by another training run (pid " + std::to_string(::getpid()) + ")"),
              std::string::npos)
        << message;
  }
  EXPECT_NO_THROW(RunLock again(dir.string())) << "the lock outlived its owner";
  fs::remove_all(dir);
}

// The kernel releases the lock of a killed process: a crashed run never blocks its resume.
TEST(RunLock, AKilledOwnerDoesNotKeepTheLock) {
  const fs::path dir = fresh_dir("killed");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    const RunLock lock(dir.string());
    const char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  EXPECT_NE(error_of([&] { RunLock busy(dir.string()); }).find("in use by another training run"), std::string::npos);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_NO_THROW(RunLock after(dir.string()));
  fs::remove_all(dir);
}

TEST(RunLock, AFreshRunRefusesAnEarlierRunUnlessOverwriting) {
  const fs::path dir = fresh_dir("fresh");
  fs::create_directories(dir / "checkpoint-4");
  fs::create_directories(dir / ".checkpoint-6.tmp");
  std::ofstream(dir / "metrics.jsonl") << "{\"type\": \"train\", \"step\": 1}\n";
  std::ofstream(dir / "notes.txt") << "the user's own file\n";
  const std::string message = error_of([&] { prepare_fresh_output_dir(dir.string(), false); });
  EXPECT_NE(message.find("holds an earlier run ("), std::string::npos) << message;
  EXPECT_NE(message.find("checkpoint-4"), std::string::npos) << message;
  EXPECT_NE(message.find("--overwrite_output_dir true"), std::string::npos) << message;
  EXPECT_TRUE(fs::exists(dir / "metrics.jsonl"));
  prepare_fresh_output_dir(dir.string(), true);
  EXPECT_FALSE(fs::exists(dir / "checkpoint-4"));
  EXPECT_FALSE(fs::exists(dir / ".checkpoint-6.tmp"));
  EXPECT_FALSE(fs::exists(dir / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(dir / "notes.txt")) << "only the run's own files go";
  // An empty metrics file (a run that stopped before its first step) is no history.
  std::ofstream(dir / "metrics.jsonl").close();
  EXPECT_NO_THROW(prepare_fresh_output_dir(dir.string(), false));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace deltamoe
