// `deltamoe train`: flags (ms-swift / Megatron names) or a JSON config file -> TrainOptions -> the
// training loop; prints the progress lines, the evaluation results and a summary.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "data/sample_source.h"
#include "train/trainer.h"

namespace deltamoe {

namespace {

void declare_flags(ArgParser& args) {
  args.add_option("config", "JSON file of flags ({\"lr\": 1e-4, ...}); flags on the command line win", "");
  args.add_required("model", "Hugging Face model directory (config.json, safetensors, tokenizer.json)");
  args.add_required("dataset", "training JSONL file(s), comma separated");
  args.add_required("output_dir", "where checkpoints and metrics.jsonl go");
  args.add_option("val_dataset", "validation JSONL file(s), comma separated (evaluated at start, every "
                  "--eval_steps, and at the end)", "");
  args.add_option("split_dataset_ratio", "fraction of --dataset held out for validation (seeded split written to "
                  "OUTPUT_DIR/dataset_split)", "0");
  args.add_option("tuner_type", "full (LoRA is not supported yet)", "full");
  args.add_option("train_type", "alias of --tuner_type", "");
  args.add_option("lr", "peak learning rate", "1e-5");
  args.add_option("learning_rate", "alias of --lr", "");
  args.add_option("min_lr", "learning rate at the end of the cosine decay", "0");
  args.add_option("warmup_ratio", "fraction of the steps with linear warmup", "0");
  args.add_option("warmup_steps", "warmup steps (overrides --warmup_ratio when >= 0)", "-1");
  args.add_option("weight_decay", "AdamW decoupled weight decay (not applied to 1-D tensors)", "0.1");
  args.add_option("adam_beta1", "AdamW beta1", "0.9");
  args.add_option("adam_beta2", "AdamW beta2", "0.95");
  args.add_option("adam_epsilon", "AdamW epsilon", "1e-8");
  args.add_option("optimizer_state_dtype", "f32 or bf16 Adam moments", "f32");
  args.add_option("max_grad_norm", "clip by the global gradient norm (<= 0: off)", "1.0");
  args.add_option("num_train_epochs", "passes over --dataset (unless --max_steps)", "1");
  args.add_option("max_steps", "optimizer steps (> 0 overrides --num_train_epochs)", "-1");
  args.add_option("global_batch_size", "samples per optimizer step over all ranks (accumulation = global / "
                  "(micro x ranks)); 0: the batch is counted in tokens", "0");
  args.add_option("micro_batch_size", "samples per micro-batch (default 1 with --global_batch_size)", "0");
  args.add_option("per_device_train_batch_size", "alias of --micro_batch_size", "");
  args.add_option("gradient_accumulation_steps", "micro-batches per optimizer step (0: derived from "
                  "--global_batch_size, else 1)", "0");
  args.add_option("micro_batch_tokens", "token budget of one packed micro-batch (default --max_length); the "
                  "alternative to --global_batch_size / --micro_batch_size", "0");
  args.add_option("max_length", "longest sample in tokens", "2048");
  args.add_option("truncation_strategy", "delete (drop longer samples) or right (cut them)", "delete");
  args.add_option("save_steps", "save a checkpoint every N steps (0: only at the end)", "0");
  args.add_option("save_total_limit", "keep only the newest N checkpoints (0: keep all)", "0");
  args.add_option("save_only_model", "true/false: checkpoints hold the model directory only (no optimizer state, "
                  "so they cannot be resumed from)", "false");
  args.add_option("eval_steps", "evaluate on --val_dataset every N steps (0: start and end only)", "0");
  args.add_option("logging_steps", "print the progress line every N steps", "1");
  args.add_option("seed", "seed of the data order (and any randomness of the run)", "42");
  args.add_option("freeze_vit", "true/false: keep the vision tower fixed", "true");
  args.add_option("freeze_aligner", "true/false: keep the merger (vision -> text projection) fixed", "true");
  args.add_option("freeze_llm", "true/false: keep the language model fixed", "false");
  args.add_option("router_aux_loss_coef", "weight of the router load-balancing loss (default: the model config's)",
                  "");
  args.add_option("resume", "a checkpoint-N directory, or 'auto' for the newest in --output_dir", "");
  args.add_option("resume_from_checkpoint", "alias of --resume", "");
  args.add_option("stop_after_steps", "end this process after N steps, saving a checkpoint (preemption drill)", "0");
  args.add_option("dataloader_num_workers", "threads that load and tokenize samples", "2");
  args.add_option("min_pixels", "smallest image area after resizing (default: the processor's 65536)", "0");
  args.add_option("max_pixels", "largest image area after resizing (default: the processor's)", "0");
  args.add_option("max_decoded_pixels", "largest image (width x height as stored) that is decoded; larger ones are "
                  "skipped as decompression bombs (PIL's MAX_IMAGE_PIXELS)", "178956970");
  args.add_option("max_nonfinite_steps", "stop the run with an error after this many steps in a row with a NaN/Inf "
                  "loss or gradient norm, saving nothing (0: never stop; such steps are skipped)", "5");
  args.add_option("overwrite_output_dir", "true/false: a fresh run into an --output_dir that holds checkpoints or "
                  "metrics of an earlier run deletes them (default: refuse)", "false");
  args.add_option("max_shard_size", "largest safetensors shard of a saved checkpoint, in bytes", "5000000000");
  args.add_option("device", "auto, cpu or cuda", "auto");
  args.add_option("peak_tflops", "the GPU's peak dense bf16 TFLOP/s for the MFU of the progress line (0: by GPU "
                  "name, e.g. 989 for an H100/H200)", "0");
}

bool parse_bool(const ArgParser& args, const std::string& name) {
  const std::string value = args.get(name);
  if (value == "true" || value == "True" || value == "1") return true;
  if (value == "false" || value == "False" || value == "0") return false;
  RAISE("--", name, " takes true or false, got '", value, "'");
}

// "--config FILE": its keys become flags placed before the command line's, so the command line wins.
std::vector<std::string> expand_config_file(int argc, char** argv) {
  std::vector<std::string> expanded(argv, argv + 2);
  std::string config_path;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--config" && i + 1 < argc) config_path = argv[i + 1];
    if (arg.starts_with("--config=")) config_path = arg.substr(9);
  }
  if (!config_path.empty()) {
    std::ifstream in(config_path, std::ios::binary);
    CHECK(in.good(), "--config: cannot read ", config_path);
    std::stringstream text;
    text << in.rdbuf();
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::exception& error) {
      RAISE("--config ", config_path, ": not valid JSON: ", error.what());
    }
    CHECK(json.is_object(), "--config ", config_path, ": must hold one JSON object of flag names and values");
    for (const auto& [key, value] : json.items()) {
      CHECK(key != "config", "--config ", config_path, ": cannot name another config file");
      std::string text_value;
      if (value.is_string()) {
        text_value = value.get<std::string>();
      } else if (value.is_array()) {  // a list of files: "dataset": ["a.jsonl", "b.jsonl"]
        for (const auto& item : value) {
          CHECK(item.is_string(), "--config ", config_path, ": '", key, "' must be a list of strings");
          text_value += (text_value.empty() ? "" : ",") + item.get<std::string>();
        }
      } else if (value.is_boolean() || value.is_number()) {
        text_value = value.dump();
      } else {
        RAISE("--config ", config_path, ": '", key, "' must be a string, number, boolean or list of strings");
      }
      expanded.push_back("--" + key);
      expanded.push_back(text_value);
    }
  }
  expanded.insert(expanded.end(), argv + 2, argv + argc);
  return expanded;
}

