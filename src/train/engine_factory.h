// Picks the engine a run computes with: the CPU reference now; the GPU engine plugs in here.
#pragma once

#include <memory>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "optim/param_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

// device: "auto" (the GPU when this build has one and the GPU engine exists, else the CPU), "cpu"
// or "cuda". Throws, naming --device, for a device this build cannot run on.
std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const ParamLayout& layout);

}  // namespace deltamoe
