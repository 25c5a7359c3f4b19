// Everything `deltamoe train` is told (flags or a config file), with ms-swift / Megatron names, and
// the checks that run before any work starts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "tokenizer/chat_template.h"
#include "model/lora/lora.h"
#include "train/parallel_layout.h"
#include "train/recompute_options.h"
#include "train/trainable_params.h"

namespace deltamoe {

struct TrainOptions {
  std::string model_dir;                       // --model: Hugging Face model directory
  std::vector<std::string> dataset_paths;      // --dataset a.jsonl[,b.jsonl]
  std::vector<std::string> val_dataset_paths;  // --val_dataset (empty: no evaluation)
  double split_dataset_ratio = 0;              // > 0: validation split of --dataset instead
  std::string output_dir;                      // --output_dir

  LrScheduleConfig schedule;  // --lr --min_lr --warmup_ratio --warmup_steps; total_steps filled by the trainer
  AdamWConfig adamw;          // --weight_decay --adam_beta1 --adam_beta2 --adam_epsilon --optimizer_state_dtype
  DType expert_grad_dtype = DType::bf16;  // --expert_grad_dtype
  double max_grad_norm = 1.0;
  int64_t max_steps = -1;         // > 0 overrides num_train_epochs
  int64_t num_train_epochs = 1;
  // The global batch, in samples (--global_batch_size / --micro_batch_size) or in tokens
  // (--gradient_accumulation_steps packed micro-batches of --micro_batch_tokens); see batch_plan.h.
  int64_t global_batch_size = 0;            // samples per optimizer step (0: not counted in samples)
  int64_t micro_batch_size = 0;             // samples per micro-batch (0: 1 with --global_batch_size)
  int64_t gradient_accumulation_steps = 0;  // micro-batches per optimizer step (0: derived, else 1)
  int64_t micro_batch_tokens = 0;           // packing budget of one micro-batch; 0: max_length
  int64_t data_parallel_size = 1;           // ranks sharing the global batch (the trainer sets the world size)
  ParallelOptions parallel;                 // --expert_model_parallel_size, --use_distributed_optimizer
  RecomputeOptions recompute;               // --recompute (auto by default), Megatron's --recompute_* flags
  int64_t max_length = 2048;
  bool truncate = false;  // --truncation_strategy right (true) or delete (false)
  int64_t save_steps = 0;     // 0: save only at the end
  int64_t save_total_limit = 0;  // > 0: keep only the newest N checkpoints
  int64_t eval_steps = 0;     // 0: evaluate only at the start and the end
  int64_t logging_steps = 1;
  uint64_t seed = 42;
  FreezeOptions freeze;
  std::string tuner_type = "full";  // --tuner_type: full or lora
  LoraOptions lora;                 // --lora_rank, --target_modules, ... (tuner_type lora)
  std::optional<double> router_aux_loss_coef;  // default: the model config's
  std::string resume;          // "": fresh run; a checkpoint directory; "auto": newest in output_dir
  int64_t stop_after_steps = 0;  // > 0: end this process after that many steps (as if preempted)
  int num_workers = 2;
  int64_t min_pixels = 0, max_pixels = 0;  // 0: preprocessor_config.json's (or the Qwen3.5 defaults)
  int64_t max_decoded_pixels = 178'956'970;  // larger images are skipped unread (PIL's MAX_IMAGE_PIXELS)
  // Consecutive steps with a non-finite loss or gradient norm after which the run stops with an
  // error, saving nothing (0: never stop; such steps are skipped either way).
  int64_t max_nonfinite_steps = 5;
  bool overwrite_output_dir = false;  // a fresh run may replace the checkpoints and metrics found there
  uint64_t max_shard_bytes = 5'000'000'000;
  bool save_only_model = false;  // --save_only_model: checkpoints hold the model directory only (no resume)
  double peak_tflops = 0;  // --peak_tflops: the device's peak for MFU (0: by GPU name, see train_metrics.h)

  // Data (docs/data.md).
  std::string media_dir;          // --media_dir: root of relative image paths ("": working directory, then the file's folder)
  bool strict = false;            // --strict: the first skipped line stops the run
  double max_skip_ratio = 0.05;   // more skipped lines than this fraction stop the run before step 1
  ChatFormat chat_format = ChatFormat::kQwen35;  // the renderer (--template, or the model's own template)
  bool add_non_thinking_prefix = false;  // a think block on every assistant turn (ms-swift's training default)

  // Run records (docs/training.md, "Run records").
  std::vector<std::string> report_to;  // --report_to tensorboard: event files in logging_dir
  std::string logging_dir;             // "": OUTPUT_DIR/runs
  bool ignore_args_check = false;      // --resume with options that break exactness is allowed
  bool plot = true;                    // write OUTPUT_DIR/images/training.png at the end
};

// Checks values and paths (model dir with config.json, dataset files, output dir writable) and
// throws an error that names the flag and, for numbers, the allowed range. Runs before the model is
// loaded.
void validate_train_options(const TrainOptions& options);

}  // namespace deltamoe

namespace deltamoe {

// What a command line gives in other units or leaves to the model folder, resolved into
// TrainOptions by resolve_train_options before validation.
struct TrainOptionsRequest {
  std::string template_name;     // --template ("": decided by the model's own chat template)
  int64_t image_max_tokens = 0;  // --image_max_token_num / IMAGE_MAX_TOKEN_NUM (0: not given)
  int64_t image_min_tokens = 0;  // IMAGE_MIN_TOKEN_NUM (0: not given)
  int64_t spatial_merge_size = 0;  // SPATIAL_MERGE_SIZE (0: not given); must equal config.json's
  bool add_version = false;      // --add_version: the run writes into OUTPUT_DIR/vN-YYYYMMDD-HHMMSS
};

// A hub id in --model becomes its folder in the local caches (checkpoint/hub_cache.h); max_length
// 0 becomes the model's max_position_embeddings; the chat format comes from --template or the
// model's template (refused when deltamoe's renderer is not known to reproduce it); image token
// caps become pixel bounds ((patch x merge)^2 pixels per token, the tighter of pixels and tokens
// wins); --add_version picks the run folder. Throws naming the flag or file.
void resolve_train_options(TrainOptions& options, const TrainOptionsRequest& request);

// The pixel bound of `tokens` image tokens for the model in model_dir: tokens x (patch x merge)^2.
int64_t image_tokens_to_pixels(const std::string& model_dir, int64_t tokens);

}  // namespace deltamoe
