// `deltamoe comm-selftest`: joins the job this process was launched into (deltamoe launch, torchrun,
// mpirun, srun) and runs the communicator conformance checks across its ranks, then optional labelled
// rounds of all-reduces (the fault-injection tests aim DELTAMOE_FAULT at them). With --device cuda
// the checks run on NcclComm over device buffers, one GPU per rank (its local rank), after a table
// of the ranks' GPUs and the NCCL version: the bring-up check of a multi-GPU machine.
#include <chrono>
#include <cstdio>
#include <thread>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/log.h"
#include "parallel/comm_selftest.h"
#include "parallel/control_plane.h"
#include "parallel/world.h"
#if DELTAMOE_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "parallel/gpu/comm_bench.h"
#include "parallel/gpu/host_view_comm.h"
#include "parallel/gpu/nccl_comm.h"
#endif

namespace deltamoe {
namespace {

#if DELTAMOE_WITH_CUDA
// NcclComm on this rank's GPU (its local rank), after rank 0 prints every rank's GPU and NCCL.
std::unique_ptr<Communicator> connect_nccl(Communicator& world, const LaunchEnv& env, const CommOptions& options) {
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  CHECK(env.local_rank < devices, "comm-selftest: rank ", world.rank(), " has local rank ", env.local_rank,
        " but this machine shows ", devices, " GPU(s) (one GPU per rank; check CUDA_VISIBLE_DEVICES)");
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, env.local_rank));
  char bus[32] = {0};
  CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), env.local_rank));
  const std::string mine = str_cat("rank ", world.rank(), ": node ", env.node_rank, ", local rank ", env.local_rank,
                                   ", GPU ", env.local_rank, " ", prop.name, ", bus ", bus, ", NCCL ",
                                   nccl_runtime_version());
  const std::vector<std::string> table = world.control().all_gather(mine, "GPU table");
  if (world.rank() == 0) {
    for (const std::string& line : table) std::printf("comm-selftest: %s\n", line.c_str());
    std::fflush(stdout);
  }
  return make_nccl_comm(world, env.local_rank, options);
}
#endif

}  // namespace

int cmd_comm_selftest(int argc, char** argv) {
  ArgParser args("comm-selftest",
                 "check the communicator across the ranks of a job: every collective against a rank-ordered "
                 "loop, bitwise; start it through deltamoe launch, torchrun, mpirun or srun");
  args.add_option("backend", "auto (mpi under mpirun when built with MPI, else tcp), tcp or mpi", "auto");
  args.add_option("rounds", "labelled rounds ('round 1', 'round 2', ...) of one all_reduce each after the checks", "3");
  args.add_option("pause_ms", "milliseconds each rank sleeps before each round", "0");
  args.add_option("device", "cpu (host buffers over the backend) or cuda (NcclComm, one GPU per rank)", "cpu");
  args.add_bool("bench", "with --device cuda, after the checks: time the expert exchange and the dense "
                "reduce-scatter / all-gather (design §4.5)", false);
  args.add_option("bench_dense_params", "parameters of the dense reduce-scatter / all-gather (0 skips them)",
                  "2900000000");
  if (!args.parse(argc, argv)) return 0;
  const std::string device = args.get("device");
  CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '", device, "'");
  const bool bench = args.flag("bench");
  CHECK(!bench || device == "cuda", "--bench needs --device cuda");
  const int64_t bench_dense_params = args.get_int("bench_dense_params");
  CHECK(bench_dense_params >= 0, "--bench_dense_params must not be negative");
#if !DELTAMOE_WITH_CUDA
  CHECK(device == "cpu", "--device cuda: this deltamoe was built without CUDA (cmake -DDELTAMOE_CUDA=ON)");
#endif
  const CommBackend backend = parse_comm_backend(args.get("backend"));
  const int64_t rounds = args.get_int("rounds");
  const int64_t pause_ms = args.get_int("pause_ms");
  CHECK(rounds >= 0 && pause_ms >= 0, "--rounds and --pause_ms must not be negative");

  const LaunchEnv env = read_launch_env();
  const CommOptions options = CommOptions::from_env();
  for (const std::string& note : env.notes) log_info("comm-selftest: ", note);
  std::unique_ptr<Communicator> world = connect_world(env, options, backend);
  // The checks run on `comm`: the world itself, or a host view of NcclComm over it.
  std::unique_ptr<Communicator> nccl, view;
  Communicator* comm = world.get();
  try {
#if DELTAMOE_WITH_CUDA
    if (device == "cuda") {
      nccl = connect_nccl(*world, env, options);
      view = make_host_view_comm(*nccl);
      comm = view.get();
    }
#endif
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
#if DELTAMOE_WITH_CUDA
    if (bench) {
      comm->set_activity("bench");
      CommBenchOptions bench_options;
      bench_options.dense_params = bench_dense_params;
      const std::vector<CommBenchRow> rows = run_comm_bench(*nccl, env.local_rank, bench_options);
      if (comm->rank() == 0) std::printf("%s", format_comm_bench(rows, comm->size()).c_str());
    }
#endif
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
