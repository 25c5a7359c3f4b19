// The engine `deltamoe bench` times, made from its flags, with the communicators it rests on: one
// GPU holding every expert; rank 0 of a simulated N-GPU job (--simulate_expert_parallel N:
// MirrorComm, every exchange a same-size device copy); or one rank of a launched job (deltamoe
// launch, torchrun, srun, mpirun: NCCL, one GPU per local rank, EP and ZeRO-2).
#pragma once

#include <memory>

#include "cli/args.h"
#include "model/config.h"
#include "parallel/communicator.h"
#include "parallel/launch_env.h"
#include "train/gpu/gpu_engine.h"
#include "train/train_engine.h"

namespace deltamoe {

struct BenchSession {
  // Declared before the engine so that they outlive it.
  std::unique_ptr<Communicator> solo, mirror, host_world, device_world;
  std::unique_ptr<GpuEngine> engine;
  LaunchEnv launch;
  int rank = 0;
  int simulated_ranks = 0;  // 0: not simulating
  bool launched() const { return host_world != nullptr; }
};

// Reads --simulate_expert_parallel, --expert_model_parallel_size and --expert_recv_headroom. LoRA
// (options.lora) trains on one rank: refused with either form of parallelism.
BenchSession open_bench_session(const ArgParser& args, const ModelConfig& config, const EngineOptions& options,
                                uint64_t seed);

}  // namespace deltamoe
