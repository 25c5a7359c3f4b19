// The training loop: load the model, pick trainable tensors, stream packed micro-batches, accumulate
// gradients over the global batch through a TrainEngine, step AdamW, report, evaluate, checkpoint,
// and resume bitwise from a checkpoint. One loop for every device (see train_engine.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "parallel/communicator.h"
#include "train/train_engine.h"
#include "train/train_options.h"

namespace deltamoe {

struct TrainSummary {
  int64_t steps_done = 0;     // global step reached
  int64_t total_steps = 0;
  int64_t steps_this_run = 0;
  double first_loss = 0, last_loss = 0;  // training loss of the first / last step of this run
  bool has_val = false;
  double first_val_loss = 0;  // first evaluation of this run (step 0 for a fresh run)
  double last_val_loss = 0;
  double first_val_token_acc = -1, last_val_token_acc = -1;  // -1: not reported by the engine
  std::string last_checkpoint;  // newest checkpoint directory written
  double elapsed_s = 0;         // this run
  std::string device;
  std::string data_skips;  // "0 skipped" or the reasons with counts
  int stopped_by_signal = 0;  // SIGTERM / SIGINT that ended the run early (checkpoint saved), or 0
  // GPU engine only (negative: not reported): model FLOPs of this run's steps over their time
  // against the peak, and the most device memory in use.
  double mfu = -1;
  double peak_mem_gib = -1;
};

// Makes the engine of a run; tests pass one to run the loop on a stand-in engine.
using EngineMaker = std::function<std::unique_ptr<TrainEngine>(const ModelCheckpoint&, const EngineOptions&)>;

// device: see make_train_engine. Throws deltamoe::Error for bad options (before any work) and for
// failures during the run. With a world of several ranks every rank calls this with the same
// options: each trains on micro-batches g * world + rank of every global batch (so the ranks see
// exactly the samples, in the order, of one rank with world times the accumulation), rank 0 alone
// writes the run folder (metrics, records, checkpoints gathered from all ranks) and prints.
TrainSummary run_training(const TrainOptions& options, const std::string& device = "auto",
                          const EngineMaker& make_engine = nullptr, Communicator* world = nullptr);

}  // namespace deltamoe
