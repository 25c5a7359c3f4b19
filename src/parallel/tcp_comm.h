// TcpComm: one process per rank, found through the TCP rendezvous on rank 0 (rendezvous.h) and
// watched by the control plane (tcp_control_plane.h); tensor data moves over one direct socket per
// pair of ranks. Same collectives (HostComm) as ThreadComm and MpiComm.
#pragma once

#include <memory>

#include "parallel/comm_options.h"
#include "parallel/communicator.h"
#include "parallel/launch_env.h"

namespace deltamoe {

// Joins the job described by `env` (rank, world size, rendezvous address and port, run id) and
// returns its world communicator. Throws deltamoe::Error when the rendezvous fails (see
// rendezvous.h). options.fault (DELTAMOE_FAULT) is armed for this rank.
std::unique_ptr<Communicator> connect_tcp_comm(const LaunchEnv& env, const CommOptions& options);

}  // namespace deltamoe
