// Training checkpoints written atomically (temporary directory + rename) and found again for --resume.
#include "train/train_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "checkpoint/model_dir_writer.h"
#include "checkpoint/peft_adapter.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded.h"
#include "core/error.h"
#include "core/fs_sync.h"
#include "core/kill_point.h"
#include "core/log.h"
#include "core/units.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "deltamoe.trainer_state";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kOptimizerFile = "optimizer.safetensors";

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  CHECK(out.good(), "writing ", path.string(), " failed (disk full or not writable?)");
}

std::string gib_text(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f GiB", gib(bytes));
  return text;
}

// The step of a "checkpoint-N" directory name, or -1.
int64_t checkpoint_step(const std::string& name) {
  const std::string prefix = "checkpoint-";
  if (!name.starts_with(prefix) || name.size() == prefix.size()) return -1;
  int64_t step = 0;
  for (char c : name.substr(prefix.size())) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

// The per-rank optimizer files of dir (a save on several ranks), all `world` of them, in rank order;
// empty when dir has none. Throws naming the missing rank when the set is incomplete.
std::vector<std::string> rank_optimizer_files(const fs::path& dir) {
  int world = 0;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    int r = 0, n = 0;
    if (std::sscanf(name.c_str(), "optim-r%d-of-%d.safetensors", &r, &n) == 2 && n > 0) world = std::max(world, n);
  }
  std::vector<std::string> files;
  for (int r = 0; r < world; ++r) {
    const fs::path path = dir / optimizer_rank_file(r, world);
    CHECK(fs::is_regular_file(path), dir.string(), ": the optimizer state of rank ", r, " of ", world, " (",
          path.filename().string(), ") is missing");
    files.push_back(path.string());
  }
  return files;
}

}  // namespace

std::string optimizer_rank_file(int rank, int world) {
  return str_cat("optim-r", rank, "-of-", world, ".safetensors");
}

std::string checkpoint_temp_dir(const std::string& output_dir, int64_t step) {
  return (fs::path(output_dir) / str_cat(".checkpoint-", step, ".tmp")).string();
}

OptimizerProgress load_checkpoint_optimizer(const std::string& dir, TrainStateStore* state, const ParamLayout* trained) {
  const fs::path single = fs::path(dir) / kOptimizerFile;
  if (fs::is_regular_file(single)) return load_optimizer_state(single.string(), state, trained);
  const std::vector<std::string> files = rank_optimizer_files(dir);
  CHECK(!files.empty(), dir, ": no optimizer state (", kOptimizerFile, " or optim-r*-of-*.safetensors)");
  return load_optimizer_state_files(files, state, trained);
}

std::string trainer_state_to_json(const TrainerState& state) {
  nlohmann::ordered_json json;
  json["format"] = kFormat;
  json["global_step"] = state.global_step;
  json["total_steps"] = state.total_steps;
  json["tokens_seen"] = state.tokens_seen;
  json["elapsed_s"] = state.elapsed_s;
  json["data_position"] = nlohmann::json::parse(data_position_to_json(state.data_position));
  json["rng"] = {{"seed", state.rng_seed}, {"position", state.rng_position}};
  if (state.model_only) json["model_only"] = true;
  return json.dump(2) + "\n";
}

TrainerState trainer_state_from_json(const std::string& text, const std::string& where) {
  TrainerState state;
  try {
    const nlohmann::json json = nlohmann::json::parse(text);
    CHECK(json.value("format", "") == kFormat, where, ": not a deltamoe trainer state (format is not '", kFormat,
          "')");
    state.global_step = json.at("global_step").get<int64_t>();
    state.total_steps = json.at("total_steps").get<int64_t>();
    state.tokens_seen = json.at("tokens_seen").get<int64_t>();
    state.elapsed_s = json.at("elapsed_s").get<double>();
    state.data_position = data_position_from_json(json.at("data_position").dump(), where);
    state.rng_seed = json.at("rng").at("seed").get<uint64_t>();
    state.rng_position = json.at("rng").at("position").get<uint64_t>();
    state.model_only = json.value("model_only", false);
  } catch (const nlohmann::json::exception& error) {
    RAISE(where, ": malformed trainer state: ", error.what());
  }
  CHECK(state.global_step >= 0 && state.global_step <= state.total_steps, where, ": global_step ",
        state.global_step, " is outside [0, total_steps = ", state.total_steps, "]");
  return state;
}

std::string checkpoint_free_space_problem(const std::string& output_dir, int64_t step, uint64_t needed,
                                          bool with_optimizer) {
  std::error_code space_error;
  fs::space_info space = fs::space(output_dir, space_error);
  // Test hook: pretend the file system has this many bytes free.
  if (const char* free_bytes = std::getenv("DELTAMOE_TEST_FREE_BYTES"); free_bytes != nullptr) {
    space.available = std::strtoull(free_bytes, nullptr, 10);
    space_error.clear();
  }
  if (space_error || space.available >= needed) return "";
  return str_cat("save: checkpoint-", step, " needs ", gib_text(needed), " but only ", gib_text(space.available),
                 " are free in ", output_dir, "; free some space, keep fewer checkpoints (--save_total_limit)",
                 with_optimizer ? ", or save the model only (--save_only_model true)" : "");
}