std::string first_of(const ArgParser& args, const std::string& name, const std::string& alias) {
  return args.get(alias).empty() ? args.get(name) : args.get(alias);
}

TrainOptions options_from_args(const ArgParser& args) {
  TrainOptions options;
  options.model_dir = args.get("model");
  options.dataset_paths = split_dataset_list(args.get("dataset"));
  options.val_dataset_paths = split_dataset_list(args.get("val_dataset"));
  options.output_dir = args.get("output_dir");
  options.split_dataset_ratio = args.get_double("split_dataset_ratio");
  const std::string tuner = first_of(args, "tuner_type", "train_type");
  CHECK(tuner == "full", "--tuner_type ", tuner, " is not supported yet (only full)");
  options.schedule.lr = args.get("learning_rate").empty() ? args.get_double("lr") : args.get_double("learning_rate");
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
  options.max_grad_norm = args.get_double("max_grad_norm");
  options.num_train_epochs = args.get_int("num_train_epochs");
  options.max_steps = args.get_int("max_steps");
  options.global_batch_size = args.get_int("global_batch_size");
  options.micro_batch_size = args.get("per_device_train_batch_size").empty()
                                 ? args.get_int("micro_batch_size")
                                 : args.get_int("per_device_train_batch_size");
  options.gradient_accumulation_steps = args.get_int("gradient_accumulation_steps");
  options.micro_batch_tokens = args.get_int("micro_batch_tokens");
  options.max_length = args.get_int("max_length");
  const std::string truncation = args.get("truncation_strategy");
  CHECK(truncation == "delete" || truncation == "right", "--truncation_strategy must be delete or right, got '",
        truncation, "'");
  options.truncate = truncation == "right";
  options.save_steps = args.get_int("save_steps");
  options.save_total_limit = args.get_int("save_total_limit");
  options.eval_steps = args.get_int("eval_steps");
  options.logging_steps = args.get_int("logging_steps");
  const int64_t seed = args.get_int("seed");
  CHECK(seed >= 0, "--seed must be non-negative, got ", seed);
  options.seed = static_cast<uint64_t>(seed);
  options.freeze.freeze_vit = parse_bool(args, "freeze_vit");
  options.save_only_model = parse_bool(args, "save_only_model");
  options.freeze.freeze_aligner = parse_bool(args, "freeze_aligner");
  options.freeze.freeze_llm = parse_bool(args, "freeze_llm");
  if (!args.get("router_aux_loss_coef").empty()) options.router_aux_loss_coef = args.get_double("router_aux_loss_coef");
  options.resume = first_of(args, "resume", "resume_from_checkpoint");
  options.stop_after_steps = args.get_int("stop_after_steps");
  const int64_t num_workers = args.get_int("dataloader_num_workers");
  CHECK(num_workers >= 0 && num_workers <= 256, "--dataloader_num_workers must be in [0, 256], got ", num_workers);
  options.num_workers = static_cast<int>(num_workers);
  options.max_decoded_pixels = args.get_int("max_decoded_pixels");
  options.max_nonfinite_steps = args.get_int("max_nonfinite_steps");
  options.overwrite_output_dir = parse_bool(args, "overwrite_output_dir");
  options.min_pixels = args.get_int("min_pixels");
  options.max_pixels = args.get_int("max_pixels");
  const int64_t shard = args.get_int("max_shard_size");
  CHECK(shard >= 0, "--max_shard_size must be >= 0");
  options.max_shard_bytes = static_cast<uint64_t>(shard);
  options.peak_tflops = args.get_double("peak_tflops");
  CHECK(options.peak_tflops >= 0, "--peak_tflops must be >= 0 (0: by GPU name), got ", options.peak_tflops);
  return options;
}

}  // namespace

