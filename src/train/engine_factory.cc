// Engine selection: the CPU reference always; the GPU engine in CUDA builds where a GPU answers.
#include "train/engine_factory.h"

#include "core/error.h"
#include "core/log.h"
#include "train/cpu_engine.h"
#if DELTAMOE_WITH_CUDA
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

std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const EngineOptions& options, Communicator& world,
                                               const ParallelOptions& parallel) {
  CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got '", device,
        "'");
  CHECK(device != "cuda", "--device cuda: training on ", world.size(), " ranks runs on the CPU reference engine only ",
        "so far (the GPU engine has no parallel step yet); use --device cpu");
  if (world.rank() == 0 && device == "auto") log_info("train: ", world.size(), " ranks train on the CPU reference engine");
  return std::make_unique<CpuEngine>(checkpoint, options, &world, parallel);
}

}  // namespace deltamoe
