// MpiComm: ranks started by mpirun / mpiexec, messages over MPI point-to-point (MPI_Isend/Irecv of
// bytes, polled with a deadline), the same collectives (HostComm) as ThreadComm and TcpComm, so
// results are bitwise theirs (MPI's own reductions are not used: their order is unspecified).
// Built only with the CMake option DELTAMOE_MPI (Open MPI from Debian: libopenmpi-dev).
#pragma once

#include <memory>

#include "parallel/comm_options.h"
#include "parallel/communicator.h"

namespace deltamoe {

// Initialises MPI if needed (MPI_THREAD_FUNNELED) and returns the world communicator (a duplicate
// of MPI_COMM_WORLD). An abort prints its message and calls MPI_Abort (exit status
// kExitCommAborted), which ends every rank; mpirun also ends the job when a rank dies.
std::unique_ptr<Communicator> connect_mpi_comm(const CommOptions& options);

}  // namespace deltamoe
