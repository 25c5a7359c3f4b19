// Backend choice for connect_world.
#include "parallel/world.h"

#include "core/error.h"
#include "parallel/tcp_comm.h"
#include "parallel/thread_comm.h"
#ifdef DELTAMOE_WITH_MPI
#include "parallel/mpi/mpi_comm.h"
#endif

namespace deltamoe {

CommBackend parse_comm_backend(std::string_view name) {
  if (name == "auto") return CommBackend::automatic;
  if (name == "tcp") return CommBackend::tcp;
  if (name == "mpi") return CommBackend::mpi;
  RAISE("unknown communicator backend '", name, "' (expected auto, tcp or mpi)");
}

bool mpi_built() {
#ifdef DELTAMOE_WITH_MPI
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Communicator> connect_world(const LaunchEnv& env, const CommOptions& options, CommBackend backend) {
  const bool under_mpi = env.launcher == Launcher::open_mpi || env.launcher == Launcher::mpich;
  if (backend == CommBackend::automatic) backend = under_mpi && mpi_built() ? CommBackend::mpi : CommBackend::tcp;
  if (backend == CommBackend::mpi) {
#ifdef DELTAMOE_WITH_MPI
    CHECK(under_mpi || env.world_size == 1, "the MPI backend needs a process started by mpirun / mpiexec, but this "
          "one was started by ", launcher_name(env.launcher), " (", env.origin, ")");
    return connect_mpi_comm(options);
#else
    RAISE("this deltamoe was built without MPI (CMake option DELTAMOE_MPI=OFF, or no MPI found): use the tcp "
          "backend, with MASTER_ADDR and MASTER_PORT set for every rank");
#endif
  }
  if (env.world_size == 1) return make_solo_comm();
  if (under_mpi && env.master_addr.empty()) {
    RAISE("started by ", launcher_name(env.launcher), " (", env.origin, ") without a rendezvous address: ",
          mpi_built() ? "" : "this deltamoe was built without MPI, so ",
          "the tcp backend needs MASTER_ADDR and MASTER_PORT on every rank (mpirun -x MASTER_ADDR=<host of rank 0> "
          "-x MASTER_PORT=<free port>)");
  }
  return connect_tcp_comm(env, options);
}

}  // namespace deltamoe
