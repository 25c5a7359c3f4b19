// The engine `deltamoe bench` times and its communicators (bench_session.h).
#include "cli/gpu/bench_session.h"

#include <cuda_runtime.h>

#include "cli/expert_recv_flag.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "parallel/comm_options.h"
#include "parallel/gpu/mirror_comm.h"
#include "parallel/gpu/nccl_comm.h"
#include "parallel/thread_comm.h"
#include "parallel/world.h"
#include "train/parallel_layout.h"

namespace deltamoe {

BenchSession open_bench_session(const ArgParser& args, const ModelConfig& config, const EngineOptions& options,
                                uint64_t seed) {
  BenchSession session;
  session.simulated_ranks = static_cast<int>(args.get_int("simulate_expert_parallel"));
  CHECK(session.simulated_ranks >= 0, "--simulate_expert_parallel must be 0 (off) or the GPUs to simulate, got ",
        session.simulated_ranks);
  const double recv_headroom = parse_expert_recv_headroom(args.get("expert_recv_headroom"));
  session.launch = read_launch_env();
  const bool lora = options.lora != nullptr;
  if (session.simulated_ranks > 0) {
    // This process is rank 0 of N identical ranks: its own experts (1/N of each layer's) receive
    // the rows of all N ranks, the dense state is its ZeRO-2 piece (design §4.4).
    const int ranks = session.simulated_ranks;
    CHECK(!lora, "--simulate_expert_parallel: LoRA trains on one rank; use --tuner_type full");
    CHECK(config.text.num_experts % ranks == 0, "--simulate_expert_parallel ", ranks, " does not divide the ",
          config.text.num_experts, " routed experts");
    session.solo = make_solo_comm();
    session.mirror = make_mirror_comm(*session.solo, 0, ranks);
    ParallelOptions parallel;
    parallel.expert_parallel_size = ranks;
    parallel.distributed_optimizer = true;
    // A copy of this rank sends it what it routes to itself: about tokens x K rows in all, the
    // headroom above that covers the random router's imbalance.
    parallel.expert_recv_headroom = recv_headroom;
    session.engine = std::make_unique<GpuEngine>(config, options, seed, *session.mirror, parallel);
  } else if (session.launch.world_size > 1) {
    // Each rank times its own step on its own synthetic batches (design §4.5 item 4).
    const LaunchEnv& launch = session.launch;
    CHECK(!lora, "bench on ", launch.world_size, " ranks: LoRA trains on one rank; use --tuner_type full");
    int devices = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    CHECK(launch.local_rank < devices, "bench: rank ", launch.rank, " has local rank ", launch.local_rank,
          " but this node shows ", devices, " GPU(s); each rank needs its own GPU");
    CUDA_CHECK(cudaSetDevice(launch.local_rank));
    session.host_world = connect_world(launch, CommOptions::from_env());
    session.device_world = make_nccl_comm(*session.host_world, launch.local_rank, CommOptions::from_env());
    session.rank = session.host_world->rank();
    ParallelOptions parallel;
    const int64_t ep = args.get_int("expert_model_parallel_size");
    parallel.expert_parallel_size = ep > 0 ? static_cast<int>(ep) : launch.world_size;
    parallel.distributed_optimizer = true;
    parallel.expert_recv_headroom = recv_headroom;
    session.engine = std::make_unique<GpuEngine>(config, options, seed, *session.device_world, parallel);
  } else {
    session.engine = std::make_unique<GpuEngine>(config, options, seed);
  }
  return session;
}

}  // namespace deltamoe
