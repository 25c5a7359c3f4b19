// `deltamoe train`'s flags (see train_flags.h).
#include "cli/train_flags.h"

#include "cli/expert_recv_flag.h"
#include "cli/flag_compat.h"
#include "cli/grad_dtype_flag.h"
#include "cli/recompute_flags.h"
#include "core/error.h"
#include "core/log.h"

namespace deltamoe {

constexpr ArgKind kInt = ArgKind::kInteger;
constexpr ArgKind kNum = ArgKind::kNumber;

void declare_train_flags(ArgParser& args) {
  args.enable_config_file();
  args.add_required("model", "Hugging Face model directory, or a hub id (ORG/NAME) found in the local HF / "
                    "ModelScope cache");
  args.add_list("dataset", "training data: JSONL or JSON-array files, space or comma separated; FILE#N takes N samples "
                "of it", /*required=*/true);
  args.add_required("output_dir", "where checkpoints, metrics.jsonl, args.json and the plot go");
  args.add_list("val_dataset", "validation data (evaluated at start, every --eval_steps, and at the end)");
  args.add_option("split_dataset_ratio", "fraction of --dataset held out for validation (seeded split written to "
                  "OUTPUT_DIR/dataset_split)", "0", kNum);
  args.add_option("tuner_type", "full (every parameter of the unfrozen parts) or lora (PEFT LoRA adapters, the base "
                  "frozen; docs/lora.md)", "full");
  args.allow_values("tuner_type", {"full", "lora"}, "is not supported: use full or lora");
  args.add_option("lora_rank", "LoRA rank r", "8", kInt);
  args.add_option("lora_alpha", "LoRA alpha: the adapters are scaled by alpha / r (alpha / sqrt(r) with --use_rslora)",
                  "32", kNum);
  args.add_option("lora_dropout", "dropout probability on the adapters' input while training, in [0, 1) (PEFT's "
                  "lora_dropout; not with --target_parameters, which PEFT refuses too)", "0", kNum);
  args.add_bool("use_rslora", "rank-stabilised scaling alpha / sqrt(r)", false);
  args.add_list("target_modules", "Linear modules that get an adapter: all-linear (every nn.Linear of the "
                "transformers model except lm_head, vision tower included, as PEFT resolves it) or module names "
                "matched by suffix (q_proj in_proj_qkv ...)");
  args.add_list("target_parameters", "fused routed-expert weights that get an adapter (PEFT's target_parameters): "
                "mlp.experts.gate_up_proj mlp.experts.down_proj");
  args.add_list("modules_to_save", "modules trained whole next to the adapters (e.g. lm_head embed_tokens)");
  args.add_option("lora_dtype", "dtype of the adapters: float32 (the only choice)", "float32");
  args.add_option("lr", "peak learning rate", "1e-5", kNum);
  args.add_option("min_lr", "learning rate at the end of the cosine decay", "0", kNum);
  args.add_option("warmup_ratio", "fraction of the steps with linear warmup", "0", kNum);
  args.add_option("warmup_steps", "warmup steps (overrides --warmup_ratio when >= 0)", "-1", kInt);
  args.add_option("weight_decay", "AdamW decoupled weight decay (not applied to 1-D tensors)", "0.1", kNum);
  args.add_option("adam_beta1", "AdamW beta1", "0.9", kNum);
  args.add_option("adam_beta2", "AdamW beta2", "0.95", kNum);
  args.add_option("adam_epsilon", "AdamW epsilon", "1e-8", kNum);
  args.add_option("optimizer_state_dtype", "f32 or bf16 Adam moments", "f32");
  declare_expert_grad_dtype_flag(args);
  declare_recompute_flags(args, "auto");
  args.add_option("max_grad_norm", "clip by the global gradient norm (<= 0: off)", "1.0", kNum);
  args.add_option("num_train_epochs", "passes over --dataset (unless --max_steps)", "1", kInt);
  args.add_option("max_steps", "optimizer steps (> 0 overrides --num_train_epochs)", "-1", kInt);
  args.add_option("global_batch_size", "samples per optimizer step over all ranks (default 16 when no batch flag "
                  "is given, as ms-swift)", "0", kInt);
  args.add_option("micro_batch_size", "samples per micro-batch (default 1)", "0", kInt);
  args.add_option("gradient_accumulation_steps", "micro-batches per optimizer step (0: derived from "
                  "--global_batch_size, else 1)", "0", kInt);
  args.add_option("micro_batch_tokens", "token budget of one packed micro-batch (at least --max_length): the batch "
                  "counted in tokens instead of samples", "0", kInt);
  args.add_option("max_length", "longest sample in tokens, image tokens included (default: the model's "
                  "max_position_embeddings)", "0", kInt);
  args.add_option("truncation_strategy", "delete (drop longer samples) or right (cut them)", "delete");
  args.allow_values("truncation_strategy", {"delete", "right"}, "is not supported: use delete (skip, counted) or right");
  args.add_option("save_steps", "save a checkpoint every N steps (0: only at the end)", "0", kInt);
  args.add_option("save_total_limit", "keep only the newest N checkpoints (0: keep all)", "0", kInt);
  args.add_bool("save_only_model", "checkpoints hold the model directory only (no optimizer state, so they cannot be "
                "resumed from)", false);
  args.add_option("eval_steps", "evaluate on --val_dataset every N steps (0: start and end only)", "0", kInt);
  args.add_option("logging_steps", "print the progress line every N steps", "1", kInt);
  args.add_option("expert_model_parallel_size", "ranks the routed experts of each layer are split over (divides "
                  "the ranks of the job; groups of that many consecutive ranks each hold all experts)", "1", kInt);
  declare_expert_recv_headroom_flag(args, "auto");
  args.add_bool("use_distributed_optimizer", "ZeRO-2 for the non-expert parameters: gradients reduce-scattered, "
                "master weights and moments sharded over the ranks (needed on several ranks)", false);
  args.add_option("seed", "seed of the data order, #N draws and the split (and any randomness of the run)", "42", kInt);
  args.add_bool("freeze_vit", "keep the vision tower fixed", true);
  args.add_bool("freeze_aligner", "keep the merger (vision -> text projection) fixed", true);
  args.add_bool("freeze_llm", "keep the language model fixed", false);
  args.add_option("router_aux_loss_coef", "weight of the router load-balancing loss (default: the model config's)",
                  std::nullopt, kNum);
  args.add_option("resume", "a checkpoint-N directory, or 'auto' for the newest in --output_dir", "");
  args.add_bool("ignore_args_check", "--resume even when options that change what is trained differ from the "
                "checkpoint's args.json", false);
  args.add_bool("add_version", "write this run into OUTPUT_DIR/vN-YYYYMMDD-HHMMSS (ms-swift's run folders)", false);
  args.add_option("stop_after_steps", "end this process after N steps, saving a checkpoint (preemption drill)", "0",
                  kInt);
  args.add_option("dataloader_num_workers", "threads that load and tokenize samples", "2", kInt);
  args.add_option("min_pixels", "smallest image area after resizing (default: the processor's; env MIN_PIXELS)", "0",
                  kInt);
  args.add_option("max_pixels", "largest image area after resizing (default: the processor's; env MAX_PIXELS)", "0",
                  kInt);
  args.add_option("image_max_token_num", "most tokens per image (env IMAGE_MAX_TOKEN_NUM): caps --max_pixels at N x "
                  "(patch x merge)^2", "0", kInt);
  args.add_option("max_decoded_pixels", "largest image (width x height as stored) that is decoded; larger ones are "
                  "skipped as decompression bombs (PIL's MAX_IMAGE_PIXELS)", "178956970", kInt);
  args.add_option("media_dir", "root of relative image paths (default: the working directory, then the dataset "
                  "file's folder)", "");
  args.add_bool("strict", "stop at the first dataset line that would be skipped", false);
  args.add_option("max_skip_ratio", "stop before step 1 when more than this fraction of the lines would be skipped",
                  "0.05", kNum);
  args.add_option("template", "chat renderer: qwen3_5 or qwen3 (default: decided by the model's chat template, "
                  "which must be one deltamoe reproduces)", "");
  args.add_bool("add_non_thinking_prefix", "a think block on every assistant turn, as ms-swift trains (default: only "
                "after the last user turn, as the chat template renders)", false);
  args.add_list("report_to", "tensorboard: write TensorBoard event files to --logging_dir (none: nothing)");
  args.add_option("logging_dir", "where TensorBoard event files go (default OUTPUT_DIR/runs)", "");
  args.add_option("max_nonfinite_steps", "stop the run with an error after this many steps in a row with a NaN/Inf "
                  "loss or gradient norm, saving nothing (0: never stop; such steps are skipped)", "5", kInt);
  args.add_bool("overwrite_output_dir", "a fresh run into an --output_dir that holds checkpoints or metrics of an "
                "earlier run deletes them (default: refuse)", false);
  args.add_option("max_shard_size", "largest safetensors shard of a saved checkpoint, in bytes", "5000000000", kInt);
  args.add_option("device", "auto, cpu or cuda", "auto");
  args.add_option("peak_tflops", "the GPU's peak dense bf16 TFLOP/s for the MFU of the progress line (0: by GPU "
                  "name, e.g. 989 for an H100/H200)", "0", kNum);
  add_foreign_flags(args);
}

TrainOptions train_options_from_args(const ArgParser& args, const SwiftEnv& env, TrainOptionsRequest& request) {
  TrainOptions options;
  options.model_dir = args.get("model");
  options.dataset_paths = args.get_list("dataset");
  options.val_dataset_paths = args.get_list("val_dataset");
  options.output_dir = args.get("output_dir");
  options.split_dataset_ratio = args.get_double("split_dataset_ratio");
  options.schedule.lr = args.get_double("lr");
  options.schedule.min_lr = args.get_double("min_lr");
  options.schedule.warmup_ratio = args.get_double("warmup_ratio");
  options.schedule.warmup_steps = args.get_int("warmup_steps");
  options.adamw.weight_decay = args.get_double("weight_decay");
  options.adamw.beta1 = args.get_double("adam_beta1");
  options.adamw.beta2 = args.get_double("adam_beta2");
  options.adamw.eps = args.get_double("adam_epsilon");
  const std::string moments = args.get("optimizer_state_dtype");
  CHECK(moments == "f32" || moments == "bf16", "--optimizer_state_dtype must be f32 or bf16, got '", moments, "'");
  options.adamw.moment_dtype = moments == "bf16" ? DType::bf16 : DType::f32;
  options.expert_grad_dtype = parse_expert_grad_dtype_flag(args);
  options.recompute = parse_recompute_flags(args);
  options.max_grad_norm = args.get_double("max_grad_norm");
  options.num_train_epochs = args.get_int("num_train_epochs");
  options.max_steps = args.get_int("max_steps");
  options.global_batch_size = args.get_int("global_batch_size");
  options.micro_batch_size = args.get_int("micro_batch_size");
  options.gradient_accumulation_steps = args.get_int("gradient_accumulation_steps");
  options.micro_batch_tokens = args.get_int("micro_batch_tokens");
  // ms-swift's default batch: one sample per micro-batch, 16 per step.
  const bool batch_given = args.has("global_batch_size") || args.has("micro_batch_size") ||
                           args.has("gradient_accumulation_steps") || args.has("micro_batch_tokens");
  if (!batch_given) {
    options.micro_batch_size = 1;
    options.global_batch_size = 16;
  }
  options.max_length = args.get_int("max_length");  // 0: the model's maximum (resolve_train_options)
  options.truncate = args.get("truncation_strategy") == "right";
  options.save_steps = args.get_int("save_steps");
  options.save_total_limit = args.get_int("save_total_limit");
  options.save_only_model = args.flag("save_only_model");
  options.eval_steps = args.get_int("eval_steps");
  options.logging_steps = args.get_int("logging_steps");
  const int64_t ep = args.get_int("expert_model_parallel_size");
  CHECK(ep >= 1 && ep <= 4096, "--expert_model_parallel_size must be in [1, 4096], got ", ep);
  options.parallel.expert_parallel_size = static_cast<int>(ep);
  options.parallel.distributed_optimizer = args.flag("use_distributed_optimizer");
  options.parallel.expert_recv_headroom = parse_expert_recv_headroom(args.get("expert_recv_headroom"));
  const int64_t seed = args.get_int("seed");
  CHECK(seed >= 0, "--seed must be non-negative, got ", seed);
  options.seed = static_cast<uint64_t>(seed);
  options.tuner_type = args.get("tuner_type");
  options.lora.rank = args.get_int("lora_rank");
  options.lora.alpha = args.get_double("lora_alpha");
  options.lora.dropout = args.get_double("lora_dropout");
  options.lora.use_rslora = args.flag("use_rslora");
  if (args.has("target_modules")) options.lora.target_modules = args.get_list("target_modules");
  if (args.has("target_parameters")) options.lora.target_parameters = args.get_list("target_parameters");
  if (args.has("modules_to_save")) options.lora.modules_to_save = args.get_list("modules_to_save");
  options.lora.dtype = args.get("lora_dtype");
  if (options.tuner_type != "lora") {
    for (const char* flag : {"lora_rank", "lora_alpha", "lora_dropout", "use_rslora", "target_modules",
                             "target_parameters", "modules_to_save", "lora_dtype"}) {
      CHECK(!args.has(flag), "--", flag, " is a LoRA setting; it needs --tuner_type lora (this run is --tuner_type ",
            options.tuner_type, ")");
    }
  } else {
    options.lora.validate();
    for (const char* flag : {"freeze_vit", "freeze_aligner", "freeze_llm"}) {
      if (args.has(flag)) {
        log_warn("train: --", flag, " has no effect with --tuner_type lora: the base stays frozen and the adapters go ",
                 "where --target_modules / --target_parameters say (all-linear includes the vision tower's Linear ",
                 "layers, as PEFT resolves it)");
      }
    }
  }
  options.freeze.freeze_vit = args.flag("freeze_vit");
  options.freeze.freeze_aligner = args.flag("freeze_aligner");
  options.freeze.freeze_llm = args.flag("freeze_llm");
  if (args.has("router_aux_loss_coef")) options.router_aux_loss_coef = args.get_double("router_aux_loss_coef");
  options.resume = args.get("resume");
  options.ignore_args_check = args.flag("ignore_args_check");
  options.stop_after_steps = args.get_int("stop_after_steps");
  const int64_t num_workers = args.get_int("dataloader_num_workers");
  CHECK(num_workers >= 0 && num_workers <= 256, "--dataloader_num_workers must be in [0, 256], got ", num_workers);
  options.num_workers = static_cast<int>(num_workers);
  options.max_decoded_pixels = args.get_int("max_decoded_pixels");
  options.max_nonfinite_steps = args.get_int("max_nonfinite_steps");
  options.overwrite_output_dir = args.flag("overwrite_output_dir");
  // Pixels: the flags, else ms-swift's environment variables.
  options.min_pixels = args.has("min_pixels") ? args.get_int("min_pixels") : env.min_pixels.value_or(0);
  options.max_pixels = args.has("max_pixels") ? args.get_int("max_pixels") : env.max_pixels.value_or(0);
  const int64_t flag_tokens = args.get_int("image_max_token_num");
  CHECK(flag_tokens >= 0, "--image_max_token_num must be >= 0, got ", flag_tokens);
  request.image_max_tokens = flag_tokens > 0 ? flag_tokens : env.image_max_token_num.value_or(0);
  request.image_min_tokens = env.image_min_token_num.value_or(0);
  request.spatial_merge_size = env.spatial_merge_size.value_or(0);
  const int64_t shard = args.get_int("max_shard_size");
  CHECK(shard >= 0, "--max_shard_size must be >= 0");
  options.max_shard_bytes = static_cast<uint64_t>(shard);
  options.peak_tflops = args.get_double("peak_tflops");
  CHECK(options.peak_tflops >= 0, "--peak_tflops must be >= 0 (0: by GPU name), got ", options.peak_tflops);
  options.media_dir = args.get("media_dir");
  options.strict = args.flag("strict");
  options.max_skip_ratio = args.get_double("max_skip_ratio");
  options.add_non_thinking_prefix = args.flag("add_non_thinking_prefix");
  options.report_to = args.get_list("report_to");
  options.logging_dir = args.get("logging_dir");
  request.template_name = args.get("template");
  request.add_version = args.flag("add_version");
  return options;
}

}  // namespace deltamoe
