// Rank failures (kill, hang, stop, early exit; docs/parallel.md, "Failure behaviour and its variables") in
// 4-rank TcpComm jobs under `deltamoe launch`, injected with DELTAMOE_FAULT and a 2 s deadline: every rank
// exits non-zero within the deadline (plus the abort grace for a hang) with a message naming the rank at
// fault and what it was doing.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "parallel/world.h"
#include "testing/run_command.h"

namespace deltamoe {
namespace {

constexpr double kDeadline = 2.0;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

CommandResult run_with_fault(const std::string& fault) {
  return run_command(str_cat("DELTAMOE_COMM_TIMEOUT=", kDeadline, " DELTAMOE_FAULT='", fault, "' ", deltamoe_binary(),
                             " launch --nproc_per_node 4 --grace_period 3 -- comm-selftest --rounds 6"));
}

// Each rank in `ranks` logged that the job was aborted with a message containing `part`.
void expect_aborted_with(const CommandResult& run, std::initializer_list<int> ranks, const std::string& part) {
  for (int r : ranks) {
    const std::string prefix = str_cat("rank ", r, ": job aborted: ");
    const size_t at = run.output.find(prefix);
    ASSERT_NE(at, std::string::npos) << "rank " << r << " did not report the abort:\n" << run.output;
    const std::string line = run.output.substr(at, run.output.find('\n', at) - at);
    EXPECT_TRUE(contains(line, part)) << line;
  }
}

TEST(LaunchFault, KilledRankEndsTheJobAtOnceNamingIt) {
  const CommandResult run = run_with_fault("rank:1,at:round 3,kind:kill");
  EXPECT_EQ(run.exit_code, 128 + 9) << run.output;
  EXPECT_LT(run.seconds, kDeadline + 3) << run.output;
  expect_aborted_with(run, {0, 2, 3}, "rank 1 (pid ");
  expect_aborted_with(run, {0, 2, 3}, "closed its control connection without saying goodbye");
  expect_aborted_with(run, {0, 2, 3}, "label 'round 3'");
  EXPECT_TRUE(contains(run.output, "the job failed because of rank 1, which was killed by signal 9")) << run.output;
  for (int r : {0, 2, 3}) EXPECT_TRUE(contains(run.output, str_cat("rank ", r, " exited with code 75"))) << run.output;
}

TEST(LaunchFault, HangingRankIsAbortedAtTheDeadlineNamingIt) {
  const CommandResult run = run_with_fault("rank:1,at:round 3,kind:hang");
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_GE(run.seconds, kDeadline) << run.output;
  EXPECT_LT(run.seconds, kDeadline + 4) << run.output;
  expect_aborted_with(run, {0, 1, 2, 3}, "held up by rank 1 (pid ");
  expect_aborted_with(run, {0, 1, 2, 3}, "which was outside communication");
  expect_aborted_with(run, {0, 1, 2, 3}, "label 'round 3'");
  // Its main thread sleeps, so its control plane ends it after the grace, marked as the one at fault.
  EXPECT_TRUE(contains(run.output, "rank 1 exited with code 76 (named at fault")) << run.output;
  EXPECT_TRUE(contains(run.output, "the job failed because of rank 1")) << run.output;
  EXPECT_EQ(run.exit_code, 76) << run.output;
}

TEST(LaunchFault, KilledRankZeroEndsTheJob) {
  const CommandResult run = run_with_fault("rank:0,at:round 2,kind:kill");
  EXPECT_EQ(run.exit_code, 128 + 9) << run.output;
  EXPECT_LT(run.seconds, kDeadline + 3) << run.output;
  expect_aborted_with(run, {1, 2, 3}, "rank 0 (pid ");
  expect_aborted_with(run, {1, 2, 3}, "closed the control connection");
}

TEST(LaunchFault, StoppedRankIsFoundByItsSilence) {
  const CommandResult run = run_with_fault("rank:2,at:round 2,kind:stop");
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_LT(run.seconds, kDeadline + 7) << run.output;  // + the launcher's grace, then SIGTERM after SIGCONT
  expect_aborted_with(run, {0, 1, 3}, "rank 2 (pid ");
  expect_aborted_with(run, {0, 1, 3}, "label 'round 2'");
  EXPECT_TRUE(contains(run.output, "the job failed because of rank 2")) << run.output;
}

TEST(LaunchFault, ExitingRankIsNamedWithItsExitCode) {
  const CommandResult run = run_with_fault("rank:3,at:round 4,kind:exit");
  EXPECT_EQ(run.exit_code, 3) << run.output;
  EXPECT_LT(run.seconds, kDeadline + 3) << run.output;
  expect_aborted_with(run, {0, 1, 2}, "rank 3 (pid ");
  expect_aborted_with(run, {0, 1, 2}, "label 'round 4'");
  EXPECT_TRUE(contains(run.output, "the job failed because of rank 3, which exited with code 3")) << run.output;
}

// MpiComm under mpirun: a hanging rank makes the others abort at the deadline (MPI_Abort ends them
// all); MPI gives no view of the stuck rank's activity, so the message names whom they waited for.
TEST(LaunchFault, MpiHangingRankIsAbortedAtTheDeadline) {
  if (!mpi_built()) GTEST_SKIP() << "built without MPI (CMake option DELTAMOE_MPI=OFF or no MPI found): MpiComm is not in this build";
  const CommandResult run = run_command(str_cat("DELTAMOE_COMM_TIMEOUT=", kDeadline, " DELTAMOE_FAULT='rank:1,at:round 2,kind:hang' ",
                                                mpirun_prefix(2), " -x DELTAMOE_COMM_TIMEOUT -x DELTAMOE_FAULT ",
                                                deltamoe_binary(), " comm-selftest --backend mpi"));
  EXPECT_EQ(run.exit_code, 75) << run.output;
  EXPECT_LT(run.seconds, kDeadline + 4) << run.output;
  expect_aborted_with(run, {0}, "rank 0 waited ");
  expect_aborted_with(run, {0}, " for rank(s) 1 with no data moving");
  expect_aborted_with(run, {0}, "label 'round 2'");
}

TEST(LaunchFault, MalformedFaultVariableIsRefused) {
  const CommandResult run = run_command("DELTAMOE_FAULT='rank:1,kind:melt' " + deltamoe_binary() + " comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "kind 'melt' is not one of kill, exit, hang, stop, term")) << run.output;
}

}  // namespace
}  // namespace deltamoe
