// `deltamoe convert`: load a model directory and save it again, optionally changing the expert
// layout or the shard size; tokenizer and other side files are copied. Tensors stay bit-identical.
#include <cstdio>
#include <filesystem>

#include "checkpoint/model_checkpoint.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"

namespace deltamoe {

int cmd_convert(int argc, char** argv) {
  ArgParser args("convert", "load a checkpoint and save it again (expert layout / sharding)");
  args.add_required("in", "input model directory (config.json + safetensors)");
  args.add_required("out", "output model directory (must differ from --in)");
  args.add_option("layout", "expert layout of the output: keep, fused or per_expert", "keep");
  args.add_option("shard_size", "largest shard in bytes; 0 writes one model.safetensors", "5000000000");
  if (!args.parse(argc, argv)) return 0;

  const std::string in_dir = args.get("in"), out_dir = args.get("out");
  CHECK(std::filesystem::is_directory(in_dir), "--in ", in_dir, " is not a directory");
  CHECK(!std::filesystem::exists(out_dir) || !std::filesystem::equivalent(in_dir, out_dir),
        "--out must differ from --in (the input files are read while the output is written)");
  CHECK(args.get_int("shard_size") >= 0, "--shard_size must be non-negative");
  ModelCheckpoint checkpoint = load_model_dir(in_dir);
  SaveOptions options;
  if (args.get("layout") != "keep") options.expert_layout = parse_expert_layout(args.get("layout"), "--layout");
  options.max_shard_bytes = static_cast<uint64_t>(args.get_int("shard_size"));
  save_model_dir(checkpoint, out_dir, options);
  copy_side_files(in_dir, out_dir);
  std::printf("converted %s -> %s (%zu parameters, %zu passthrough tensors, experts %s -> %s)\n", in_dir.c_str(),
              out_dir.c_str(), checkpoint.params.size(), checkpoint.passthrough.size(),
              expert_layout_name(checkpoint.expert_layout),
              expert_layout_name(options.expert_layout.value_or(checkpoint.expert_layout)));
  return 0;
}

}  // namespace deltamoe
