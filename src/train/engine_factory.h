// Picks the engine a run computes with: the CPU reference, or the GPU engine of a CUDA build.
#pragma once

#include <memory>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "train/train_engine.h"

namespace deltamoe {

// device: "auto" (the GPU engine where a CUDA build finds a GPU, else the CPU), "cpu" or "cuda".
// Throws, naming --device, for a device this build or machine cannot run on.
std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const EngineOptions& options);

}  // namespace deltamoe
