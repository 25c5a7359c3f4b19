// One conformance suite for every host communicator backend: run_comm_selftest (each collective
// compared bitwise with the rank-ordered loop) at several world sizes, and the job checksum equal
// across backends. TcpComm runs its ranks as threads of this process over loopback sockets;
// The process backends run `deltamoe comm-selftest` (the same checks) in separate processes:
// TcpComm through `deltamoe launch`, MpiComm through mpirun (built with MPI only).
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <regex>
#include <string>

#include "parallel/comm_selftest.h"
#include "parallel/tcp_test_util.h"
#include "parallel/thread_comm.h"
#include "parallel/world.h"
#include "testing/run_command.h"

namespace deltamoe {
namespace {

class ThreadConformance : public ::testing::TestWithParam<int> {};

TEST_P(ThreadConformance, SelftestPassesOnEveryRankWithOneChecksum) {
  const int ranks = GetParam();
  std::mutex mutex;
  std::vector<SelftestResult> results(ranks);
  run_thread_comm(ranks, [&](Communicator& comm) {
    SelftestResult result = run_comm_selftest(comm);
    std::lock_guard<std::mutex> lock(mutex);
    results[comm.rank()] = result;
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_GT(results[r].checks, 20) << "rank " << r;
    EXPECT_EQ(results[r].checksum, results[0].checksum) << "rank " << r;
  }
  EXPECT_EQ(results[0].checksum, thread_comm_selftest_checksum(ranks));
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThreadConformance, ::testing::Values(1, 2, 3, 4, 5));

class TcpConformance : public ::testing::TestWithParam<int> {};

TEST_P(TcpConformance, SelftestPassesWithTheThreadCommChecksum) {
  const int ranks = GetParam();
  std::mutex mutex;
  std::vector<SelftestResult> results(ranks);
  const std::vector<std::string> errors = run_tcp_threads(ranks, [&](Communicator& comm) {
    EXPECT_EQ(comm.backend(), "tcp");
    SelftestResult result = run_comm_selftest(comm);
    std::lock_guard<std::mutex> lock(mutex);
    results[comm.rank()] = result;
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(results[r].checksum, thread_comm_selftest_checksum(ranks)) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpConformance, ::testing::Values(1, 2, 3, 4));

// The "job checksum <hex>" that rank 0 of `deltamoe comm-selftest` prints.
uint64_t printed_checksum(const std::string& output) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex("job checksum ([0-9a-f]+)"))) return 0;
  return std::stoull(match[1].str(), nullptr, 16);
}

class ProcessConformance : public ::testing::TestWithParam<int> {};

TEST_P(ProcessConformance, TcpCommInProcessesMatchesThreadComm) {
  const int ranks = GetParam();
  const CommandResult run = run_command(str_cat(deltamoe_binary(), " launch --nproc_per_node ", ranks,
                                                " -- comm-selftest --backend tcp"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(str_cat("on ", ranks, " ranks (tcp)")), std::string::npos) << run.output;
  EXPECT_EQ(printed_checksum(run.output), thread_comm_selftest_checksum(ranks)) << run.output;
}

TEST_P(ProcessConformance, MpiCommUnderMpirunMatchesThreadComm) {
  if (!mpi_built()) {
    GTEST_SKIP() << "built without MPI (CMake option DELTAMOE_MPI=OFF or no MPI found): MpiComm is not in this build";
  }
  const int ranks = GetParam();
  const CommandResult run =
      run_command(str_cat(mpirun_prefix(ranks), " ", deltamoe_binary(), " comm-selftest --backend mpi"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(str_cat("on ", ranks, " ranks (mpi)")), std::string::npos) << run.output;
  EXPECT_EQ(printed_checksum(run.output), thread_comm_selftest_checksum(ranks)) << run.output;
}

INSTANTIATE_TEST_SUITE_P(Ranks, ProcessConformance, ::testing::Values(2, 3));

}  // namespace
}  // namespace deltamoe
