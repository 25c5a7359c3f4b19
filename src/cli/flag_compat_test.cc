// The command line as a user of ms-swift, Megatron or transformers writes it, parsed by `deltamoe
// train`'s real flags: every problem at once, one line each and no usage dump; bare booleans; lists;
// aliases (and a conflict between an alias and its flag); other tools' flags noted or refused with
// the reason; YAML and JSON config files; ms-swift's environment variables; and ms-swift's
// Qwen3.5-35B-A3B examples (examples/models/qwen3_5/*.sh of modelscope/ms-swift) flag by flag.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "cli/flag_compat.h"
#include "cli/swift_env.h"
#include "cli/train_flags.h"
#include "core/error.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

struct Parsed {
  bool ok = false;
  std::string error;
  std::unique_ptr<ArgParser> args;
};

Parsed parse_train(std::vector<std::string> flags) {
  flags.insert(flags.begin(), {"deltamoe", "train"});
  std::vector<char*> argv;
  for (std::string& flag : flags) argv.push_back(flag.data());
  Parsed parsed;
  parsed.args = std::make_unique<ArgParser>("train", "test");
  declare_train_flags(*parsed.args);
  try {
    parsed.ok = parsed.args->parse(static_cast<int>(argv.size()), argv.data());
  } catch (const Error& error) {
    parsed.error = error.what();
  }
  return parsed;
}

std::vector<std::string> with_required(std::vector<std::string> flags) {
  flags.insert(flags.begin(), {"--model", "m", "--dataset", "d.jsonl", "--output_dir", "o"});
  return flags;
}

size_t count_lines(const std::string& text) { return static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) + 1; }

TEST(FlagCompat, EveryProblemAtOnceWithAHintAndNoUsage) {
  const Parsed parsed = parse_train(with_required({"--learning_rat", "1e-4", "--data_sed", "3", "--lr", "abc",
                                                   "--freeze_vit", "maybe", "--bogus_flag_name"}));
  ASSERT_FALSE(parsed.ok);
  const std::string& message = parsed.error;
  EXPECT_NE(message.find("5 problems"), std::string::npos) << message;
  EXPECT_NE(message.find("unknown flag --learning_rat (did you mean --learning_rate?)"), std::string::npos) << message;
  EXPECT_NE(message.find("unknown flag --data_sed (did you mean --data_seed?)"), std::string::npos) << message;
  EXPECT_NE(message.find("unknown flag --bogus_flag_name"), std::string::npos) << message;
  EXPECT_NE(message.find("--lr must be a finite number, got 'abc'"), std::string::npos) << message;
  EXPECT_NE(message.find("--freeze_vit takes true or false, got 'maybe'"), std::string::npos) << message;
  EXPECT_EQ(message.find("usage"), std::string::npos) << "no usage dump: " << message;
  EXPECT_LE(count_lines(message), 7u) << message;
}

TEST(FlagCompat, BareBooleansListsAndDashes) {
  const Parsed parsed = parse_train({"--model", "m", "--dataset", "a.jsonl", "b.json#10", "c.jsonl,d.jsonl",
                                     "--output_dir", "o", "--freeze_vit", "--freeze_llm", "true", "--strict",
                                     "--learning-rate", "2e-4", "--report_to", "tensorboard"});
  ASSERT_TRUE(parsed.ok) << parsed.error;
  const ArgParser& args = *parsed.args;
  EXPECT_TRUE(args.flag("freeze_vit"));
  EXPECT_TRUE(args.flag("freeze_llm"));
  EXPECT_TRUE(args.flag("strict"));
  EXPECT_FALSE(args.has("freeze_aligner"));
  EXPECT_TRUE(args.flag("freeze_aligner")) << "its default";
  EXPECT_EQ(args.get_list("dataset"), (std::vector<std::string>{"a.jsonl", "b.json#10", "c.jsonl", "d.jsonl"}));
  EXPECT_DOUBLE_EQ(args.get_double("lr"), 2e-4) << "--learning-rate is --learning_rate, an alias of --lr";
  EXPECT_EQ(args.get_list("report_to"), (std::vector<std::string>{"tensorboard"}));
  const Parsed off = parse_train(with_required({"--freeze_vit", "false"}));
  ASSERT_TRUE(off.ok) << off.error;
  EXPECT_FALSE(off.args->flag("freeze_vit"));
}

