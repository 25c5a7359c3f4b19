// Picks the engine a run computes with: the CPU reference, or the GPU engine of a CUDA build.
#pragma once

#include <memory>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "parallel/communicator.h"
#include "train/parallel_layout.h"
#include "train/train_engine.h"

namespace deltamoe {

// device: "auto" (the GPU engine where a CUDA build finds a GPU, else the CPU), "cpu" or "cuda".
// Throws, naming --device, for a device this build or machine cannot run on.
std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const EngineOptions& options);
// One rank of a job over `world` (several ranks, a host communicator): with --device cuda (or auto
// where every local rank has a GPU) the GPU engine on GPU LOCAL_RANK over an NcclComm made from
// world; else the CPU engine with this layout. LoRA on several ranks runs on the CPU only.
std::unique_ptr<TrainEngine> make_train_engine(const std::string& device, const ModelCheckpoint& checkpoint,
                                               const EngineOptions& options, Communicator& world,
                                               const ParallelOptions& parallel);

}  // namespace deltamoe
