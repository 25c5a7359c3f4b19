// Picks the engine a run computes with: the CPU reference, or the GPU engine once it is registered.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "optim/param_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

using TrainEngineFactory = std::function<std::unique_ptr<TrainEngine>(
    const ModelCheckpoint& checkpoint, const ParamLayout& layout, const EngineSizing& sizing)>;

// The hook for the GPU engine. src/train/gpu sits above src/train in the layering (it uses the
// trainer's types), so it cannot be called from here directly: the CUDA build registers its
// factory at start-up when a GPU answers (register_gpu_engine, called by `deltamoe train`) and
// make_train_engine uses it for "auto" and "cuda".
void register_gpu_train_engine(TrainEngineFactory factory);

// device: "auto" (the registered GPU engine if any, else the CPU), "cpu" or "cuda". Throws, naming
// --device, for a device this build or machine cannot run on. sizing: see EngineSizing.
std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const ParamLayout& layout, const EngineSizing& sizing = {});

}  // namespace deltamoe