TEST(FlagCompat, AliasesMeanTheSameAndConflictsAreRefused) {
  const Parsed parsed = parse_train(with_required({"--per_device_train_batch_size", "4", "--moe_aux_loss_coeff", "1e-6",
                                                   "--lr_warmup_fraction", "0.05", "--train_iters", "9", "--data_seed", "5"}));
  ASSERT_TRUE(parsed.ok) << parsed.error;
  EXPECT_EQ(parsed.args->get_int("micro_batch_size"), 4);
  EXPECT_DOUBLE_EQ(parsed.args->get_double("router_aux_loss_coef"), 1e-6);
  EXPECT_DOUBLE_EQ(parsed.args->get_double("warmup_ratio"), 0.05);
  EXPECT_EQ(parsed.args->get_int("max_steps"), 9);
  EXPECT_EQ(parsed.args->get_int("seed"), 5);
  const Parsed conflict = parse_train(with_required({"--lr", "1e-4", "--learning_rate", "2e-4"}));
  ASSERT_FALSE(conflict.ok);
  EXPECT_NE(conflict.error.find("--learning_rate and --lr both set --lr"), std::string::npos) << conflict.error;
  EXPECT_TRUE(parse_train(with_required({"--lr", "1e-4", "--learning_rate", "1e-4"})).ok) << "the same value twice";
}

TEST(FlagCompat, NoEffectFlagsAreNotedAndHarmfulValuesRefused) {
  const Parsed parsed = parse_train(with_required({"--experts_impl", "grouped_mm", "--torch_dtype", "bfloat16",
                                                   "--tensor_model_parallel_size", "1"}));
  ASSERT_TRUE(parsed.ok) << parsed.error;
  ASSERT_EQ(parsed.args->notes().size(), 3u);
  EXPECT_NE(parsed.args->notes()[0].find("--experts_impl grouped_mm: no effect in deltamoe"), std::string::npos);
  const Parsed refused = parse_train(with_required({"--torch_dtype", "float16", "--pipeline_model_parallel_size", "4",
                                                    "--use_dora", "true", "--tuner_type", "lora"}));
  ASSERT_FALSE(refused.ok);
  EXPECT_NE(refused.error.find("--torch_dtype float16: deltamoe trains in bf16"), std::string::npos) << refused.error;
  EXPECT_NE(refused.error.find("--pipeline_model_parallel_size 4: deltamoe splits work over ranks only with"),
            std::string::npos) << refused.error;
  EXPECT_NE(refused.error.find("--use_dora: not part of deltamoe's LoRA"), std::string::npos) << refused.error;
  EXPECT_EQ(refused.error.find("--tuner_type"), std::string::npos) << "LoRA is supported: " << refused.error;
}

TEST(FlagCompat, TheTableAgreesWithTheTrainFlags) {
  ArgParser args("train", "test");
  declare_train_flags(args);
  for (const ForeignFlag& flag : foreign_flag_table()) {
    SCOPED_TRACE(flag.name);
    EXPECT_FALSE(flag.reason.empty() && flag.action != ForeignFlag::Action::kAlias) << "every refusal and note says why";
    if (flag.action == ForeignFlag::Action::kAlias) {
      EXPECT_TRUE(args.declares(flag.target));
    }
    if (!flag.harmless_values.empty()) {
      EXPECT_FALSE(flag.refused_reason.empty());
    }
  }
  // docs/swift_compat.md lists every entry.
  std::ifstream doc("docs/swift_compat.md");
  const std::string text((std::istreambuf_iterator<char>(doc)), std::istreambuf_iterator<char>());
  for (const ForeignFlag& flag : foreign_flag_table()) {
    EXPECT_NE(text.find("`--" + flag.name + "`"), std::string::npos) << flag.name << " is missing from docs/swift_compat.md";
  }
}

