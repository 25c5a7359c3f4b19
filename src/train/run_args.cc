// args.json writing and the --resume comparison (see run_args.h).
#include "train/run_args.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/fs_sync.h"
#include "core/log.h"
#include "train/batch_plan.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

using Json = nlohmann::ordered_json;

// Options a resumed run may change without changing what it trains (where it writes, how often it
// reports, how many threads): anything else differs from the uninterrupted run.
const std::set<std::string> kHarmless = {
    "deltamoe_version", "output_dir", "val_dataset", "save_steps", "save_total_limit", "eval_steps", "logging_steps",
    "resume", "stop_after_steps", "dataloader_num_workers", "max_nonfinite_steps", "overwrite_output_dir",
    "max_shard_size", "save_only_model", "peak_tflops", "report_to", "logging_dir", "ignore_args_check", "strict",
    "max_skip_ratio", "plot",
    // The layout over ranks: checkpoints are read at any world size and layout.
    "expert_model_parallel_size", "use_distributed_optimizer"};

// Options added after runs were already saved without them: the value those runs had. A saved
// args.json without the key compares as if it held this value.
const std::map<std::string, Json> kValueBeforeTheOptionExisted = {
    // Before --expert_grad_dtype every gradient was fp32.
    {"expert_grad_dtype", "f32"}};

const char* chat_format_name(ChatFormat format) { return format == ChatFormat::kQwen3 ? "qwen3" : "qwen3_5"; }

}  // namespace

Json train_options_to_json(const TrainOptions& o, RunArgsCopy copy) {
  const BatchPlan plan = plan_batches(o);
  Json j;
  j["deltamoe_version"] = DELTAMOE_VERSION;
  j["model"] = o.model_dir;
  j["dataset"] = o.dataset_paths;
  j["val_dataset"] = o.val_dataset_paths;
  j["split_dataset_ratio"] = o.split_dataset_ratio;
  j["output_dir"] = o.output_dir;
  j["tuner_type"] = o.tuner_type;
  j["lr"] = o.schedule.lr;
  j["min_lr"] = o.schedule.min_lr;
  j["warmup_ratio"] = o.schedule.warmup_ratio;
  j["warmup_steps"] = o.schedule.warmup_steps;
  j["weight_decay"] = o.adamw.weight_decay;
  j["adam_beta1"] = o.adamw.beta1;
  j["adam_beta2"] = o.adamw.beta2;
  j["adam_epsilon"] = o.adamw.eps;
  j["optimizer_state_dtype"] = o.adamw.moment_dtype == DType::bf16 ? "bf16" : "f32";
  j["expert_grad_dtype"] = o.expert_grad_dtype == DType::bf16 ? "bf16" : "f32";
  j["max_grad_norm"] = o.max_grad_norm;
  j["max_steps"] = o.max_steps;
  j["num_train_epochs"] = o.num_train_epochs;
  j["global_batch_size"] = plan.global_batch_samples;  // 0: counted in tokens
  j["micro_batch_size"] = plan.micro_batch_samples;    // 0: limited by tokens only
  // Micro-batches per step over all ranks (what a resumed run at another world size must keep).
  j["gradient_accumulation_steps"] = plan.accumulation * o.data_parallel_size;
  j["micro_batch_tokens"] = plan.token_budget;
  j["max_length"] = o.max_length;
  j["truncation_strategy"] = o.truncate ? "right" : "delete";
  j["save_steps"] = o.save_steps;
  j["save_total_limit"] = o.save_total_limit;
  j["eval_steps"] = o.eval_steps;
  j["logging_steps"] = o.logging_steps;
  j["seed"] = o.seed;
  j["expert_model_parallel_size"] = o.parallel.expert_parallel_size;
  j["use_distributed_optimizer"] = o.parallel.distributed_optimizer;
  j["freeze_vit"] = o.freeze.freeze_vit;
  j["freeze_aligner"] = o.freeze.freeze_aligner;
  j["freeze_llm"] = o.freeze.freeze_llm;
  if (o.tuner_type == "lora") {  // only LoRA runs carry these keys (full runs' args.json stay as they were)
    j["lora_rank"] = o.lora.rank;
    j["lora_alpha"] = o.lora.alpha;
    j["lora_dropout"] = o.lora.dropout;
    j["use_rslora"] = o.lora.use_rslora;
    j["target_modules"] = o.lora.target_modules;
    j["target_parameters"] = o.lora.target_parameters;
    j["modules_to_save"] = o.lora.modules_to_save;
    j["lora_dtype"] = o.lora.dtype;
  }
  j["router_aux_loss_coef"] = o.router_aux_loss_coef ? Json(*o.router_aux_loss_coef) : Json(nullptr);
  j["resume"] = o.resume;
  j["stop_after_steps"] = o.stop_after_steps;
  j["dataloader_num_workers"] = o.num_workers;
  j["min_pixels"] = o.min_pixels;
  j["max_pixels"] = o.max_pixels;
  j["max_decoded_pixels"] = o.max_decoded_pixels;
  j["max_nonfinite_steps"] = o.max_nonfinite_steps;
  j["overwrite_output_dir"] = o.overwrite_output_dir;
  j["max_shard_size"] = o.max_shard_bytes;
  j["save_only_model"] = o.save_only_model;
  j["peak_tflops"] = o.peak_tflops;
  j["media_dir"] = o.media_dir;
  j["strict"] = o.strict;
  j["max_skip_ratio"] = o.max_skip_ratio;
  j["template"] = chat_format_name(o.chat_format);
  j["add_non_thinking_prefix"] = o.add_non_thinking_prefix;
  j["report_to"] = o.report_to;
  j["logging_dir"] = o.logging_dir;
  j["ignore_args_check"] = o.ignore_args_check;
  if (copy == RunArgsCopy::kCheckpoint) {
    for (const std::string& key : kHarmless) {
      if (key != "deltamoe_version") j.erase(key);
    }
  }
  return j;
}

