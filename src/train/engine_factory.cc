// Engine selection: the CPU reference always; the GPU engine in CUDA builds where a GPU answers
// (on several ranks: one GPU per rank by its local rank, NcclComm over the host world).
#include "train/engine_factory.h"

#include "core/error.h"
#include "core/log.h"
#include "train/cpu_engine.h"
#if DELTAMOE_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "parallel/comm_options.h"
#include "parallel/gpu/nccl_comm.h"
#include "parallel/launch_env.h"
#include "train/gpu/gpu_engine.h"
#endif

namespace deltamoe {

std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const EngineOptions& options) {
  CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got '", device,
        "'");
#if DELTAMOE_WITH_CUDA
  if (device != "cpu") {
    if (options.lora != nullptr) {
      const std::string why = gpu_lora_refusal(*options.lora);
      CHECK(why.empty() || device == "auto", "--device cuda: ", why, "; train these targets on the CPU reference ",
            "(--device cpu)");
      if (!why.empty()) {
        log_warn("train: ", why, "; --tuner_type lora trains on the CPU reference");
        return std::make_unique<CpuEngine>(checkpoint, options);
      }
    }
    if (cuda_device_available()) return std::make_unique<GpuEngine>(checkpoint, options);
    CHECK(device != "cuda", "--device cuda: no CUDA GPU answered on this machine; use --device cpu or auto");
    log_info("train: no CUDA GPU answered; training on the CPU reference");
  }
#else
  CHECK(device != "cuda", "--device cuda: this build has no GPU training engine (built with DELTAMOE_CUDA=OFF); ",
        "use --device cpu or auto");
#endif
  return std::make_unique<CpuEngine>(checkpoint, options);
}

#if DELTAMOE_WITH_CUDA
namespace {

// The rank's NcclComm, made before and destroyed after the engine that uses it.
struct CommHolder {
  std::unique_ptr<Communicator> comm;
};

class RankGpuEngine : private CommHolder, public GpuEngine {
 public:
  RankGpuEngine(std::unique_ptr<Communicator> comm, const ModelCheckpoint& checkpoint, const EngineOptions& options,
                const ParallelOptions& parallel)
      : CommHolder{std::move(comm)}, GpuEngine(checkpoint, options, *CommHolder::comm, parallel) {}
};

// CUDA devices this process sees (0 when none answers).
int visible_gpus() {
  if (!cuda_device_available()) return 0;
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  return count;
}

}  // namespace
#endif

std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const EngineOptions& options, Communicator& world,
                                               const ParallelOptions& parallel) {
  CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got '", device,
        "'");
#if DELTAMOE_WITH_CUDA
  if (device != "cpu") {
    // One GPU per rank: the rank's local rank picks it; NCCL over the host world carries the step.
    const LaunchEnv launch = read_launch_env();
    const int gpus = visible_gpus();
    const bool fits = gpus > 0 && launch.local_rank < gpus && launch.local_world_size <= gpus;
    CHECK(fits || device == "auto", "--device cuda: rank ", world.rank(), " has local rank ", launch.local_rank, " of ",
          launch.local_world_size, " on this node, which shows ", gpus, " GPU(s); each rank needs its own GPU ",
          "(check CUDA_VISIBLE_DEVICES and --nproc_per_node), or use --device cpu");
    CHECK(options.lora == nullptr || device == "auto", "--device cuda: --tuner_type lora on ", world.size(),
          " ranks is not supported (LoRA trains on one rank); use one rank or --device cpu");
    if (fits && options.lora == nullptr) {
      CUDA_CHECK(cudaSetDevice(launch.local_rank));
      if (world.rank() == 0) log_info("train: ", world.size(), " ranks train on the GPU engine over NCCL");
      return std::make_unique<RankGpuEngine>(make_nccl_comm(world, launch.local_rank, CommOptions::from_env()),
                                             checkpoint, options, parallel);
    }
  }
#else
  CHECK(device != "cuda", "--device cuda: this build has no GPU training engine (built with DELTAMOE_CUDA=OFF); ",
        "use --device cpu or auto");
#endif
  if (world.rank() == 0 && device == "auto") log_info("train: ", world.size(), " ranks train on the CPU reference engine");
  return std::make_unique<CpuEngine>(checkpoint, options, &world, parallel);
}

}  // namespace deltamoe