TEST(FlagCompat, ConfigFilesInYamlAndJsonAndTheCommandLineWins) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_config_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "run.yaml") << "model: m\ndataset:\n  - a.jsonl\n  - b.jsonl#5\noutput_dir: o\nlr: 1e-4\n"
                                     "freeze_vit: false\nper_device_train_batch_size: 2\nexperts_impl: grouped_mm\n"
                                     "max_pixels: ~\n";
  const Parsed yaml = parse_train({"--config", (dir / "run.yaml").string(), "--lr", "3e-4"});
  ASSERT_TRUE(yaml.ok) << yaml.error;
  EXPECT_EQ(yaml.args->get_list("dataset"), (std::vector<std::string>{"a.jsonl", "b.jsonl#5"}));
  EXPECT_DOUBLE_EQ(yaml.args->get_double("lr"), 3e-4);
  EXPECT_FALSE(yaml.args->flag("freeze_vit"));
  EXPECT_EQ(yaml.args->get_int("micro_batch_size"), 2);
  EXPECT_FALSE(yaml.args->has("max_pixels")) << "null: the default";
  std::ofstream(dir / "run.json") << R"({"model": "m", "dataset": ["a.jsonl"], "output_dir": "o", "lr": 1e-4, "freeze_vit": true, "lora_rank": 8, "target_regex": "q"})";
  const Parsed json = parse_train({"--config", (dir / "run.json").string()});
  ASSERT_FALSE(json.ok);
  EXPECT_NE(json.error.find("--target_regex: give the module names"), std::string::npos) << json.error;
  EXPECT_EQ(json.error.find("--lora_rank"), std::string::npos) << "a train flag: " << json.error;
  std::ofstream(dir / "bad.yaml") << "model: m\n  lr: [\n";
  const Parsed bad = parse_train({"--config", (dir / "bad.yaml").string()});
  ASSERT_FALSE(bad.ok);
  EXPECT_NE(bad.error.find("not valid YAML (line"), std::string::npos) << bad.error;
  fs::remove_all(dir);
}

TEST(FlagCompat, SwiftEnvironmentVariablesAreReadNotedOrRefused) {
  std::map<std::string, std::string> values = {{"MAX_PIXELS", "1003520"}, {"IMAGE_MAX_TOKEN_NUM", "1024"},
                                               {"VIDEO_MAX_PIXELS", "50176"}, {"FPS_MAX_FRAMES", "12"},
                                               {"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"}};
  const auto get = [&](const char* name) -> const char* {
    auto it = values.find(name);
    return it == values.end() ? nullptr : it->second.c_str();
  };
  SwiftEnv env = read_swift_env(get);
  EXPECT_EQ(env.max_pixels, 1003520);
  EXPECT_EQ(env.image_max_token_num, 1024);
  EXPECT_TRUE(env.problems.empty());
  EXPECT_EQ(env.notes.size(), 3u);
  values["IMAGE_MAX_TOKEN_NUM"] = "lots";
  env = read_swift_env(get);
  ASSERT_EQ(env.problems.size(), 1u);
  EXPECT_NE(env.problems[0].find("IMAGE_MAX_TOKEN_NUM=lots must be a positive integer"), std::string::npos);
}