void write_run_args(const std::string& dir, const std::string& options_json) {
  const fs::path path = fs::path(dir) / "args.json";
  const fs::path temp = fs::path(dir) / ".args.json.tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << options_json << "\n";
    out.close();
    CHECK(out.good(), "writing ", temp.string(), " failed (disk full or not writable?)");
  }
  fsync_path(temp.string());
  fs::rename(temp, path);
}

ArgsChanges compare_run_args(const Json& saved, const Json& now) {
  ArgsChanges changes;
  std::vector<std::string> keys;
  for (const auto& [key, value] : now.items()) keys.push_back(key);
  for (const auto& [key, value] : saved.items()) {
    if (!now.contains(key)) keys.push_back(key);
  }
  for (const std::string& key : keys) {
    const auto earlier = kValueBeforeTheOptionExisted.find(key);
    const Json before = saved.contains(key)                           ? saved[key]
                        : earlier != kValueBeforeTheOptionExisted.end() ? earlier->second
                                                                       : Json(nullptr);
    const Json after = now.contains(key) ? now[key] : Json(nullptr);
    if (before == after) continue;
    // Numbers compare by value (1e-05 written by another build still equals 1e-05).
    if (before.is_number() && after.is_number() && before.get<double>() == after.get<double>()) continue;
    const std::string line = str_cat("--", key, " ", before.dump(), " -> ", after.dump());
    (kHarmless.count(key) ? changes.harmless : changes.breaking).push_back(line);
  }
  return changes;
}

void check_resume_args(const std::string& checkpoint_dir, const TrainOptions& options) {
  const fs::path path = fs::path(checkpoint_dir) / "args.json";
  if (!fs::is_regular_file(path)) {
    log_warn("train: ", checkpoint_dir, " has no args.json (saved by an older deltamoe); the options of this run cannot be "
             "compared with that run's");
    return;
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  Json saved;
  try {
    saved = Json::parse(text.str());
  } catch (const Json::exception& error) {
    RAISE(path.string(), ": not valid JSON (", error.what(), "); --ignore_args_check resumes without comparing");
  }
  const ArgsChanges changes = compare_run_args(saved, train_options_to_json(options, RunArgsCopy::kCheckpoint));
  for (const std::string& line : changes.harmless) log_info("train: --resume with a changed option: ", line);
  if (changes.breaking.empty()) return;
  std::string list;
  for (const std::string& line : changes.breaking) list += "\n  " + line;
  if (options.ignore_args_check) {
    log_warn("train: --resume with options that change what is trained (--ignore_args_check):", list);
    return;
  }
  RAISE("--resume ", checkpoint_dir, ": these options differ from the run that saved it, so the resumed run would not ",
        "continue it exactly:", list, "\nkeep them as they were (", path.string(), " has them), or pass ",
        "--ignore_args_check to continue with the new values");
}

}  // namespace deltamoe
