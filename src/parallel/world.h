// Joining the job this process was launched into: the launch environment, then the backend that
// fits it (a solo communicator when alone, MpiComm under mpirun when built with MPI, else TcpComm).
#pragma once

#include <memory>
#include <string_view>

#include "parallel/comm_options.h"
#include "parallel/communicator.h"
#include "parallel/launch_env.h"

namespace deltamoe {

enum class CommBackend : uint8_t {
  automatic,  // mpi when started by mpirun/mpiexec and built with MPI, else tcp
  tcp,
  mpi,
};

// "auto", "tcp" or "mpi"; throws naming the accepted values.
CommBackend parse_comm_backend(std::string_view name);

// Whether this build has MpiComm (CMake option DELTAMOE_MPI).
bool mpi_built();

// The world communicator of the job `env` describes. Throws deltamoe::Error when the job cannot
// be joined (rendezvous failures, MPI requested but not built, ...).
std::unique_ptr<Communicator> connect_world(const LaunchEnv& env, const CommOptions& options,
                                            CommBackend backend = CommBackend::automatic);

}  // namespace deltamoe
