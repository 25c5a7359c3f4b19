// Engine selection. GPU hook: when the CUDA engine lands, "auto" and "cuda" construct it here
// (same TrainEngine interface: forward_backward into the flat gradient buffer).
#include "train/engine_factory.h"

#include "core/error.h"
#include "core/log.h"
#include "train/cpu_engine.h"

namespace deltamoe {

std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const ParamLayout& layout) {
  CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got '", device,
        "'");
  CHECK(device != "cuda", "--device cuda: the GPU training engine is not part of this build yet; use --device cpu ",
        "or auto");
#if defined(DELTAMOE_WITH_CUDA)
  if (device == "auto") log_info("train: the GPU engine is not available yet; training on the CPU reference");
#endif
  return std::make_unique<CpuEngine>(checkpoint, layout);
}

}  // namespace deltamoe
