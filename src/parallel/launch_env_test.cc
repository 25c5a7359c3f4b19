// Launch environments as tables: torchrun (with its agent store on MASTER_PORT), srun, Open MPI,
// MPICH/Hydra, nested launchers, conflicts and bad values; Slurm host and task lists.
#include "parallel/launch_env.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace deltamoe {
namespace {

struct Expected {
  Launcher launcher;
  int rank, world, local_rank, local_world, node;
  std::string master_addr;
  int port;
};

struct GoodCase {
  const char* name;
  EnvMap env;
  Expected want;
  const char* origin_part = "";  // must occur in describe()
};

const GoodCase kGood[] = {
    {"nothing set", {}, {Launcher::none, 0, 1, 0, 1, -1, "", 0}, "no launcher variables"},
    {"torchrun with its agent store: our port is MASTER_PORT+1",
     {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "0"},
      {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"TORCHELASTIC_RUN_ID", "job7"}},
     {Launcher::torchrun, 1, 4, 1, 2, 0, "10.0.0.1", 29501}, "agent store holds MASTER_PORT=29500"},
    {"torchrun agent store, DELTAMOE_RDZV_PORT wins",
     {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
      {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"DELTAMOE_RDZV_PORT", "31000"}},
     {Launcher::torchrun, 0, 2, 0, 2, -1, "h", 31000}, "DELTAMOE_RDZV_PORT=31000"},
    {"deltamoe launch (no agent store): MASTER_PORT itself",
     {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "0"},
      {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}},
     {Launcher::torchrun, 3, 4, 3, 4, 0, "127.0.0.1", 29500}, "MASTER_PORT=29500"},
    {"RANK/WORLD_SIZE alone: one node assumed",
     {{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}},
     {Launcher::torchrun, 2, 3, 2, 3, -1, "h", 1234}, "RANK=2 WORLD_SIZE=3"},
    {"torchrun world of one needs no address", {{"RANK", "0"}, {"WORLD_SIZE", "1"}},
     {Launcher::torchrun, 0, 1, 0, 1, -1, "", 0}, ""},
    {"Open MPI without an address (the MPI backend needs none)",
     {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
     {Launcher::open_mpi, 1, 2, 1, 2, -1, "", 0}, "OMPI_COMM_WORLD_RANK=1"},
    {"Open MPI on its second node: the node rank is read and named",
     {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_NODE_RANK", "1"}},
     {Launcher::open_mpi, 3, 4, 1, 2, 1, "", 0}, "OMPI_COMM_WORLD_LOCAL_SIZE=2 OMPI_COMM_WORLD_NODE_RANK=1"},
    {"Open MPI with mpirun -x MASTER_ADDR -x MASTER_PORT",
     {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "5000"}},
     {Launcher::open_mpi, 0, 2, 0, 2, -1, "n1", 5000}, "MASTER_PORT=5000"},
    {"MPICH / Hydra",
     {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "2"}},
     {Launcher::mpich, 2, 4, 0, 2, -1, "", 0}, "PMI_RANK=2"},
    {"srun: address from the node list, port from the job id",
     {{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_LOCALID", "1"},
      {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}, {"SLURM_STEP_NODELIST", "node[07-08]"},
      {"SLURM_JOB_ID", "12345"}, {"SLURM_STEP_ID", "0"}},
     {Launcher::slurm, 3, 4, 1, 2, 1, "node07", 32345}, "first host of SLURM_STEP_NODELIST"},
    {"srun with MASTER_ADDR and MASTER_PORT",
     {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"},
      {"SLURM_TASKS_PER_NODE", "1(x2)"}, {"SLURM_JOB_NODELIST", "a,b"}, {"SLURM_JOB_ID", "9"},
      {"MASTER_ADDR", "a-ib"}, {"MASTER_PORT", "6000"}},
     {Launcher::slurm, 0, 2, 0, 1, 0, "a-ib", 6000}, "MASTER_ADDR=a-ib"},
    {"sbatch without srun: rank 0 of SLURM_NTASKS (the rendezvous will time out with a hint)",
     {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_NODELIST", "n1"}, {"SLURM_JOB_ID", "5"}},
     {Launcher::slurm, 0, 8, 0, 8, -1, "n1", 20005}, ""},
    {"srun around torchrun: Slurm's one task per node is an outer launch",
     {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODEID", "1"}, {"RANK", "5"}, {"WORLD_SIZE", "8"},
      {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"}, {"MASTER_ADDR", "n0"},
      {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}},
     {Launcher::torchrun, 5, 8, 1, 4, 1, "n0", 29501}, "describe an outer launch and are ignored"},
    {"srun of an Open MPI program: both agree",
     {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}, {"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
     {Launcher::open_mpi, 1, 2, 1, 2, -1, "", 0}, ""},
};

class LaunchEnvGood : public ::testing::TestWithParam<GoodCase> {};

TEST_P(LaunchEnvGood, Reads) {
  const GoodCase& c = GetParam();
  const LaunchEnv env = read_launch_env(c.env);
  EXPECT_EQ(env.launcher, c.want.launcher);
  EXPECT_EQ(env.rank, c.want.rank);
  EXPECT_EQ(env.world_size, c.want.world);
  EXPECT_EQ(env.local_rank, c.want.local_rank);
  EXPECT_EQ(env.local_world_size, c.want.local_world);
  EXPECT_EQ(env.node_rank, c.want.node);
  EXPECT_EQ(env.master_addr, c.want.master_addr);
  EXPECT_EQ(env.rendezvous_port, c.want.port);
  EXPECT_NE(env.describe().find(c.origin_part), std::string::npos) << env.describe();
}

INSTANTIATE_TEST_SUITE_P(Table, LaunchEnvGood, ::testing::ValuesIn(kGood));

struct BadCase {
  const char* name;
  EnvMap env;
  const char* message_part;  // the error must name these variables / values
  const char* second_part = "";
};

const BadCase kBad[] = {
    {"RANK without WORLD_SIZE", {{"RANK", "0"}}, "RANK is set but WORLD_SIZE is not"},
    {"WORLD_SIZE without RANK", {{"WORLD_SIZE", "2"}}, "WORLD_SIZE is set but RANK is not"},
    {"rank not below the world", {{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}},
     "RANK=4 is not below WORLD_SIZE=4"},
    {"rank not a number", {{"RANK", "one"}, {"WORLD_SIZE", "4"}}, "RANK='one' is not a rank"},
    {"negative rank", {{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, "RANK=-1 is not a rank"},
    {"world of zero", {{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0 is not a world size"},
    {"empty world", {{"RANK", "0"}, {"WORLD_SIZE", ""}}, "WORLD_SIZE is set but empty"},
    {"local rank not below the local world",
     {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}, "LOCAL_RANK=2 is not below"},
    {"local world larger than the world", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}},
     "is larger than WORLD_SIZE=2"},
    {"torchrun without MASTER_ADDR", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}},
     "MASTER_ADDR is not"},
    {"torchrun without a port", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
     "neither MASTER_PORT nor DELTAMOE_RDZV_PORT"},
    {"empty MASTER_ADDR", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}, {"MASTER_PORT", "1"}},
     "MASTER_ADDR is set but empty"},
    {"port out of range", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
     "MASTER_PORT=70000 is not a TCP port"},
    {"agent store on the last port",
     {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "65535"},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"}},
     "MASTER_PORT+1 is no port"},
    {"bad DELTAMOE_RDZV_PORT", {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"DELTAMOE_RDZV_PORT", "x"}},
     "DELTAMOE_RDZV_PORT='x' is not a TCP port"},
    {"torchrun and Open MPI disagree on the same processes",
     {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}, {"OMPI_COMM_WORLD_RANK", "0"},
      {"OMPI_COMM_WORLD_SIZE", "2"}},
     "RANK=1 (torchrun/deltamoe launch) and OMPI_COMM_WORLD_RANK=0 (Open MPI) disagree", "unset the variables"},
    {"Open MPI and srun disagree on the local rank",
     {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
     "OMPI_COMM_WORLD_LOCAL_RANK=1 (Open MPI) and SLURM_LOCALID=0 (srun) disagree"},
    {"Open MPI rank without size", {{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"},
    {"Hydra rank not below size", {{"PMI_RANK", "3"}, {"PMI_SIZE", "2"}}, "PMI_RANK=3 is not below PMI_SIZE=2"},
    {"srun without a task count", {{"SLURM_PROCID", "0"}}, "neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS"},
    {"srun with a malformed node list",
     {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_NODELIST", "node[01-"}},
     "SLURM_STEP_NODELIST='node[01-'", "unbalanced brackets"},
    {"srun with fewer nodes in the task list than its node id",
     {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODEID", "3"}, {"SLURM_TASKS_PER_NODE", "1(x2)"}},
     "lists 2 nodes but SLURM_NODEID=3"},
};

class LaunchEnvBad : public ::testing::TestWithParam<BadCase> {};

TEST_P(LaunchEnvBad, IsRefusedWithAMessageNamingTheVariables) {
  const BadCase& c = GetParam();
  try {
    const LaunchEnv env = read_launch_env(c.env);
    FAIL() << c.name << ": accepted as " << env.describe();
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(c.message_part), std::string::npos) << c.name << ": " << message;
    EXPECT_NE(message.find(c.second_part), std::string::npos) << c.name << ": " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Table, LaunchEnvBad, ::testing::ValuesIn(kBad));

TEST(LaunchEnv, RunIdComesFromOurVariableThenTorchrunThenSlurm) {
  EXPECT_EQ(read_launch_env(EnvMap{{"DELTAMOE_RUN_ID", "a"}, {"TORCHELASTIC_RUN_ID", "b"}}).run_id, "a");
  EXPECT_EQ(read_launch_env(EnvMap{{"TORCHELASTIC_RUN_ID", "b"}, {"SLURM_JOB_ID", "7"}}).run_id, "b");
  EXPECT_EQ(read_launch_env(EnvMap{{"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "2"}}).run_id, "slurm-7.2");
  EXPECT_EQ(read_launch_env(EnvMap{}).run_id, "");
}

TEST(Hostlist, ExpandsRangesListsPaddingAndProducts) {
  using List = std::vector<std::string>;
  EXPECT_EQ(expand_hostlist("node[01-04,07]"), (List{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_hostlist("a,b[1-2],c"), (List{"a", "b1", "b2", "c"}));
  EXPECT_EQ(expand_hostlist("x[9-11]"), (List{"x9", "x10", "x11"}));
  EXPECT_EQ(expand_hostlist("n[098-100]-ib"), (List{"n098-ib", "n099-ib", "n100-ib"}));
  EXPECT_EQ(expand_hostlist("rack[1-2]-n[1-2]"), (List{"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}));
  EXPECT_EQ(expand_hostlist("solo"), (List{"solo"}));
}

TEST(Hostlist, RefusesMalformedLists) {
  for (const char* bad : {"n[1-", "n[3-1]", "n[]", "a,,b", "n[1-2", "n]1[", "n[a-b]", "n[[1]]"}) {
    EXPECT_THROW(expand_hostlist(bad), Error) << bad;
  }
}

TEST(TasksPerNode, ExpandsRepeats) {
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(expand_tasks_per_node("8"), (std::vector<int>{8}));
  for (const char* bad : {"", "2(x", "a", "2(x0)", "1,,2"}) EXPECT_THROW(expand_tasks_per_node(bad), Error) << bad;
}

}  // namespace
}  // namespace deltamoe
