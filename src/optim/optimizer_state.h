// Saving and restoring the optimizer state bitwise for --resume: Adam moments, the Adam step,
// the schedule position and (optionally) the fp32 master weights, in one safetensors-compatible
// file with per-tensor checksums. Format: docs/optimizer.md.
#pragma once

#include <cstdint>
#include <string>

#include "optim/adamw.h"

namespace deltamoe {

// Where the run stands besides the moments (the trainer owns these counters).
struct OptimizerProgress {
  int64_t schedule_step = 0;  // optimizer steps taken, applied or skipped = next index into LrSchedule
  int64_t skipped_steps = 0;  // steps skipped because the gradient norm was not finite
};

// Writes path atomically (a temporary file renamed into place). master, when not null, holds
// optimizer.range().size() fp32 master weights and is stored as "master_weights".
// Throws deltamoe::Error when the file cannot be written.
void save_optimizer_state(const std::string& path, const AdamW& optimizer, const OptimizerProgress& progress,
                          const float* master);

// Reads a file written by save_optimizer_state into optimizer (moments and Adam step) and, when
// master is not null, the master weights (range().size() values). The file must have been
// written for the same parameter layout, range and moment dtype. Truncated, corrupt or
// mismatched files give a deltamoe::Error that names the file and what is wrong; in that case
// optimizer and master may be partly overwritten and must not be used. Differences in the
// AdamW hyper-parameters are allowed (a resumed run may change them) and are logged.
OptimizerProgress load_optimizer_state(const std::string& path, AdamW* optimizer, float* master);

}  // namespace deltamoe
