// Up-front validation of the training options: every message names the flag and the value.
#include "train/train_options.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "checkpoint/hub_cache.h"
#include "core/error.h"
#include "data/sample_source.h"
#include "train/batch_plan.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

// Upper bounds that keep sizes far from overflow and memory from running away; each is orders of
// magnitude past any real run (Qwen3.5 context: 262,144 tokens).
constexpr int64_t kMaxTokens = int64_t{1} << 24;       // --max_length, --micro_batch_tokens
constexpr int64_t kMaxAccumulation = int64_t{1} << 16;  // micro-batches held for one step
constexpr int64_t kMaxBatchSamples = int64_t{1} << 24;  // --global_batch_size, --micro_batch_size
constexpr int64_t kMaxEpochs = 1'000'000;
constexpr int64_t kMaxWorkers = 256;
constexpr int64_t kMaxImagePixels = int64_t{1} << 30;  // --min/max_pixels, --max_decoded_pixels

void check_range(const char* flag, int64_t value, int64_t low, int64_t high) {
  CHECK(value >= low && value <= high, flag, " must be in [", low, ", ", high, "], got ", value);
}

// lr 1 is already far past what AdamW fine-tuning uses (1e-6 .. 1e-3); larger values only explode.
void check_numbers(const TrainOptions& o) {
  CHECK(std::isfinite(o.schedule.lr) && o.schedule.lr > 0 && o.schedule.lr <= 1.0,
        "--lr must be in (0, 1] (fine-tuning uses 1e-6 .. 1e-3), got ", o.schedule.lr);
  CHECK(std::isfinite(o.max_grad_norm), "--max_grad_norm must be a number (<= 0: no clipping), got ", o.max_grad_norm);
  CHECK(std::isfinite(o.peak_tflops) && o.peak_tflops >= 0, "--peak_tflops must be >= 0, got ", o.peak_tflops);
  CHECK(!o.router_aux_loss_coef || (std::isfinite(*o.router_aux_loss_coef) && *o.router_aux_loss_coef >= 0),
        "--router_aux_loss_coef must be >= 0, got ", o.router_aux_loss_coef.value_or(0));
  check_range("--max_length", o.max_length, 1, kMaxTokens);
  check_range("--micro_batch_tokens", o.micro_batch_tokens, 0, kMaxTokens);
  check_range("--gradient_accumulation_steps", o.gradient_accumulation_steps, 0, kMaxAccumulation);
  check_range("--global_batch_size", o.global_batch_size, 0, kMaxBatchSamples);
  check_range("--micro_batch_size", o.micro_batch_size, 0, kMaxBatchSamples);
  if (o.max_steps <= 0) check_range("--num_train_epochs", o.num_train_epochs, 1, kMaxEpochs);
  check_range("--dataloader_num_workers", o.num_workers, 0, kMaxWorkers);
  check_range("--min_pixels", o.min_pixels, 0, kMaxImagePixels);
  check_range("--max_pixels", o.max_pixels, 0, kMaxImagePixels);
  check_range("--max_decoded_pixels", o.max_decoded_pixels, 1, kMaxImagePixels);
  CHECK(std::isfinite(o.max_skip_ratio) && o.max_skip_ratio >= 0 && o.max_skip_ratio <= 1,
        "--max_skip_ratio must be in [0, 1] (the fraction of lines a run may skip), got ", o.max_skip_ratio);
  for (const std::string& target : o.report_to) {
    CHECK(target == "tensorboard" || target == "none", "--report_to ", target,
          " is not supported: deltamoe writes tensorboard event files (or none); metrics.jsonl is always written");
  }
  CHECK(o.max_nonfinite_steps >= 0, "--max_nonfinite_steps must be >= 0 (0: never stop), got ", o.max_nonfinite_steps);
}

}  // namespace

