// Training checkpoints: output_dir/checkpoint-<step>/ holds a Hugging Face model directory (config,
// safetensors shards + index, tokenizer and processor files) plus optimizer.safetensors (moments and
// fp32 master weights) and trainer_state.json (step, data position, RNG) for --resume. A save is
// written under a temporary name and renamed, so a crash never damages the previous checkpoint.
#pragma once

#include <cstdint>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "data/data_position.h"
#include "optim/optimizer_state.h"

namespace deltamoe {

// The trainer's own counters, saved next to the optimizer state.
struct TrainerState {
  int64_t global_step = 0;   // optimizer steps done
  int64_t total_steps = 0;   // of the whole run (the schedule's N)
  int64_t tokens_seen = 0;
  double elapsed_s = 0;      // training wall time so far (for ETA and tokens/s after a resume)
  DataPosition data_position;
  uint64_t rng_seed = 0;      // the trainer's Philox stream (reserved for dropout-like randomness)
  uint64_t rng_position = 0;
};

std::string trainer_state_to_json(const TrainerState& state);
// Throws naming `where` when the text is not a trainer state.
TrainerState trainer_state_from_json(const std::string& text, const std::string& where);

struct CheckpointPayload {
  const ModelCheckpoint* model = nullptr;  // weights to save (trainable tensors already from master)
  std::string side_files_dir;              // tokenizer / processor files are copied from here
  uint64_t max_shard_bytes = 5'000'000'000;
  const AdamW* optimizer = nullptr;
  OptimizerProgress progress;
  const float* master = nullptr;
  TrainerState state;
};

// Writes output_dir/checkpoint-<state.global_step> through output_dir/.checkpoint-<step>.tmp and a
// rename; returns the final path. Test hook: DELTAMOE_FAIL_SAVE_AT_STEP=<step> ends the process
// abruptly after the model files of that step's save are written (a kill in the middle of a save).
std::string save_training_checkpoint(const std::string& output_dir, const CheckpointPayload& payload);

// "auto": the complete checkpoint-N with the largest N in output_dir (throws when there is none);
// otherwise dir itself.
std::string resolve_resume_dir(const std::string& resume, const std::string& output_dir);

// Deletes all but the newest `keep` complete checkpoint-N directories of output_dir (--save_total_limit).
void remove_old_checkpoints(const std::string& output_dir, int64_t keep);

// Reads dir/trainer_state.json.
TrainerState load_trainer_state(const std::string& dir);

}  // namespace deltamoe
