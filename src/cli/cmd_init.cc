// `deltamoe init`: writes a randomly initialised checkpoint (transformers' initialisation) for a
// preset or a config.json, plus config.json, generation_config.json, chat_template.jinja and, for the
// VLM, preprocessor_config.json.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/random_init.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "model/config.h"
#include "train/hf_side_files.h"

namespace deltamoe {

int cmd_init(int argc, char** argv) {
  ArgParser args("init", "write a randomly initialised checkpoint");
  args.add_required("config",
                    "a preset (tiny, tiny-vl, qwen3.5-35b-a3b, qwen3.5-397b-a17b) or a config.json / model dir");
  args.add_required("out", "output directory (created)");
  args.add_option("seed", "random seed; a tensor's values depend only on (seed, tensor name)", "0");
  args.add_option("dtype", "bf16 or f32 (A_log is f32 either way, as in the released checkpoints)", "bf16");
  args.add_option("expert_layout", "fused (as the official release) or per_expert (as transformers 5.17 saves)",
                  "fused");
  args.add_option("shard_size", "largest shard in bytes; 0 writes one model.safetensors", "5000000000");
  args.add_option("layers", "decoder layers at the config's widths, typed as full_attention_interval says (0: the "
                  "config's own)", "0");
  args.add_option("text_only", "true/false: drop the vision tower (model_type qwen3_5_moe_text)", "false");
  if (!args.parse(argc, argv)) return 0;

  ModelConfig config = resolve_model_config(args.get("config"));
  const std::string text_only = args.get("text_only");
  CHECK(text_only == "true" || text_only == "false", "--text_only must be true or false, got '", text_only, "'");
  CHECK(args.get_int("layers") >= 0, "--layers must be non-negative, got ", args.get_int("layers"));
  if (args.get_int("layers") > 0 || text_only == "true") {
    config = reduced_depth_config(config, args.get_int("layers") > 0 ? args.get_int("layers")
                                                                      : config.text.num_hidden_layers,
                                  text_only == "true");
  }
  DType dtype;
  CHECK(dtype_from_name(args.get("dtype"), &dtype) && (dtype == DType::bf16 || dtype == DType::f32),
        "--dtype must be bf16 or f32, got '", args.get("dtype"), "'");
  CHECK(args.get_int("seed") >= 0, "--seed must be non-negative");
  CHECK(args.get_int("shard_size") >= 0, "--shard_size must be non-negative");
  ModelCheckpoint checkpoint = random_init_checkpoint(config, static_cast<uint64_t>(args.get_int("seed")), dtype);
  SaveOptions options;
  options.expert_layout = parse_expert_layout(args.get("expert_layout"), "--expert_layout");
  options.max_shard_bytes = static_cast<uint64_t>(args.get_int("shard_size"));
  const std::string out_dir = args.get("out");
  save_model_dir(checkpoint, out_dir, options);
  // generation_config.json (generate() stops at <|im_end|>) and chat_template.jinja, for HF tools.
  write_missing_side_files(out_dir, config, ChatFormat::kQwen35);
  if (config.has_vision) {
    const std::filesystem::path path = std::filesystem::path(out_dir) / "preprocessor_config.json";
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << preprocessor_config_json(config);
    CHECK(out.good(), "writing ", path.string(), " failed");
  }
  std::printf("wrote %s (%s, %zu tensors, dtype %s, seed %lld, experts %s)\n", out_dir.c_str(),
              config.model_type.c_str(), checkpoint.params.size(), dtype == DType::bf16 ? "bf16" : "f32",
              static_cast<long long>(args.get_int("seed")), expert_layout_name(*options.expert_layout));
  return 0;
}

}  // namespace deltamoe