void validate_train_options(const TrainOptions& options) {
  CHECK(!options.model_dir.empty(), "--model is required");
  CHECK(fs::is_regular_file(fs::path(options.model_dir) / "config.json"), "--model ", options.model_dir,
        ": not a model directory (no config.json there)");
  CHECK(fs::exists(fs::path(options.model_dir) / "tokenizer.json"), "--model ", options.model_dir,
        ": has no tokenizer.json (training renders chats with the model's tokenizer)");
  CHECK(!options.dataset_paths.empty(), "--dataset is required (one or more JSONL files, comma separated)");
  for (const auto* list : {&options.dataset_paths, &options.val_dataset_paths}) {
    const char* flag = list == &options.dataset_paths ? "--dataset" : "--val_dataset";
    for (const std::string& spec : *list) {
      const std::string path = parse_dataset_spec(spec).path;  // "data.jsonl#500" takes 500 samples of it
      // ms-swift also takes hub datasets ('AI-ModelScope/LaTeX_OCR:human_handwrite#2000'); deltamoe reads files.
      const bool hub_like = path.find(':') != std::string::npos || looks_like_hub_id(path);
      CHECK(fs::exists(path) || !hub_like || path.find('/') == 0, flag, ": '", spec,
            "' is not a file here; deltamoe reads local JSONL / JSON files (a hub dataset id? download it, e.g. ",
            "`modelscope download --dataset ", path.substr(0, path.find(':')), " --local_dir DIR`, and give its files)");
      CHECK(fs::exists(path), flag, ": no such file '", path, "'");
      CHECK(!fs::is_directory(path), flag, ": '", path, "' is a directory; give JSONL files (comma separated)");
      CHECK(fs::is_regular_file(path), flag, ": '", path, "' is not a regular file (a device or FIFO?); give JSONL files");
    }
  }
  CHECK(options.split_dataset_ratio >= 0 && options.split_dataset_ratio < 1,
        "--split_dataset_ratio must be in [0, 1), got ", options.split_dataset_ratio);
  CHECK(options.split_dataset_ratio == 0 || options.val_dataset_paths.empty(),
        "give --val_dataset or --split_dataset_ratio, not both");
  CHECK(!options.output_dir.empty(), "--output_dir is required");
  CHECK(!fs::exists(options.output_dir) || fs::is_directory(options.output_dir), "--output_dir ",
        options.output_dir, " exists and is not a directory");
  CHECK(fs::weakly_canonical(options.output_dir) != fs::weakly_canonical(options.model_dir),
        "--output_dir must differ from --model (checkpoints would overwrite the input model)");
  CHECK(options.schedule.lr > 0, "--lr must be positive, got ", options.schedule.lr);
  check_numbers(options);
  // The schedule's own checks; an epoch-based run's step count is known only after a pass over the
  // data, so until then any count will do for the flags that do not depend on it.
  LrScheduleConfig schedule = options.schedule;
  schedule.total_steps = options.max_steps > 0 ? options.max_steps : std::max<int64_t>(1, schedule.warmup_steps);
  validate_lr_schedule(schedule);
  validate_adamw_config(options.adamw);
  CHECK(options.max_steps > 0 || options.num_train_epochs > 0, "--num_train_epochs must be positive (or give ",
        "--max_steps), got ", options.num_train_epochs);
  CHECK(options.max_length > 0, "--max_length must be positive, got ", options.max_length);
  plan_batches(options);  // batch-size flags agree with each other
  CHECK(options.micro_batch_tokens >= 0, "--micro_batch_tokens must be >= 0, got ", options.micro_batch_tokens);
  CHECK(options.micro_batch_tokens == 0 || options.micro_batch_tokens >= options.max_length,
        "--micro_batch_tokens (", options.micro_batch_tokens, ") must be at least --max_length (", options.max_length,
        ") so that every sample fits a micro-batch");
  CHECK(options.save_steps >= 0, "--save_steps must be >= 0, got ", options.save_steps);
  CHECK(options.save_total_limit >= 0, "--save_total_limit must be >= 0, got ", options.save_total_limit);
  CHECK(options.eval_steps >= 0, "--eval_steps must be >= 0, got ", options.eval_steps);
  CHECK(options.eval_steps == 0 || !options.val_dataset_paths.empty() || options.split_dataset_ratio > 0,
        "--eval_steps needs --val_dataset or --split_dataset_ratio");
  CHECK(options.logging_steps >= 1, "--logging_steps must be >= 1, got ", options.logging_steps);
  CHECK(options.stop_after_steps >= 0, "--stop_after_steps must be >= 0");
  CHECK(options.num_workers >= 0, "--dataloader_num_workers must be >= 0");
  CHECK(!options.router_aux_loss_coef || *options.router_aux_loss_coef >= 0,
        "--router_aux_loss_coef must be >= 0, got ", *options.router_aux_loss_coef);
  CHECK(options.min_pixels >= 0 && options.max_pixels >= 0, "--min_pixels / --max_pixels must be >= 0");
  CHECK(options.max_pixels == 0 || options.min_pixels <= options.max_pixels, "--min_pixels (", options.min_pixels,
        ") exceeds --max_pixels (", options.max_pixels, ")");
  if (!options.resume.empty() && options.resume != "auto") {
    CHECK(fs::is_regular_file(fs::path(options.resume) / "trainer_state.json"), "--resume ", options.resume,
          ": not a training checkpoint (no trainer_state.json); give a checkpoint-N directory or 'auto'");
  }
}

}  // namespace deltamoe