int cmd_train(int argc, char** argv) {
  ArgParser args("train", "full-parameter SFT of a Qwen3.5-MoE model on chat JSONL data");
  declare_flags(args);
  std::vector<std::string> expanded = expand_config_file(argc, argv);
  std::vector<char*> expanded_argv;
  for (std::string& arg : expanded) expanded_argv.push_back(arg.data());
  if (!args.parse(static_cast<int>(expanded_argv.size()), expanded_argv.data())) return 0;
  const TrainOptions options = options_from_args(args);
#if DELTAMOE_WITH_CUDA
#endif
  const TrainSummary summary = run_training(options, args.get("device"));

  std::printf("\ntrain summary (%s): %lld/%lld steps (%lld this run) in %.1f s; loss %.4f -> %.4f", summary.device.c_str(),
              static_cast<long long>(summary.steps_done), static_cast<long long>(summary.total_steps),
              static_cast<long long>(summary.steps_this_run), summary.elapsed_s, summary.first_loss, summary.last_loss);
  if (summary.has_val) std::printf("; val_loss %.4f -> %.4f", summary.first_val_loss, summary.last_val_loss);
  if (summary.has_val && summary.last_val_token_acc >= 0) {
    std::printf("; val token_acc %.3f -> %.3f", summary.first_val_token_acc, summary.last_val_token_acc);
  }
  if (summary.mfu >= 0) std::printf("; MFU %.1f%%", 100.0 * summary.mfu);
  if (summary.peak_mem_gib >= 0) std::printf("; peak GPU memory %.1f GiB", summary.peak_mem_gib);
  std::printf("; data: %s\n", summary.data_skips.c_str());
  if (!summary.last_checkpoint.empty()) std::printf("checkpoint: %s\n", summary.last_checkpoint.c_str());
  std::printf("metrics: %s/metrics.jsonl\n", options.output_dir.c_str());
  // Stopped by SIGTERM / SIGINT: the checkpoint is saved, but the job did not finish.
  return summary.stopped_by_signal != 0 ? 128 + summary.stopped_by_signal : 0;
}

}  // namespace deltamoe
