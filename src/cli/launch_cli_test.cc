// `deltamoe launch`, NPROC_PER_NODE and the launchers users already have: torchrun (emulated, with
// its agent store holding MASTER_PORT), srun (emulated variables), mpirun with the tcp backend;
// signal forwarding, a failing rank, and bad command lines.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "parallel/socket_util.h"
#include "parallel/tcp_test_util.h"
#include "parallel/world.h"
#include "testing/run_command.h"

namespace deltamoe {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Launch, StartsTheRanksWithTorchrunVariables) {
  const CommandResult run = run_command(deltamoe_binary() + " launch --nproc_per_node 2 -- comm-selftest --rounds 2");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "comm-selftest: ok")) << run.output;
  EXPECT_TRUE(contains(run.output, "on 2 ranks (tcp)")) << run.output;
  EXPECT_TRUE(contains(run.output, "launched by torchrun/deltamoe launch")) << run.output;
  // Rank 0 took over the listener the launcher opened (no window in which the port could be lost).
  EXPECT_FALSE(contains(run.output, "DELTAMOE_RDZV_FD")) << run.output;
}

TEST(Launch, NprocPerNodeReexecutesThroughTheLauncher) {
  const CommandResult run = run_command("NPROC_PER_NODE=3 " + deltamoe_binary() + " comm-selftest --rounds 1");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "launch: 3 ranks on node 0 of 1")) << run.output;
  EXPECT_TRUE(contains(run.output, "on 3 ranks (tcp)")) << run.output;
  // A command that runs as one process ignores it, with a warning.
  const CommandResult single = run_command("NPROC_PER_NODE=2 " + deltamoe_binary() + " version");
  EXPECT_EQ(single.exit_code, 0) << single.output;
  EXPECT_TRUE(contains(single.output, "NPROC_PER_NODE=2 is ignored: 'deltamoe version' runs as one process"))
      << single.output;
}

// Two ranks started the way `torchrun --no-python --nproc_per_node 2 deltamoe comm-selftest` starts
// them, while a listener stands in for torchrun's agent store on MASTER_PORT.
TEST(Launch, UnderTorchrunTheRendezvousMovesOffTheAgentStorePort) {
  std::string error;
  Socket agent_store;
  int port = 0;
  for (int attempt = 0; attempt < 20 && port == 0; ++attempt) {
    agent_store = listen_tcp(0, &error);
    ASSERT_TRUE(agent_store.valid()) << error;
    const int candidate = local_port(agent_store.fd());
    Socket next = listen_tcp(candidate + 1, &error);  // MASTER_PORT+1 must be free for our rendezvous
    if (next.valid() && candidate < 65535) port = candidate;
  }
  ASSERT_NE(port, 0);
  std::string script;
  for (int rank = 0; rank < 2; ++rank) {
    script += str_cat("RANK=", rank, " WORLD_SIZE=2 LOCAL_RANK=", rank, " LOCAL_WORLD_SIZE=2 GROUP_RANK=0 ",
                      "ROLE_RANK=", rank, " MASTER_ADDR=127.0.0.1 MASTER_PORT=", port,
                      " TORCHELASTIC_USE_AGENT_STORE=True TORCHELASTIC_RUN_ID=none ", deltamoe_binary(),
                      " comm-selftest --rounds 1 & p", rank, "=$!; ");
  }
  script += "wait $p0; r0=$?; wait $p1; r1=$?; echo exits $r0 $r1";
  const CommandResult run = run_command("sh -c '" + script + "'");
  EXPECT_TRUE(contains(run.output, "exits 0 0")) << run.output;
  EXPECT_TRUE(contains(run.output, str_cat("rendezvous 127.0.0.1:", port + 1))) << run.output;
  EXPECT_TRUE(contains(run.output, "comm-selftest: ok")) << run.output;
}

// Two ranks with the variables srun gives them (MASTER_ADDR/PORT as a batch script would export).
TEST(Launch, UnderSrunRanksComeFromSlurmVariables) {
  const int port = free_tcp_port();
  std::string script;
  for (int rank = 0; rank < 2; ++rank) {
    script += str_cat("SLURM_PROCID=", rank, " SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 SLURM_LOCALID=", rank,
                      " SLURM_NODEID=0 SLURM_STEP_TASKS_PER_NODE=2 SLURM_STEP_NODELIST=localhost SLURM_JOB_ID=77 ",
                      "SLURM_STEP_ID=0 MASTER_PORT=", port, " ", deltamoe_binary(), " comm-selftest --rounds 1 & p",
                      rank, "=$!; ");
  }
  script += "wait $p0; r0=$?; wait $p1; r1=$?; echo exits $r0 $r1";
  const CommandResult run = run_command("sh -c '" + script + "'");
  EXPECT_TRUE(contains(run.output, "exits 0 0")) << run.output;
  EXPECT_TRUE(contains(run.output, "TcpComm ready (srun, rendezvous localhost:")) << run.output;
  EXPECT_TRUE(contains(run.output, "launched by srun")) << run.output;
}

