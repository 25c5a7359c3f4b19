// Saving and restoring a training state bitwise for --resume: the fp32 master weights and Adam
// moments of every trained piece (tensor, element range), the Adam step and the schedule position,
// in one safetensors-compatible file with a checksum per record. Streamed: at most one bounded
// piece of host memory at a time, whatever the model size. Format: docs/optimizer.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optim/train_state.h"

namespace deltamoe {

// Where the run stands besides the moments (the trainer owns these counters).
struct OptimizerProgress {
  int64_t schedule_step = 0;  // optimizer steps taken, applied or skipped = next index into LrSchedule
  int64_t skipped_steps = 0;  // steps skipped because the gradient norm was not finite
};

// Bytes save_optimizer_state writes for this state (header included), for the free-space check.
uint64_t optimizer_state_file_bytes(const TrainStateStore& state);

// Writes path atomically (a temporary file, fsynced, renamed into place). Each record is one
// (state kind, piece): "<kind>/<tensor>/<begin>:<end>". Throws deltamoe::Error when the file cannot
// be written; the temporary file is removed then.
void save_optimizer_state(const std::string& path, const TrainStateStore& state, const OptimizerProgress& progress);

// Reads a file written by save_optimizer_state into state. Every piece of state.layout() is filled
// from the file's records of the same tensor (any split of the tensors into pieces restores, as
// long as the records cover the piece), and the file must hold the same tensors with the same
// shapes and decay flags and the same moment dtype. Truncated, corrupt or mismatched files give a
// deltamoe::Error that names the file and what is wrong; the state may then be partly overwritten
// and must not be used. Changed AdamW hyper-parameters are allowed (a resumed run may change them)
// and logged. trained: every tensor the run trains, when state holds pieces of only some of them (one
// rank of several; the file may then hold tensors this rank does not); null: state's own layout.
OptimizerProgress load_optimizer_state(const std::string& path, TrainStateStore* state,
                                       const ParamLayout* trained = nullptr);

// The same from the files of one save on several ranks (each rank's pieces in its own file, replicas
// possibly repeated): every piece of state is filled from whichever files hold it, all files must
// be at the same step, and every element must be found in one of them.
OptimizerProgress load_optimizer_state_files(const std::vector<std::string>& paths, TrainStateStore* state,
                                             const ParamLayout* trained = nullptr);

}  // namespace deltamoe