uint64_t side_files_bytes(const std::string& dir) {
  uint64_t bytes = 0;
  std::error_code error;
  if (!dir.empty() && fs::is_directory(dir, error)) {
    for (const auto& entry : fs::directory_iterator(dir, error)) {
      if (entry.is_regular_file(error) && entry.path().extension() != ".safetensors") bytes += entry.file_size(error);
    }
  }
  return bytes;
}

uint64_t checkpoint_bytes(const CheckpointPayload& payload) {
  uint64_t bytes = 1 << 20;  // config, index, trainer state
  if (payload.model != nullptr) {
    for (const auto& [name, tensor] : payload.model->params) bytes += tensor.nbytes() + 256;
  }
  if (payload.adapters != nullptr) {
    for (const auto& [name, tensor] : payload.adapters->tensors) bytes += tensor.nbytes() + 256;
  }
  bytes += side_files_bytes(payload.side_files_dir);
  if (payload.train_state != nullptr) bytes += optimizer_state_file_bytes(*payload.train_state);
  return bytes;
}

std::string save_training_checkpoint(const std::string& output_dir, const CheckpointPayload& payload) {
  CHECK((payload.model != nullptr) != (payload.adapters != nullptr), "save_training_checkpoint: incomplete payload");
  const int64_t step = payload.state.global_step;
  const fs::path final_dir = fs::path(output_dir) / str_cat("checkpoint-", step);
  const fs::path temp_dir = checkpoint_temp_dir(output_dir, step);
  fs::remove_all(temp_dir);  // a leftover of an earlier crash

  // On several ranks the caller has checked every rank's part before (check_save_space_on_ranks).
  if (!payload.rank_files_commit) {
    const std::string problem =
        checkpoint_free_space_problem(output_dir, step, checkpoint_bytes(payload), payload.train_state != nullptr);
    CHECK(problem.empty(), problem);
  }

  TrainerState state = payload.state;
  state.model_only = payload.state.model_only || (payload.train_state == nullptr && !payload.rank_files_commit);
  try {
    fs::create_directories(temp_dir);
    SaveOptions save_options;
    save_options.max_shard_bytes = payload.max_shard_bytes;
    if (payload.adapters != nullptr) {
      save_peft_adapter(temp_dir.string(), *payload.adapters, payload.adapter_base_model);
    } else if (payload.model_layout != nullptr) {
      create_model_dir_files(*payload.model_layout, temp_dir.string());  // the ranks write the bytes
    } else {
      save_model_dir(*payload.model, temp_dir.string(), save_options);
    }
    if (!payload.side_files_dir.empty()) copy_side_files(payload.side_files_dir, temp_dir.string());
    if (payload.write_extra_files) payload.write_extra_files(temp_dir.string());
    kill_point("save_model", step);

    if (const char* fail_at = std::getenv("DELTAMOE_FAIL_SAVE_AT_STEP"); fail_at != nullptr && std::atoll(fail_at) == step) {
      std::fprintf(stderr, "DELTAMOE_FAIL_SAVE_AT_STEP=%s: ending the process in the middle of a save\n", fail_at);
      std::fflush(nullptr);
      std::_Exit(86);
    }

    if (payload.train_state != nullptr) {
      save_optimizer_state((temp_dir / kOptimizerFile).string(), *payload.train_state, payload.progress);
    }
    if (payload.rank_files_commit) payload.rank_files_commit(temp_dir.string());
    kill_point("save_optimizer", step);
    write_text_file(temp_dir / kStateFile, trainer_state_to_json(state));
    fsync_tree(temp_dir.string());  // every byte on disk before the rename makes the checkpoint visible
    kill_point("save_state", step);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(temp_dir, ignored);  // the previous checkpoints stay as they were
    throw;
  }

  // Rename into place. A checkpoint of the same step (a re-run) is moved aside first, so at every
  // moment one complete copy exists under a name --resume auto recognises or can be recovered.
  const fs::path old_dir = fs::path(output_dir) / str_cat(".checkpoint-", step, ".old");
  fs::remove_all(old_dir);
  if (fs::exists(final_dir)) {
    fs::rename(final_dir, old_dir);
    kill_point("save_aside", step);
  }
  fs::rename(temp_dir, final_dir);
  kill_point("save_renamed_unsynced", step);
  fsync_path(output_dir);  // the rename itself
  kill_point("save_renamed", step);
  fs::remove_all(old_dir);
  return final_dir.string();
}