// mpirun's OMPI_COMM_WORLD_* variables with the tcp backend (the address passed with -x).
TEST(Launch, UnderMpirunWithTheTcpBackend) {
  if (!mpi_built()) GTEST_SKIP() << "built without MPI (CMake option DELTAMOE_MPI=OFF or no MPI found): no mpirun here";
  const int port = free_tcp_port();
  const CommandResult run = run_command(str_cat(mpirun_prefix(2), " -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=", port,
                                                " ", deltamoe_binary(), " comm-selftest --backend tcp --rounds 1"));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "TcpComm ready (Open MPI")) << run.output;
  EXPECT_TRUE(contains(run.output, "on 2 ranks (tcp)")) << run.output;
}

// Two "nodes" on this host: mpirun starts one launcher per task, each launches 2 ranks (world 4).
TEST(Launch, OneLauncherPerMpirunTaskMakesNodes) {
  if (!mpi_built()) GTEST_SKIP() << "built without MPI (CMake option DELTAMOE_MPI=OFF or no MPI found): no mpirun here";
  const int port = free_tcp_port();
  const CommandResult run = run_command(str_cat(mpirun_prefix(2), " ", deltamoe_binary(), " launch --nproc_per_node 2 ",
                                                "--master_addr 127.0.0.1 --master_port ", port,
                                                " -- comm-selftest --rounds 1"));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "this is node 1 of 2")) << run.output;
  EXPECT_TRUE(contains(run.output, "on 4 ranks (tcp)")) << run.output;
}

TEST(Launch, ForwardsSigtermToTheRanks) {
  // The ranks keep running rounds; SIGTERM to the launcher alone must reach them (they are in
  // their own process groups, so only forwarding can).
  const std::string script = str_cat(deltamoe_binary(), " launch --nproc_per_node 2 --grace_period 1 -- comm-selftest ",
                                     "--rounds 100000 --pause_ms 5 & pid=$!; sleep 1.5; kill -TERM $pid; wait $pid; "
                                     "echo launcher exit $?");
  const CommandResult run = run_command("sh -c '" + script + "'");
  EXPECT_TRUE(contains(run.output, "was killed by signal 15")) << run.output;
  EXPECT_TRUE(contains(run.output, "launcher exit 143")) << run.output;
  EXPECT_LT(run.seconds, 10.0) << run.output;
}

TEST(Launch, RefusesBadCommandLines) {
  CommandResult run = run_command(deltamoe_binary() + " launch --nproc_per_node 2 comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "needs the command after '--'")) << run.output;
  run = run_command(deltamoe_binary() + " launch --nproc_per_node 0 -- comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "--nproc_per_node 0 must be between 1")) << run.output;
  run = run_command(deltamoe_binary() + " launch --nproc_per_node 2 -- inspect --config tiny");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "'deltamoe inspect' does not run on several ranks yet")) << run.output;
  run = run_command(deltamoe_binary() + " launch --nproc_per_node 2 --nnodes 2 --node_rank 1 -- comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "--master_addr (the host of node 0) is required with --nnodes 2")) << run.output;
  run = run_command(deltamoe_binary() + " launch --nproc_per_node 2 --nnodes 2 --node_rank 2 --master_addr h -- comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "--node_rank 2 must be below --nnodes 2")) << run.output;
  run = run_command(deltamoe_binary() + " launch --nproc_per_nod 2 -- comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "did you mean --nproc_per_node")) << run.output;
  run = run_command("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=99999 " + deltamoe_binary() + " comm-selftest");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(contains(run.output, "MASTER_PORT=99999 is not a TCP port")) << run.output;
}

TEST(Launch, RankThatFailsOnItsOwnIsNamedAndTheOthersStop) {
  const CommandResult run = run_command("DELTAMOE_FAULT=rank:2,at:5,kind:exit " + deltamoe_binary() +
                                        " launch --nproc_per_node 3 -- comm-selftest");
  EXPECT_EQ(run.exit_code, 3) << run.output;
  EXPECT_TRUE(contains(run.output, "the job failed because of rank 2, which exited with code 3")) << run.output;
  EXPECT_TRUE(contains(run.output, "rank 0 exited with code 75 (its job was aborted)")) << run.output;
  EXPECT_TRUE(contains(run.output, "rank 1 exited with code 75 (its job was aborted)")) << run.output;
}

}  // namespace
}  // namespace deltamoe
