// deltamoe: one program, many subcommands. Dispatches argv[1] and turns errors into messages.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"

namespace deltamoe {
namespace {

// Add a line here for each subcommand.
const Command kCommands[] = {
    {"version", "print the version and build configuration", cmd_version},
    {"tokenize", "encode {\"text\"} JSONL lines into {\"ids\"} lines with a tokenizer.json", cmd_tokenize},
    {"image", "preprocess one image into pixel_values and image_grid_thw (safetensors)", cmd_image},
    {"init", "write a randomly initialised checkpoint for a preset or config.json", cmd_init},
    {"inspect", "summarise a config (parameter counts) or check a checkpoint directory", cmd_inspect},
    {"convert", "load a checkpoint and save it again (expert layout, sharding)", cmd_convert},
    {"export", "merge a LoRA adapter into its base model (--adapters DIR --merge_lora true --output_dir OUT)",
     cmd_export},
    {"parity", "reference forward + backward on one batch: losses, logits, gradients (safetensors)", cmd_parity},
    {"train", "fine-tune a model on chat JSONL data (checkpoints, metrics, --resume)", cmd_train},
    {"data", "read SFT datasets as training would: samples, tokens, labels, skips, packing", cmd_data},
    {"bench", "time full training steps (forward, backward, AdamW) on the GPU at full widths", cmd_bench},
    {"launch", "start N ranks of a command on this node with torchrun's variables (-- <command>)", cmd_launch},
    {"comm-selftest", "check the communicator across the ranks of a job: every collective, bitwise", cmd_comm_selftest},
    {"plan", "per-GPU memory of a training layout (experts, ZeRO-2, recompute) against a GPU size", cmd_plan},
};

void print_help() {
  std::printf("deltamoe: fine-tunes Qwen3.5-MoE vision-language models\n\nusage: deltamoe <command> [flags]\n\n");
  for (const Command& command : kCommands) std::printf("  %-13s %s\n", command.name, command.summary);
  std::printf("\n'deltamoe <command> --help' lists a command's flags.\n");
}

}  // namespace
}  // namespace deltamoe

int main(int argc, char** argv) {
  using namespace deltamoe;
  // Every kernel loads when the CUDA context starts, not at its first launch: under CUDA's default
  // lazy loading, a kernel first launched in a later step (a choice that follows the batch's
  // lengths, ours or a library's) would take device memory for its code inside that step. Eager
  // loading makes the context ~0.4 GiB larger (measured with cuBLASLt's kernels and ours), which the
  // memory plan's runtime reserve holds. Set before any CUDA call; a CUDA_MODULE_LOADING the user
  // set is kept.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  for (const Command& command : kCommands) {
    if (std::strcmp(argv[1], command.name) != 0) continue;
    try {
      if (wants_launch_from_env(argc, argv)) return launch_from_env(argc, argv);
      return command.run(argc, argv);
    } catch (const Error& error) {
      log_error(error.what());
      return 1;
    } catch (const std::exception& error) {
      log_error("unexpected failure: ", error.what());
      return 1;
    }
  }
  log_error("unknown command '", argv[1], "'; 'deltamoe --help' lists the commands");
  return 2;
}
