// Engine selection: the CPU reference always; the GPU engine when a CUDA build registered one.
#include "train/engine_factory.h"

#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "train/cpu_engine.h"

namespace deltamoe {

namespace {

TrainEngineFactory& gpu_factory() {
  static TrainEngineFactory factory;
  return factory;
}

}  // namespace

void register_gpu_train_engine(TrainEngineFactory factory) { gpu_factory() = std::move(factory); }

std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const ParamLayout& layout) {
  CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got '", device,
        "'");
  if (device != "cpu" && gpu_factory()) return gpu_factory()(checkpoint, layout);
  CHECK(device != "cuda", "--device cuda: this build has no GPU training engine yet; use --device cpu or auto");
#if defined(DELTAMOE_WITH_CUDA)
  if (device == "auto") log_info("train: no GPU training engine is registered yet; training on the CPU reference");
#endif
  return std::make_unique<CpuEngine>(checkpoint, layout);
}

}  // namespace deltamoe
