// `deltamoe comm-selftest`: joins the job this process was launched into (deltamoe launch, torchrun,
// mpirun, srun) and runs the communicator conformance checks across its ranks, then optional labelled
// rounds of all-reduces (the fault-injection tests aim DELTAMOE_FAULT at them).
#include <chrono>
#include <cstdio>
#include <thread>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/log.h"
#include "parallel/comm_selftest.h"
#include "parallel/world.h"

namespace deltamoe {

int cmd_comm_selftest(int argc, char** argv) {
  ArgParser args("comm-selftest",
                 "check the communicator across the ranks of a job: every collective against a rank-ordered "
                 "loop, bitwise; start it through deltamoe launch, torchrun, mpirun or srun");
  args.add_option("backend", "auto (mpi under mpirun when built with MPI, else tcp), tcp or mpi", "auto");
  args.add_option("rounds", "labelled rounds ('round 1', 'round 2', ...) of one all_reduce each after the checks", "3");
  args.add_option("pause_ms", "milliseconds each rank sleeps before each round", "0");
  if (!args.parse(argc, argv)) return 0;
  const CommBackend backend = parse_comm_backend(args.get("backend"));
  const int64_t rounds = args.get_int("rounds");
  const int64_t pause_ms = args.get_int("pause_ms");
  CHECK(rounds >= 0 && pause_ms >= 0, "--rounds and --pause_ms must not be negative");

  const LaunchEnv env = read_launch_env();
  const CommOptions options = CommOptions::from_env();
  for (const std::string& note : env.notes) log_info("comm-selftest: ", note);
  std::unique_ptr<Communicator> comm = connect_world(env, options, backend);
  try {
    comm->set_activity("conformance checks");
    const SelftestResult result = run_comm_selftest(*comm);
    for (int64_t round = 1; round <= rounds; ++round) {
      if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
      comm->set_activity(str_cat("round ", round));
      double value = comm->rank() + round;
      comm->all_reduce(&value, &value, 1, DType::f64, ReduceOp::sum);
      const double n = comm->size();
      CHECK(value == n * (n - 1) / 2 + n * round, "round ", round, ": all_reduce gave ", value);
    }
    comm->set_activity("done");
    comm->barrier();
    if (comm->rank() == 0) {
      std::printf("comm-selftest: ok: %s; %lld rounds; launched by %s\n", result.summary.c_str(),
                  static_cast<long long>(rounds), std::string(launcher_name(env.launcher)).c_str());
      std::fflush(stdout);
    }
  } catch (const CommAborted&) {
    return kExitCommAborted;  // the control plane has logged why
  } catch (const std::exception& error) {
    comm->abort(str_cat("comm-selftest failed on rank ", comm->rank(), ": ", error.what()));
    throw;
  }
  return 0;
}

}  // namespace deltamoe
