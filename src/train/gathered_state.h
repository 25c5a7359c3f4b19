// The whole training state of a job gathered onto rank 0, so that a run on several ranks writes the
// same model directory as one rank holding the same weights (byte for byte). Every rank sends its
// pieces (tensor, element range) with their master and moments; rank 0 needs memory for the full
// state (the CPU engine's scale; each rank writing its own byte ranges replaces this for large
// models). The optimizer state itself is written per rank (train/train_checkpoint.h).
#pragma once

#include <memory>

#include "optim/host_train_state.h"
#include "parallel/communicator.h"

namespace deltamoe {

// Collective over world. full: every trained tensor whole (the layout a single rank would have);
// every element of it must be held by at least one rank (checked on rank 0; replicas hold identical
// values). Returns the full state on rank 0 and nullptr elsewhere.
std::unique_ptr<HostTrainState> gather_train_state(Communicator& world, const TrainStateStore& mine,
                                                   const ParamLayout& full);

}  // namespace deltamoe
