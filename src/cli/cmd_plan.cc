// `deltamoe plan`: the per-GPU memory of a training layout before any GPU is touched: weights,
// master, gradients, moments, activations, expert exchange buffers, workspace and reserve for a
// model (preset or config.json), a number of GPUs, --expert_model_parallel_size, ZeRO-2, tokens
// per micro-batch, moment dtype and recompute choice, against a GPU memory size. The planner is the
// one a training run checks itself with (train/memory_plan.h, train/parallel_memory_plan.h).
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/expert_recv_flag.h"
#include "cli/grad_dtype_flag.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/units.h"
#include "model/config.h"
#include "train/parallel_memory_plan.h"

namespace deltamoe {

int cmd_plan(int argc, char** argv) {
  ArgParser args("plan", "per-GPU memory of a training layout (no GPU needed)");
  args.add_option("model", "a preset (qwen3.5-35b-a3b, tiny-vl, ...) or a model directory / config.json",
                  "qwen3.5-35b-a3b");
  args.add_option("nproc", "GPUs of the job (the data-parallel size of the non-expert tensors)", "1");
  args.add_option("expert_model_parallel_size", "GPUs the routed experts of each layer are split over", "1");
  args.add_bool("use_distributed_optimizer", "ZeRO-2: non-expert gradients, master and moments sharded", false);
  args.add_option("micro_batch_tokens", "tokens per micro-batch on each GPU", "8192");
  args.add_option("micro_batch_size",
                  "most samples packed into one micro-batch (0: any number, sized for one sample per 8 tokens)",
                  "0");
  args.add_option("optimizer_state_dtype", "f32 or bf16 Adam moments", "f32");
  declare_expert_grad_dtype_flag(args);
  args.add_option("recompute",
                  "none, selective (one set of GDN/attention internals per layer type) or full (every decoder "
                  "layer keeps only its input and is rerun in the backward): the engine's --recompute",
                  "none");
  args.add_bool("images", "plan the vision tower for image tokens (false: text-only micro-batches)", false);
  args.add_option("max_pixels", "largest image after resizing, with --images true", "1003520");
  args.add_bool("freeze_vit", "the vision tower is frozen", false);
  args.add_bool("freeze_aligner", "the merger is frozen", false);
  args.add_option("gpu_memory_gib", "usable memory of one GPU in GiB (0: print the plan only)", "0");
  declare_expert_recv_headroom_flag(args, "auto");
  if (!args.parse(argc, argv)) return 0;

  const std::string model = args.get("model");
  ModelConfig config;
  if (std::filesystem::is_directory(model)) {
    config = load_model_config_file((std::filesystem::path(model) / "config.json").string());
  } else if (std::filesystem::is_regular_file(model)) {
    config = load_model_config_file(model);
  } else {
    config = model_config_preset(model);
  }
  EngineOptions options;
  options.freeze = FreezeOptions{args.flag("freeze_vit"), args.flag("freeze_aligner"), false};
  options.max_tokens = args.get_int("micro_batch_tokens");
  CHECK(options.max_tokens > 0, "--micro_batch_tokens must be positive");
  options.max_image_pixels = args.get_int("max_pixels");
  options.max_samples = args.get_int("micro_batch_size");
  CHECK(options.max_samples >= 0, "--micro_batch_size must be >= 0, got ", options.max_samples);
  const std::string moments = args.get("optimizer_state_dtype");
  CHECK(moments == "f32" || moments == "bf16", "--optimizer_state_dtype must be f32 or bf16, got '", moments, "'");
  options.adamw.moment_dtype = moments == "bf16" ? DType::bf16 : DType::f32;
  options.expert_grad_dtype = parse_expert_grad_dtype_flag(args);
  ParallelPlanOptions parallel;
  parallel.world = static_cast<int>(args.get_int("nproc"));
  parallel.layout.expert_parallel_size = static_cast<int>(args.get_int("expert_model_parallel_size"));
  parallel.layout.distributed_optimizer = args.flag("use_distributed_optimizer");
  parallel.images = args.flag("images");
  parallel.layout.expert_recv_headroom = parse_expert_recv_headroom(args.get("expert_recv_headroom"));
  const double gpu_gib = args.get_double("gpu_memory_gib");
  CHECK(gpu_gib >= 0, "--gpu_memory_gib must be >= 0, got ", gpu_gib);
  parallel.gpu_memory_bytes = static_cast<size_t>(gpu_gib * kBytesPerGib);
  CHECK(parse_recompute_choice(args.get("recompute"), &parallel.recompute), "--recompute must be none, selective or full, ",
        "got '", args.get("recompute"), "'");
  const ParallelMemoryPlan plan = plan_parallel_memory(config, options, parallel);
  std::printf("plan: %s on %d GPU(s), EP %d, %s, %lld tokens (at most %lld samples) per micro-batch, %s moments, "
              "recompute %s\n",
              model.c_str(), parallel.world, parallel.layout.expert_parallel_size,
              parallel.layout.distributed_optimizer ? "ZeRO-2" : "dense state replicated",
              static_cast<long long>(options.max_tokens), static_cast<long long>(planned_max_sequences(options)),
              moments.c_str(), recompute_choice_name(parallel.recompute));
  std::printf("%s", plan.describe().c_str());
  if (gpu_gib > 0) {
    const double need = gib(plan.total());
    std::printf("%s: %.1f GiB of %.1f GiB\n", need <= gpu_gib ? "fits" : "does not fit", need, gpu_gib);
    return need <= gpu_gib ? 0 : 3;
  }
  return 0;
}

}  // namespace deltamoe
