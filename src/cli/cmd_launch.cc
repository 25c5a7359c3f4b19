// `deltamoe launch --nproc_per_node N [--nnodes --node_rank --master_addr --master_port] -- <command>`
// starts N ranks of this program with torchrun's variables (src/parallel/launcher.h); under srun or
// mpirun (one launcher per node) the node count and index come from them. And
// `NPROC_PER_NODE=N deltamoe <command>` does the same (ms-swift's habit; also NNODES, NODE_RANK,
// MASTER_ADDR, MASTER_PORT).
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "parallel/launch_env.h"
#include "parallel/launcher.h"

namespace deltamoe {
namespace {

// Subcommands that run as one rank of a job (read the launch environment and join it). Others
// would run N independent copies, so they are refused. Add a command here once it runs distributed.
const char* const kDistributedCommands[] = {"comm-selftest", "train"};

bool runs_distributed(const std::string& command) {
  for (const char* name : kDistributedCommands) {
    if (command == name) return true;
  }
  return false;
}

std::string distributed_list() {
  std::string text;
  for (const char* name : kDistributedCommands) text += str_cat(text.empty() ? "" : ", ", name);
  return text;
}

int env_int(const char* name, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  CHECK(end != text && *end == '\0' && value >= 0 && value < 1000000, name, "='", text,
        "' is not a non-negative integer");
  return static_cast<int>(value);
}

}  // namespace

int cmd_launch(int argc, char** argv) {
  int separator = 2;
  while (separator < argc && std::strcmp(argv[separator], "--") != 0) ++separator;
  ArgParser args("launch",
                 "start --nproc_per_node ranks of 'deltamoe <command>' on this node with torchrun's variables "
                 "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...); usage: deltamoe launch "
                 "--nproc_per_node N [flags] -- <command> [its flags]");
  args.add_required("nproc_per_node", "ranks to start on this node");
  args.add_option("nnodes", "number of nodes (run launch once per node)", "1");
  args.add_option("node_rank", "this node's index, 0 .. nnodes-1", "0");
  args.add_option("master_addr", "host of node 0 (default 127.0.0.1 on one node; required for several)", "");
  args.add_option("master_port", "rendezvous port on node 0 (default: a free port on one node, 29500 for several)",
                  "0");
  args.add_option("grace_period", "seconds the other ranks get to stop by themselves after one fails, before "
                  "SIGTERM (keep it above the ranks' abort grace, min(5, DELTAMOE_COMM_TIMEOUT / 2))", "10");
  bool help = false;
  for (int i = 2; i < separator; ++i) help |= std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0;
  CHECK(help || separator + 1 < argc, "'deltamoe launch' needs the command after '--', e.g. deltamoe launch "
        "--nproc_per_node 2 -- comm-selftest\n", args.usage());
  if (!args.parse(separator, argv)) return 0;
  const std::string command = argv[separator + 1];
  CHECK(runs_distributed(command), "'deltamoe ", command, "' does not run on several ranks yet (launch would start ",
        args.get("nproc_per_node"), " independent copies); commands that do: ", distributed_list());
  LaunchOptions options;
  options.nproc_per_node = static_cast<int>(args.get_int("nproc_per_node"));
  options.nnodes = static_cast<int>(args.get_int("nnodes"));
  options.node_rank = static_cast<int>(args.get_int("node_rank"));
  options.master_addr = args.get("master_addr");
  options.master_port = static_cast<int>(args.get_int("master_port"));
  options.grace_seconds = args.get_double("grace_period");
  // One launcher per node started by srun / mpirun (e.g. srun --ntasks-per-node=1): each of their
  // tasks is a node, unless --nnodes / --node_rank say otherwise.
  if (!args.has("nnodes") && !args.has("node_rank")) {
    const LaunchEnv outer = read_launch_env();
    if (outer.launcher != Launcher::none && outer.launcher != Launcher::torchrun && outer.world_size > 1) {
      options.nnodes = outer.world_size;
      options.node_rank = outer.rank;
      if (options.master_addr.empty()) options.master_addr = outer.master_addr;
      if (options.master_port == 0) options.master_port = outer.rendezvous_port;
      log_info("launch: started by ", launcher_name(outer.launcher), " (", outer.origin, "): this is node ",
               outer.rank, " of ", outer.world_size);
      if (outer.local_world_size > 1) {
        log_warn("launch: ", outer.local_world_size, " launchers run on this host; start one per node (srun "
                 "--ntasks-per-node=1, mpirun --map-by ppr:1:node)");
      }
    }
  }
  options.command.push_back(self_executable());
  for (int i = separator + 1; i < argc; ++i) options.command.push_back(argv[i]);
  return run_launch(options);
}

bool wants_launch_from_env(int argc, char** argv) {
  const char* nproc = std::getenv("NPROC_PER_NODE");
  if (nproc == nullptr || *nproc == '\0' || argc < 2) return false;
  if (std::strcmp(argv[1], "launch") == 0) return false;
  if (std::getenv("RANK") != nullptr) return false;  // already a rank of a launched job
  if (!runs_distributed(argv[1])) {
    log_warn("NPROC_PER_NODE=", nproc, " is ignored: 'deltamoe ", argv[1], "' runs as one process (commands that run "
             "on several ranks: ", distributed_list(), ")");
    return false;
  }
  return true;
}

int launch_from_env(int argc, char** argv) {
  LaunchOptions options;
  options.nproc_per_node = env_int("NPROC_PER_NODE", 1);
  options.nnodes = env_int("NNODES", 1);
  options.node_rank = env_int("NODE_RANK", 0);
  if (const char* addr = std::getenv("MASTER_ADDR")) options.master_addr = addr;
  options.master_port = env_int("MASTER_PORT", 0);
  options.command.push_back(self_executable());
  for (int i = 1; i < argc; ++i) options.command.push_back(argv[i]);
  return run_launch(options);
}

}  // namespace deltamoe
