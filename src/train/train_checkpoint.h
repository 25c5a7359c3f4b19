// Training checkpoints: output_dir/checkpoint-<step>/ holds a Hugging Face model directory (config,
// safetensors shards + index, tokenizer and processor files) plus optimizer.safetensors (moments and
// fp32 master weights) and trainer_state.json (step, data position, RNG) for --resume. A save is
// written under a temporary name and renamed, so a crash never damages the previous checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/model_dir_writer.h"
#include "model/lora/lora_adapters.h"
#include "data/data_position.h"
#include "optim/optimizer_state.h"
#include "optim/train_state.h"

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
  bool model_only = false;    // saved with --save_only_model: no optimizer state, cannot be resumed
};

std::string trainer_state_to_json(const TrainerState& state);
// Throws naming `where` when the text is not a trainer state.
TrainerState trainer_state_from_json(const std::string& text, const std::string& where);

struct CheckpointPayload {
  const ModelCheckpoint* model = nullptr;  // weights to save (trained tensors read from the state)
  // LoRA runs instead: a PEFT adapter directory (checkpoint/peft_adapter.h) with this base model path.
  const LoraAdapters* adapters = nullptr;
  std::string adapter_base_model;
  std::string side_files_dir;              // tokenizer / processor files are copied from here
  uint64_t max_shard_bytes = 5'000'000'000;
  // The training state for --resume; null writes the model directory only (--save_only_model),
  // marked in trainer_state.json so that --resume refuses it with a message.
  const TrainStateStore* train_state = nullptr;
  OptimizerProgress progress;
  TrainerState state;  // state.model_only: set when rank files are committed without optimizer state
  // Writes the run's own files into the checkpoint folder before it is renamed into place (args.json,
  // generation_config.json, chat_template.jinja: train/run_args.h, train/hf_side_files.h).
  std::function<void(const std::string& dir)> write_extra_files;
  // Several ranks: the model files are created from this layout (config, index, each safetensors
  // file at its size with its header) instead of written from `model`, and instead of train_state
  // every rank writes its byte ranges of them and its own optimizer_rank_file into the temporary
  // folder in rank_files_commit; it runs after the files are created and before
  // trainer_state.json, and returns only once every rank has reported its part written and synced
  // (it throws otherwise, and nothing is renamed into place). The free space is then checked by
  // the caller for every rank (train/rank_checkpoint.h), not here.
  const ModelDirLayout* model_layout = nullptr;
  std::function<void(const std::string& dir)> rank_files_commit;
};

// The optimizer state of rank r of a save on `world` ranks: "optim-r<r>-of-<world>.safetensors".
std::string optimizer_rank_file(int rank, int world);

// The temporary folder a save of `step` writes into (renamed to checkpoint-<step> at its commit).
std::string checkpoint_temp_dir(const std::string& output_dir, int64_t step);

// Restores the optimizer state of checkpoint dir into state (optimizer.safetensors, or the
// per-rank files of a save on several ranks); trained: as load_optimizer_state's.
OptimizerProgress load_checkpoint_optimizer(const std::string& dir, TrainStateStore* state,
                                            const ParamLayout* trained = nullptr);

// Bytes a save of payload writes on one rank (model shards, side files, optimizer state), for the
// free-space check before it starts.
uint64_t checkpoint_bytes(const CheckpointPayload& payload);
// Bytes of the side files (tokenizer, processor configs: not weights) copied from dir.
uint64_t side_files_bytes(const std::string& dir);
// "" when output_dir's file system has `needed` bytes free, else the message refusing the save of
// `step` (DELTAMOE_TEST_FREE_BYTES=<n> pretends n bytes are free). with_optimizer adds the hint
// to save the model only.
std::string checkpoint_free_space_problem(const std::string& output_dir, int64_t step, uint64_t needed,
                                          bool with_optimizer);

// Writes output_dir/checkpoint-<state.global_step> through output_dir/.checkpoint-<step>.tmp and a
// rename; returns the final path. Files and directories are fsync'ed around the renames. Before any
// byte is written the free space of output_dir is checked against checkpoint_bytes (a shortfall is
// an error naming both numbers); a save that fails removes its temporary directory and leaves the
// previous checkpoints as they were. Test
// hooks: DELTAMOE_FAIL_SAVE_AT_STEP=<step> ends the process abruptly after the model files of that
// step's save are written (a kill in the middle of a save); DELTAMOE_KILL_AT=<phase>@<step>
// (core/kill_point.h) kills it at save_optimizer, save_state, save_aside or save_renamed.
std::string save_training_checkpoint(const std::string& output_dir, const CheckpointPayload& payload);

// "auto": the checkpoint-N with the largest N in output_dir that passes checkpoint_problem; a
// newer damaged one is skipped with a warning that says why (throws when none is usable).
// Otherwise dir itself. Either way recover_interrupted_saves(output_dir) runs first.
std::string resolve_resume_dir(const std::string& resume, const std::string& output_dir);

// Undoes what a save or --save_total_limit removal killed half-way leaves in output_dir: a
// .checkpoint-N.old whose checkpoint-N is missing is renamed back (else deleted), and
// .checkpoint-N.tmp / .removing folders are deleted. Call only while holding the RunLock.
void recover_interrupted_saves(const std::string& output_dir);

// Why dir cannot be resumed from, or "" when it looks complete: trainer_state.json parses,
// config.json is there, and every safetensors file (model shards, optimizer state) has a header
// that fits its file (a truncated or half-copied file fails). The bytes themselves are checked on
// load (the optimizer state's checksums, the weights' NaN/Inf scan).
std::string checkpoint_problem(const std::string& dir);

// Deletes all but the newest `keep` complete checkpoint-N directories of output_dir (--save_total_limit).
void remove_old_checkpoints(const std::string& output_dir, int64_t keep);

// Reads dir/trainer_state.json.
TrainerState load_trainer_state(const std::string& dir);

}  // namespace deltamoe
