// The process launcher behind `deltamoe launch` and NPROC_PER_NODE: starts one child per local rank
// with torchrun's variables, forwards SIGINT/SIGTERM/SIGHUP to them, waits, and when a rank fails
// gives the others a grace period to stop by themselves before terminating them.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace deltamoe {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // "" = 127.0.0.1 on one node; required for several
  int master_port = 0;      // 0 = a free port on one node, 29500 for several
  // After the first rank fails, how long the others get to exit by themselves before SIGTERM (and
  // SIGKILL another grace period later). Their control plane aborts them at once for a death and
  // at the deadline for a hang; a rank whose main thread is stuck is ended by its control plane
  // CommOptions::abort_grace() (at most 5 s) after the abort, so keep this above that.
  double grace_seconds = 10;
  // The command each rank runs; command[0] is the program.
  std::vector<std::string> command;
  // Set by resolve_launch_options when it chose the port on one node: a socket listening on it,
  // handed to rank 0 (DELTAMOE_RDZV_FD) so that the port cannot be taken before rank 0 starts.
  int listener_fd = -1;
};

// Environment of local rank `local_rank` (what torchrun sets, plus DELTAMOE_RUN_ID): `base` without
// the launcher's own variables (NPROC_PER_NODE, NNODES, NODE_RANK, TORCHELASTIC_*), with RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
std::map<std::string, std::string> child_environment(const std::map<std::string, std::string>& base,
                                                     const LaunchOptions& options, int local_rank,
                                                     const std::string& run_id);

// Fills in master_addr / master_port defaults and checks the options (throws on bad ones). On one
// node without a port it opens the rendezvous listener itself (listener_fd; the caller owns it).
LaunchOptions resolve_launch_options(LaunchOptions options);

// Runs the ranks of this node; returns the launcher's exit status: 0 when every rank exited 0, else
// the status of the rank that failed first (128 + signal for a rank killed by a signal; a rank that
// exits kExitCommAborted only because another failed is not taken as the first failure).
int run_launch(const LaunchOptions& options);

// Path of the running program (/proc/self/exe).
std::string self_executable();

}  // namespace deltamoe