std::string checkpoint_problem(const std::string& dir) {
  try {
    const TrainerState state = load_trainer_state(dir);
    CHECK(!state.model_only, dir, " was saved with --save_only_model: it holds the model weights but no optimizer ",
          "state to resume from");
    if (fs::is_regular_file(fs::path(dir) / kPeftAdapterConfig)) {  // a LoRA run's checkpoint: the adapter
      SafetensorsFile::open((fs::path(dir) / kPeftAdapterWeights).string());
    } else {
      CHECK(fs::is_regular_file(fs::path(dir) / "config.json"), dir, ": config.json is missing");
      open_weights_dir(dir);  // every shard's header, its offsets against the file's size, the index
    }
    if (fs::is_regular_file(fs::path(dir) / kOptimizerFile)) {
      SafetensorsFile::open((fs::path(dir) / kOptimizerFile).string());
    } else {
      const std::vector<std::string> files = rank_optimizer_files(dir);
      CHECK(!files.empty(), dir, ": no optimizer state (", kOptimizerFile, " or optim-r*-of-*.safetensors)");
      for (const std::string& file : files) SafetensorsFile::open(file);
    }
  } catch (const std::exception& error) {
    return error.what();
  }
  return "";
}

void recover_interrupted_saves(const std::string& output_dir) {
  if (!fs::is_directory(output_dir)) return;
  std::vector<fs::path> olds, temps;
  for (const auto& entry : fs::directory_iterator(output_dir)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(".checkpoint-")) continue;
    if (name.ends_with(".old")) olds.push_back(entry.path());
    if (name.ends_with(".tmp") || name.ends_with(".removing")) temps.push_back(entry.path());
  }
  // A kill between moving a same-step checkpoint aside and renaming its replacement into place
  // leaves the complete old copy as .checkpoint-N.old: it goes back under its name.
  for (const fs::path& old : olds) {
    const std::string name = old.filename().string();
    const fs::path restored = fs::path(output_dir) / name.substr(1, name.size() - 5);
    if (checkpoint_step(restored.filename().string()) < 0) continue;
    if (fs::exists(restored)) {
      fs::remove_all(old);  // the rename into place happened; only the deletion was cut short
    } else {
      log_warn("train: restoring ", restored.string(), " from ", old.string(), " (a save was interrupted)");
      fs::rename(old, restored);
    }
  }
  // Never renamed into place, so never a checkpoint: half-written saves and half-done removals.
  for (const fs::path& temp : temps) {
    log_info("train: removing ", temp.string(), " (left by an interrupted save)");
    fs::remove_all(temp);
  }
}

std::string resolve_resume_dir(const std::string& resume, const std::string& output_dir) {
  recover_interrupted_saves(output_dir);
  if (resume != "auto") return resume;
  std::vector<std::pair<int64_t, fs::path>> candidates;
  if (fs::is_directory(output_dir)) {
    for (const auto& entry : fs::directory_iterator(output_dir)) {
      const int64_t step = checkpoint_step(entry.path().filename().string());
      if (step >= 0 && fs::is_regular_file(entry.path() / kStateFile)) candidates.emplace_back(step, entry.path());
    }
  }
  CHECK(!candidates.empty(), "--resume auto: no complete checkpoint-N directory in ", output_dir);
  std::sort(candidates.rbegin(), candidates.rend());
  std::string newest_problem;
  for (const auto& [step, dir] : candidates) {
    const std::string problem = checkpoint_problem(dir.string());
    if (problem.empty()) return dir.string();
    if (newest_problem.empty()) newest_problem = problem;
    log_warn("train: --resume auto: skipping ", dir.string(), ": ", problem);
  }
  RAISE("--resume auto: no checkpoint in ", output_dir, " can be resumed from (", newest_problem, "); the newest is ",
        candidates.front().second.string());
}

void remove_old_checkpoints(const std::string& output_dir, int64_t keep) {
  std::vector<std::pair<int64_t, fs::path>> complete;
  std::vector<fs::path> leftovers;  // of a removal killed half-way
  for (const auto& entry : fs::directory_iterator(output_dir)) {
    const std::string name = entry.path().filename().string();
    const int64_t step = checkpoint_step(name);
    if (step >= 0 && fs::is_regular_file(entry.path() / kStateFile)) complete.emplace_back(step, entry.path());
    if (name.starts_with(".checkpoint-") && name.ends_with(".removing")) leftovers.push_back(entry.path());
  }
  for (const fs::path& leftover : leftovers) fs::remove_all(leftover);
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < complete.size(); ++i) {
    log_info("train: removing ", complete[i].second.string(), " (--save_total_limit ", keep, ")");
    // Renamed first, so that a kill during the deletion never leaves a half checkpoint-N behind.
    const fs::path doomed = fs::path(output_dir) / str_cat(".", complete[i].second.filename().string(), ".removing");
    fs::rename(complete[i].second, doomed);
    kill_point("save_total_limit", complete[i].first);
    fs::remove_all(doomed);
  }
}

TrainerState load_trainer_state(const std::string& dir) {
  const fs::path path = fs::path(dir) / kStateFile;
  std::ifstream in(path, std::ios::binary);
  CHECK(in.good(), "cannot read ", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return trainer_state_from_json(text.str(), path.string());
}

}  // namespace deltamoe
