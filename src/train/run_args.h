// args.json: a run's resolved options, written into the run folder at the start and into every
// checkpoint, and compared on --resume: options that would break an exact continuation (learning
// rate, batch, data, seed, ...) are refused unless --ignore_args_check; the others are listed.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "train/train_options.h"

namespace deltamoe {

// Every option under its flag name, with the version of deltamoe that ran it; the batch as resolved
// (micro-batch samples, accumulation, token budget), so that equal batches read equal however they
// were written. The checkpoint copy keeps only the options that decide what is trained (not where
// the run writes, how often it reports or saves, --resume, thread counts): a checkpoint holds what
// produced it, and one written after a resume stays byte for byte the uninterrupted run's.
enum class RunArgsCopy { kRunFolder, kCheckpoint };
nlohmann::ordered_json train_options_to_json(const TrainOptions& options, RunArgsCopy copy = RunArgsCopy::kRunFolder);

// dir/args.json (through a temporary file and a rename, so a kill leaves the old or the new one).
void write_run_args(const std::string& dir, const std::string& options_json);

struct ArgsChanges {
  std::vector<std::string> breaking;  // "--lr 1e-05 -> 0.0002"
  std::vector<std::string> harmless;  // "--logging_steps 1 -> 5"
};
// Options that differ between a checkpoint's args.json and this run; keys only one side has are
// compared with null.
ArgsChanges compare_run_args(const nlohmann::ordered_json& saved, const nlohmann::ordered_json& now);

// --resume: reads checkpoint_dir/args.json and throws, listing every changed option that breaks
// exactness, unless options.ignore_args_check (then warns); harmless changes are logged. A
// checkpoint without args.json (an older deltamoe) is resumed with a warning.
void check_resume_args(const std::string& checkpoint_dir, const TrainOptions& options);

}  // namespace deltamoe
