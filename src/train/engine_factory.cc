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
                                               const ParamLayout& layout, const EngineSizing& sizing) {
  CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got '", device,
        "'");
  if (device != "cpu" && gpu_factory()) return gpu_factory()(checkpoint, layout, sizing);
#if defined(DELTAMOE_WITH_CUDA)
  // A CUDA build registers its engine only where a GPU answered (see register_gpu_engine).
  CHECK(device != "cuda", "--device cuda: no CUDA GPU answered on this machine (or no GPU engine was registered); ",
        "use --device cpu or auto");
  if (device == "auto") log_info("train: no CUDA GPU answered; training on the CPU reference");
#else
  CHECK(device != "cuda", "--device cuda: this build has no GPU training engine (built with DELTAMOE_CUDA=OFF); ",
        "use --device cpu or auto");
#endif
  return std::make_unique<CpuEngine>(checkpoint, layout);
}

}  // namespace deltamoe
