// Who am I: rank, world size, local rank and the rendezvous address of this process, read from the
// variables of the launcher that started it (torchrun / deltamoe launch, Open MPI, MPICH/Hydra,
// srun). Precedence and conflict rules are in docs/parallel.md ("How ranks are found").
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace deltamoe {

enum class Launcher : uint8_t {
  none,      // started alone: rank 0 of 1
  torchrun,  // RANK / WORLD_SIZE (torchrun, deltamoe launch, or set by hand)
  open_mpi,  // OMPI_COMM_WORLD_*
  mpich,     // PMI_RANK / PMI_SIZE (MPICH, Intel MPI: Hydra)
  slurm,     // SLURM_PROCID (srun)
};

std::string_view launcher_name(Launcher launcher);

struct LaunchEnv {
  Launcher launcher = Launcher::none;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = -1;        // -1 when the launcher does not say
  std::string master_addr;   // rendezvous host; "" when the environment names none
  int rendezvous_port = 0;   // 0 when the environment names none
  // A socket already listening on rendezvous_port, inherited from `deltamoe launch` by rank 0 of
  // node 0 (DELTAMOE_RDZV_FD), so no other process can take the port in between; -1 when none.
  int rendezvous_fd = -1;
  std::string run_id;        // ranks of one job must agree; "" when unknown
  // The variables this was read from, e.g. "RANK=1 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4".
  std::string origin;
  // How the rendezvous address and port were chosen, e.g. "MASTER_PORT+1 (torchrun's agent store
  // holds MASTER_PORT)".
  std::string rendezvous_origin;
  // Other launchers' variables that were ignored (an outer launch, e.g. srun around torchrun).
  std::vector<std::string> notes;

  // One line for the log: "rank 1 of 4 (local 1 of 4, node 0) from torchrun: RANK=1 ...".
  std::string describe() const;
};

using EnvMap = std::map<std::string, std::string>;

// Reads the launch environment from `env`. Throws deltamoe::Error on a missing partner variable
// (RANK without WORLD_SIZE), a malformed or out-of-range value, or two launchers that describe the
// same processes differently, naming the variables involved.
LaunchEnv read_launch_env(const EnvMap& env);
// The same for this process's environment.
LaunchEnv read_launch_env();
EnvMap process_env();

// Slurm host lists: "node[01-04,07],gpu3" -> node01 node02 node03 node04 node07 gpu3. Zero padding
// follows the lower bound; several bracket groups expand as a product. Throws on malformed lists.
std::vector<std::string> expand_hostlist(std::string_view list);
// SLURM_TASKS_PER_NODE: "2(x3),1" -> 2 2 2 1. Throws on malformed text.
std::vector<int> expand_tasks_per_node(std::string_view text);

}  // namespace deltamoe
