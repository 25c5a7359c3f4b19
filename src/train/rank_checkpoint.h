// What each rank of a job writes of a checkpoint: its own byte ranges of the Hugging Face model
// files (the directory is byte for byte what one rank saving the same weights writes), and the
// free-space check before a save that counts what every rank will write.
//
// Ownership of the model bytes: a trained tensor's elements are written by the rank whose training
// state holds them (experts by their owner, the first replica when expert blocks are replicated;
// dense elements by their ZeRO-2 piece owner); every other tensor (frozen, passthrough) by rank
// (its index in the file layout) mod world, read from the base model. Rank 0 creates the files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/model_dir_writer.h"
#include "parallel/communicator.h"
#include "train/train_engine.h"

namespace deltamoe {

struct RankModelShare {
  ModelCheckpoint weights;              // base with the trained tensors reading this rank's pieces
  ModelDirLayout layout;                // the same on every rank
  std::vector<TensorByteRange> ranges;  // this rank's
  uint64_t range_bytes() const;
};

// Collective over world. `state` is this rank's training state, `parallel` its layout (null on one
// rank: it writes everything). Checks, on every rank, that each byte of every tensor is written by
// exactly one rank (an all-reduce of per-tensor byte counts), throwing naming the tensor otherwise.
// The result refers to state and base: keep them alive and unchanged until the save is done.
RankModelShare plan_rank_model_share(Communicator& world, const ModelCheckpoint& base, const TrainStateStore& state,
                                     const ParallelLayout* parallel, const SaveOptions& options);

// Sum of `bytes` over the ranks whose key equals key[rank] (keys: one per rank).
uint64_t bytes_sharing_storage(const std::vector<int64_t>& keys, const std::vector<int64_t>& bytes, int rank);

// Collective over world, before a save of `step` writes anything: every rank checks the free
// space of output_dir (as checkpoint_free_space_problem does) against the bytes of every rank that
// writes to the same file system as far as it can tell (same host and same device number of
// output_dir), and the ranks agree: when any rank lacks space, every rank throws (that one's
// message names the numbers). with_optimizer: the save writes optimizer state (for the hint).
void check_save_space_on_ranks(Communicator& world, const std::string& output_dir, int64_t step, uint64_t my_bytes,
                               bool with_optimizer);

}  // namespace deltamoe
