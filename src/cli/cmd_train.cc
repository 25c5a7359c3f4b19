// `deltamoe train`: flags (with ms-swift / Megatron / transformers names), a YAML or JSON config file
// and ms-swift's environment variables -> TrainOptions -> the training loop; prints the progress
// lines, the evaluation results and a summary.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/swift_env.h"
#include "cli/train_flags.h"
#include "core/error.h"
#include "core/log.h"
#include "data/sample_source.h"
#include "parallel/world.h"
#include "train/trainer.h"

namespace deltamoe {

int cmd_train(int argc, char** argv) {
  ArgParser args("train", "full-parameter SFT of a Qwen3.5-MoE model on chat data");
  declare_train_flags(args);
  if (!args.parse(argc, argv)) return 0;
  const SwiftEnv env = read_swift_env();
  if (!env.problems.empty()) {
    std::string lines;
    for (const std::string& problem : env.problems) lines += "\n  " + problem;
    RAISE("'deltamoe train': ms-swift's environment variables:", lines);
  }
  for (const std::string& note : args.notes()) log_info("train: ", note);
  for (const std::string& note : env.notes) log_info("train: ", note);
  TrainOptionsRequest request;
  TrainOptions options = train_options_from_args(args, env, request);
  resolve_train_options(options, request);
  // A rank of a job (deltamoe launch, NPROC_PER_NODE, torchrun, mpirun, srun) joins its world first.
  const LaunchEnv launch = read_launch_env();
  for (const std::string& note : launch.notes) log_info("train: ", note);
  std::unique_ptr<Communicator> world;
  if (launch.world_size > 1) world = connect_world(launch, CommOptions::from_env());
  TrainSummary summary;
  try {
    summary = run_training(options, args.get("device"), nullptr, world.get());
  } catch (const CommAborted&) {
    return kExitCommAborted;  // the control plane has said why
  } catch (const std::exception& error) {
    if (world) world->abort(str_cat("train failed on rank ", world->rank(), ": ", error.what()));
    throw;
  }
  if (world && world->rank() != 0) return summary.stopped_by_signal != 0 ? 128 + summary.stopped_by_signal : 0;

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
