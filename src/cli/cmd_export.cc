// `deltamoe export --adapters DIR --merge_lora true --output_dir OUT` (ms-swift's spelling): merges a
// LoRA adapter directory into its base model (W + s B A per adapted weight, PEFT's merge_and_unload)
// and writes a whole Hugging Face model directory; the base's tokenizer and other side files are
// copied.
#include <cstdio>
#include <filesystem>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/peft_adapter.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"

namespace deltamoe {

int cmd_export(int argc, char** argv) {
  namespace fs = std::filesystem;
  ArgParser args("export", "merge a LoRA adapter into its base model and write a Hugging Face model directory");
  args.add_list("adapters", "the LoRA adapter directory (a LoRA run's checkpoint-N, or PEFT's)", /*required=*/true);
  args.add_bool("merge_lora", "merge the adapter into the base weights (the only export there is)", false);
  args.add_required("output_dir", "where the merged model goes (must not exist or be empty)");
  args.add_option("model", "the base model directory (default: the adapter's base_model_name_or_path)", "");
  args.add_option("shard_size", "largest shard in bytes; 0 writes one model.safetensors", "5000000000",
                  ArgKind::kInteger);
  if (!args.parse(argc, argv)) return 0;
  const std::vector<std::string> adapters = args.get_list("adapters");
  CHECK(adapters.size() == 1, "--adapters takes one adapter directory, got ", adapters.size());
  CHECK(args.flag("merge_lora"), "export: give --merge_lora true (merging the adapter is what export does)");
  const std::string adapter_dir = adapters[0], out_dir = args.get("output_dir");
  CHECK(fs::is_regular_file(fs::path(adapter_dir) / kPeftAdapterConfig), "--adapters ", adapter_dir,
        ": no adapter_config.json (not a LoRA checkpoint)");
  std::string model_dir = args.get("model");
  if (model_dir.empty()) model_dir = peft_adapter_base_model(adapter_dir);
  CHECK(!model_dir.empty(), "--adapters ", adapter_dir, " names no base model (base_model_name_or_path); give --model");
  CHECK(fs::is_directory(model_dir), "the base model ", model_dir, " is not a directory; give --model");
  std::error_code error;
  CHECK(!fs::exists(out_dir) || fs::is_empty(out_dir, error), "--output_dir ", out_dir,
        " exists and is not empty; give a new folder");
  CHECK(args.get_int("shard_size") >= 0, "--shard_size must be non-negative");
  const ModelCheckpoint base = load_model_dir(model_dir);
  const LoraAdapters lora = load_peft_adapter(adapter_dir, base.config);
  const ModelCheckpoint merged = merge_lora(base, lora);
  SaveOptions options;
  options.max_shard_bytes = static_cast<uint64_t>(args.get_int("shard_size"));
  save_model_dir(merged, out_dir, options);
  copy_side_files(model_dir, out_dir);
  std::printf("export: merged %zu adapters (r %lld, scaling %g) of %s into %s -> %s\n", lora.targets.size(),
              static_cast<long long>(lora.options.rank), lora.options.scaling(), adapter_dir.c_str(),
              model_dir.c_str(), out_dir.c_str());
  return 0;
}

}  // namespace deltamoe