// ms-swift's examples/models/qwen3_5/transformers.sh (swift sft, LoRA) with local paths: every flag
// is taken or noted (LoRA included), and the LoRA settings arrive as given.
TEST(FlagCompat, SwiftLoraExampleIsTakenWithItsLoraSettings) {
  const Parsed parsed = parse_train(
      {"--model", "Qwen3.5-35B-A3B", "--tuner_type", "lora", "--dataset", "latex_ocr.jsonl#2000",
       "--load_from_cache_file", "true", "--add_non_thinking_prefix", "true", "--split_dataset_ratio", "0.01",
       "--torch_dtype", "bfloat16", "--num_train_epochs", "1", "--per_device_train_batch_size", "4",
       "--per_device_eval_batch_size", "4", "--learning_rate", "1e-4", "--lora_rank", "8", "--lora_alpha", "32",
       "--target_modules", "all-linear", "--experts_impl", "grouped_mm", "--router_aux_loss_coef", "1e-3",
       "--gradient_accumulation_steps", "1", "--group_by_length", "true", "--output_dir", "output/Qwen3.5-35B-A3B",
       "--eval_steps", "50", "--save_steps", "50", "--save_total_limit", "2", "--logging_steps", "5", "--max_length",
       "2048", "--warmup_ratio", "0.05", "--dataset_num_proc", "4", "--dataloader_num_workers", "4", "--deepspeed",
       "zero3"});
  ASSERT_TRUE(parsed.ok) << parsed.error;
  EXPECT_EQ(parsed.args->get("tuner_type"), "lora");
  EXPECT_EQ(parsed.args->get_int("lora_rank"), 8);
  EXPECT_DOUBLE_EQ(parsed.args->get_double("lora_alpha"), 32);
  EXPECT_EQ(parsed.args->get_list("target_modules"), std::vector<std::string>{"all-linear"});
  const Parsed alias = parse_train(with_required({"--train_type", "lora", "--target_parameters",
                                                  "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  ASSERT_TRUE(alias.ok) << alias.error;
  EXPECT_EQ(alias.args->get("tuner_type"), "lora");
  EXPECT_EQ(alias.args->get_list("target_parameters").size(), 2u);
}

TEST(FlagCompat, SwiftLoraExampleFlagsNeedNothingElse) {
  const Parsed parsed = parse_train(
      {"--model", "Qwen3.5-35B-A3B", "--tuner_type", "lora", "--dataset", "latex_ocr.jsonl#2000",
       "--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "all-linear", "--output_dir", "o"});
  ASSERT_TRUE(parsed.ok) << parsed.error;
  EXPECT_EQ(parsed.error.find("unknown flag"), std::string::npos) << "every flag of the example is known";
}

// ms-swift's examples/models/qwen3_5/mcore_full.sh (megatron sft, full, 8 GPUs): the parallel
// layout and the other Megatron-only settings are listed in one stop.
TEST(FlagCompat, MegatronFullExampleListsTheParallelLayoutAndMtp) {
  const Parsed parsed = parse_train(
      {"--model", "Qwen3.5-35B-A3B", "--save_safetensors", "true", "--dataset", "long_alpaca.jsonl",
       "--load_from_cache_file", "true", "--add_non_thinking_prefix", "true", "--split_dataset_ratio", "0.01",
       "--tuner_type", "full", "--tensor_model_parallel_size", "1", "--pipeline_model_parallel_size", "2",
       "--expert_model_parallel_size", "4", "--decoder_first_pipeline_num_layers", "24", "--moe_permute_fusion", "true",
       "--moe_grouped_gemm", "true", "--moe_shared_expert_overlap", "true", "--moe_aux_loss_coeff", "1e-6",
       "--micro_batch_size", "1", "--global_batch_size", "16", "--recompute_granularity", "full", "--recompute_method",
       "uniform", "--recompute_num_layers", "1", "--num_train_epochs", "1", "--group_by_length", "true", "--finetune",
       "true", "--freeze_llm", "false", "--freeze_vit", "true", "--freeze_aligner", "true",
       "--cross_entropy_loss_fusion", "true", "--lr", "1e-5", "--lr_warmup_fraction", "0.05", "--min_lr", "1e-6",
       "--output_dir", "megatron_output/Qwen3.5-35B-A3B", "--eval_steps", "200", "--save_steps", "200", "--max_length",
       "16384", "--dataloader_num_workers", "8", "--dataset_num_proc", "8", "--no_save_optim", "true", "--no_save_rng",
       "true", "--sequence_parallel", "true", "--moe_expert_capacity_factor", "2", "--mtp_num_layers", "1",
       "--optimizer_cpu_offload", "true", "--use_precision_aware_optimizer", "true", "--optimizer_offload_fraction",
       "0.62", "--attention_backend", "flash", "--padding_free", "false"});
  ASSERT_FALSE(parsed.ok);
  std::printf("%s\n", parsed.error.c_str());
  EXPECT_NE(parsed.error.find("--pipeline_model_parallel_size 2, --decoder_first_pipeline_num_layers: deltamoe splits "
                              "work over ranks only"),
            std::string::npos);
  EXPECT_EQ(parsed.error.find("--expert_model_parallel_size 4"), std::string::npos) << "a real flag now";
  EXPECT_NE(parsed.error.find("--decoder_first_pipeline_num_layers"), std::string::npos);
  EXPECT_NE(parsed.error.find("--moe_expert_capacity_factor: deltamoe never drops tokens"), std::string::npos);
  EXPECT_NE(parsed.error.find("--mtp_num_layers 1: the multi-token-prediction layers are not trained"), std::string::npos);
  EXPECT_EQ(parsed.error.find("unknown flag"), std::string::npos) << "every flag of the example is known";
}

}  // namespace
}  // namespace deltamoe
