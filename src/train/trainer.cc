// The training loop (see trainer.h); the optimizer conventions are those of docs/optimizer.md.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/peft_adapter.h"
#include "core/error.h"
#include "core/kill_point.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/units.h"
#include "data/data_pipeline.h"
#include "data/image_processor_config.h"
#include "optim/loss_scaling.h"
#include "optim/optimizer_step.h"
#include "tokenizer/tokenizer.h"
#include "train/batch_plan.h"
#include "train/dataset_split.h"
#include "train/engine_factory.h"
#include "train/hf_side_files.h"
#include "train/nonfinite_streak.h"
#include "train/rank_checkpoint.h"
#include "train/run_args.h"
#include "train/run_lock.h"
#include "train/run_records.h"
#include "train/step_batch_reader.h"
#include "train/stop_signal.h"
#include "train/train_checkpoint.h"
#include "train/train_data.h"
#include "train/train_metrics.h"
#include "train/trainable_params.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct EvalResult {
  double loss = 0;
  int64_t num_supervised = 0;
  double token_acc = -1;  // -1: the engine does not report it
};

EvalResult evaluate(TrainEngine& engine, const std::vector<MicroBatch>& batches) {
  double ce_sum = 0;
  int64_t num_correct = 0;
  bool has_correct = true;
  EvalResult result;
  for (const MicroBatch& batch : batches) {
    const MicroBatchLoss loss = engine.evaluate(batch);
    ce_sum += loss.ce_sum;
    result.num_supervised += loss.num_supervised;
    has_correct = has_correct && loss.num_correct >= 0;
    num_correct += loss.num_correct;
  }
  const double denominator = static_cast<double>(std::max<int64_t>(1, result.num_supervised));
  result.loss = ce_sum / denominator;
  if (has_correct) result.token_acc = static_cast<double>(num_correct) / denominator;
  return result;
}

}  // namespace

TrainSummary run_training(const TrainOptions& options_in, const std::string& device, const EngineMaker& make_engine,
                          Communicator* world) {
  const bool distributed = world != nullptr && world->size() > 1;
  const int rank = distributed ? world->rank() : 0;
  const int world_size = distributed ? world->size() : 1;
  const bool leader = rank == 0;  // writes the run folder and prints
  TrainOptions options = options_in;
  options.data_parallel_size = world_size;
  validate_train_options(options);
  CHECK(distributed || options.parallel.expert_parallel_size == 1, "--expert_model_parallel_size ",
        options.parallel.expert_parallel_size, " needs as many ranks; start the run through deltamoe launch ",
        "--nproc_per_node N, NPROC_PER_NODE=N, torchrun, mpirun or srun");
  CHECK(!distributed || options.split_dataset_ratio == 0, "--split_dataset_ratio on ", world_size,
        " ranks is not supported yet; split once on one rank (or give --val_dataset)");
  CHECK(!distributed || !make_engine, "train: a stand-in engine cannot run on several ranks");
  CHECK(!distributed || options.tuner_type != "lora", "--tuner_type lora on ", world_size,
        " ranks is not supported yet: LoRA trains on one rank (the adapters are small enough for one device)");
  const Clock::time_point run_start = Clock::now();
  fs::create_directories(options.output_dir);
  std::optional<RunLock> run_lock;  // one run per folder, held to the end (by rank 0 for the job)
  if (leader) {
    run_lock.emplace(options.output_dir);
    if (options.resume.empty()) prepare_fresh_output_dir(options.output_dir, options.overwrite_output_dir);
  }
  if (distributed) world->barrier();  // the folder is ready before any rank reads or writes it

  // Tokenizer and image settings are checked before the weights are read (a full scan of a large model).
  const Tokenizer tokenizer = Tokenizer::load(options.model_dir);
  const SampleOptions samples = sample_options(
      options, load_model_config_file((fs::path(options.model_dir) / "config.json").string()), tokenizer);
  const ModelCheckpoint base = load_model_dir(options.model_dir);
  const ModelConfig& config = base.config;
  const double aux_coef = options.router_aux_loss_coef.value_or(config.text.router_aux_loss_coef);

  std::vector<std::string> train_paths = options.dataset_paths, val_paths = options.val_dataset_paths;
  if (options.split_dataset_ratio > 0) {
    const DatasetSplit split = split_dataset(options.dataset_paths, options.split_dataset_ratio, options.seed,
                                             (fs::path(options.output_dir) / "dataset_split").string(), options.media_dir);
    log_info("train: --split_dataset_ratio ", options.split_dataset_ratio, ": ", split.num_train, " training and ",
             split.num_val, " validation samples (", split.train_path, ", ", split.val_path, ")");
    train_paths = {split.train_path};
    val_paths = {split.val_path};
  }
  const PipelineOptions train_data = pipeline_options(options, samples, train_paths, true);

  const BatchPlan batch_plan = plan_batches(options);
  const int64_t accumulation = batch_plan.accumulation;    // micro-batches per step on each rank
  const int64_t step_micro_batches = accumulation * world_size;  // ... on all ranks
  if (!leader) {
  } else if (batch_plan.global_batch_samples > 0) {
    log_info("train: global batch ", batch_plan.global_batch_samples, " samples = ", accumulation,
             " micro-batches of ", batch_plan.micro_batch_samples, " sample(s) x ", options.data_parallel_size,
             " data-parallel rank(s)");
  } else {
    log_info("train: global batch ", step_micro_batches, " packed micro-batches of <= ", batch_plan.token_budget,
             " tokens", world_size > 1 ? str_cat(" (", accumulation, " on each of ", world_size, " ranks)") : "");
  }
  // Every line once before step 1 (image sizes from headers): the step count, the skips (--strict,
  // --max_skip_ratio) and the longest sample, which sizes the engine.
  const DataSurvey survey = survey_data(train_data, tokenizer, "training data",
                                       leader ? (fs::path(options.output_dir) / "data_skips.jsonl").string() : "");
  check_skip_ratio(survey, options.max_skip_ratio, "training data");
  int64_t longest_sample = survey.longest_sample_tokens;
  if (!val_paths.empty()) {
    const DataSurvey val_survey = survey_data(pipeline_options(options, samples, val_paths, false), tokenizer, "validation data");
    longest_sample = std::max(longest_sample, val_survey.longest_sample_tokens);
  }
  const double steps_per_epoch =
      static_cast<double>((survey.num_micro_batches + step_micro_batches - 1) / step_micro_batches);
  int64_t total_steps = options.max_steps;
  if (total_steps <= 0) {
    const int64_t batches = survey.num_micro_batches;
    CHECK(batches > 0, "--dataset: no usable samples (all skipped; see the messages above)");
    const int64_t per_epoch = (batches + step_micro_batches - 1) / step_micro_batches;
    total_steps = per_epoch * options.num_train_epochs;
    log_info("train: ", batches, " micro-batches per epoch, ", per_epoch, " steps per epoch, ", total_steps,
             " steps");
  }
  LrScheduleConfig schedule_config = options.schedule;
  schedule_config.total_steps = total_steps;
  validate_lr_schedule(schedule_config);
  const LrSchedule schedule(schedule_config);

  // The engine owns the training state on its device (weights, master, gradients, moments).
  EngineOptions engine_options;
  engine_options.freeze = options.freeze;
  if (options.tuner_type == "lora") {
    // Seeded as PEFT initialises them; a resumed run overwrites them with the saved values.
    engine_options.lora = std::make_shared<const LoraAdapters>(init_lora_adapters(config, options.lora, options.seed));
    log_info("train: LoRA r ", options.lora.rank, ", alpha ", options.lora.alpha, " (scaling ",
             options.lora.scaling(), ") on ", engine_options.lora->targets.size(), " weights",
             engine_options.lora->modules_to_save.empty() ? std::string()
                                                          : str_cat(", ", engine_options.lora->modules_to_save.size(),
                                                                    " tensors of --modules_to_save"),
             "; the base model stays frozen");
  }
  engine_options.adamw = options.adamw;
  engine_options.expert_grad_dtype = options.expert_grad_dtype;
  engine_options.recompute = options.recompute;
  engine_options.aux_coef = aux_coef;
  engine_options.max_tokens = engine_token_budget(batch_plan, longest_sample);
  engine_options.max_samples = batch_plan.micro_batch_samples;
  engine_options.max_image_pixels = samples.image_config.max_pixels;
  std::unique_ptr<TrainEngine> engine =
      distributed   ? make_train_engine(device, base, engine_options, *world, options.parallel)
      : make_engine ? make_engine(base, engine_options)
                    : make_train_engine(device, base, engine_options);
  // Every trained tensor whole: what a checkpoint holds whatever the ranks hold.
  const ParamLayout full_layout = engine_options.lora != nullptr ? lora_layout(base, *engine_options.lora)
                                                                : trainable_layout(base, options.freeze);
  const ParamLayout& layout = engine->state().layout();
  if (!distributed) {
    log_info("train: ", layout.num_tensors(), " trainable tensors, ", layout.num_parameters(), " parameters (of ",
             base.params.size(), " tensors)");
  } else {
    if (leader) {
      log_info("train: ", full_layout.num_tensors(), " trainable tensors, ", full_layout.num_parameters(),
               " parameters (of ", base.params.size(), " tensors) over ", world_size, " ranks, expert parallel ",
               options.parallel.expert_parallel_size, ", ZeRO-2");
    }
    log_info("train: rank ", rank, " holds ", layout.num_tensors(), " pieces of them, ", layout.num_parameters(),
             " parameters");
  }

  TrainerState state;
  state.total_steps = total_steps;
  state.rng_seed = options.seed;
  OptimizerProgress progress;
  const bool resuming = !options.resume.empty();
  if (resuming) {
    // Rank 0 (holding the run lock) first clears what an interrupted save left; then the others
    // find the same checkpoint.
    std::string dir;
    if (leader) dir = resolve_resume_dir(options.resume, options.output_dir);
    if (distributed) world->barrier();
    if (!leader) dir = resolve_resume_dir(options.resume, options.output_dir);
    state = load_trainer_state(dir);
    CHECK(!state.model_only, "--resume ", dir, ": it was saved with --save_only_model (model weights only, no ",
          "optimizer state), so the run cannot continue exactly from it; start a new run with --model ", dir);
    CHECK(state.total_steps == total_steps, "--resume ", dir, ": that run had ", state.total_steps,
          " total steps, this one has ", total_steps, "; keep --max_steps / --num_train_epochs / ",
          "--global_batch_size / --micro_batch_size / --gradient_accumulation_steps as they were");
    progress = load_checkpoint_optimizer(dir, &engine->state(), &full_layout);
    CHECK(progress.schedule_step == state.global_step, dir, ": optimizer state is at step ", progress.schedule_step,
          " but trainer_state.json at ", state.global_step);
    check_resume_args(dir, options);  // a changed --lr etc. is refused unless --ignore_args_check
    log_info("train: resuming from ", dir, " at step ", state.global_step, "/", total_steps);
  }
  // args.json: this run's options, in the run folder and (without where it runs) in each checkpoint.
  if (leader) write_run_args(options.output_dir, train_options_to_json(options).dump(2));
  const std::string run_args = train_options_to_json(options, RunArgsCopy::kCheckpoint).dump(2);
  Rng rng(state.rng_seed);
  rng.seek(state.rng_position);

  // MFU needs the device's peak: --peak_tflops, else the GPU's spec-sheet value by name.
  const double peak_tflops =
      options.peak_tflops > 0 ? options.peak_tflops : default_peak_tflops(engine->accelerator_name());
  if (!engine->accelerator_name().empty()) {
    log_info("train: ", engine->device_name(), " is ", engine->accelerator_name(), "; MFU against ",
             peak_tflops > 0 ? str_cat(peak_tflops, " TFLOP/s peak") : std::string("no known peak (--peak_tflops)"));
  }

  std::vector<MicroBatch> val_batches;
  if (!val_paths.empty()) {
    DataPipeline val_pipeline(pipeline_options(options, samples, val_paths, false), tokenizer);
    while (auto batch = val_pipeline.next_batch()) val_batches.push_back(std::move(*batch));
    CHECK(!val_batches.empty(), "--val_dataset: no usable samples");
  }

  std::optional<MetricsLog> metrics;
  std::optional<RunRecords> records;  // TensorBoard, the progress line's context, the plot
  if (leader) {
    metrics.emplace((fs::path(options.output_dir) / "metrics.jsonl").string(), resuming ? state.global_step : -1);
    records.emplace(options, steps_per_epoch);
  }
  TrainSummary summary;
  summary.total_steps = total_steps;
  summary.device = engine->device_name();
  auto run_eval = [&](int64_t step) {
    const EvalResult result = evaluate(*engine, val_batches);  // a collective with expert parallelism
    if (leader) {
      metrics->write_eval(step, result.loss, result.token_acc, result.num_supervised);
      records->on_eval(step, result.loss, result.token_acc);
    }
    if (leader) std::printf("eval step %lld/%lld | val_loss %.4f | token_acc %.3f (%lld supervised tokens)\n",
                static_cast<long long>(step), static_cast<long long>(total_steps), result.loss, result.token_acc,
                static_cast<long long>(result.num_supervised));
    std::fflush(stdout);
    if (!summary.has_val) {
      summary.first_val_loss = result.loss;
      summary.first_val_token_acc = result.token_acc;
    }
    summary.last_val_token_acc = result.token_acc;
    summary.has_val = true;
    summary.last_val_loss = result.loss;
  };
  // A resumed run evaluated this step before it was saved (its line is kept in the metrics).
  if (!val_batches.empty() && !resuming) run_eval(state.global_step);

  NonFiniteStreak nonfinite(options.max_nonfinite_steps);
  SaveOptions model_save_options;
  model_save_options.max_shard_bytes = options.max_shard_bytes;
  // Several ranks: rank 0 creates the save's temporary folder and the model files (headers, at their
  // final size; the first barrier); then every rank writes its own byte ranges of them and its own
  // optimizer state, syncs both and votes; rank 0 commits (renames the folder into place) only when
  // every rank's part is on disk, so a rank that dies or fails mid-save leaves a .tmp folder that
  // is never resumed from (and is removed by the next start).
  auto write_rank_files_and_vote = [&](const RankModelShare& share, const std::string& temp_dir) {
    world->barrier();  // rank 0 has made the folder and created the model files
    world->set_activity(str_cat("save at step ", state.global_step, ": this rank's model bytes and optimizer state"));
    int64_t failed = 0;
    std::string why;
    try {
      write_model_dir_ranges(share.layout, temp_dir, share.ranges);  // pwrite, then fsync of each file
      kill_point("save_rank_files", state.global_step);
      if (!options.save_only_model) {
        save_optimizer_state((fs::path(temp_dir) / optimizer_rank_file(rank, world_size)).string(), engine->state(),
                             progress);  // written to a temporary name, synced, renamed, synced
      }
    } catch (const std::exception& error) {
      failed = 1;
      why = error.what();
      log_error("train: rank ", rank, " could not write its part of the checkpoint: ", why);
    }
    world->set_activity(str_cat("save vote at step ", state.global_step));
    int64_t any_failed = 0;
    world->all_reduce(&failed, &any_failed, 1, DType::i64, ReduceOp::max);
    CHECK(any_failed == 0, "save at step ", state.global_step, ": ",
          failed ? str_cat("this rank's part could not be written (", why, ")")
                 : std::string("another rank could not write its part (its log says why)"),
          "; nothing was committed, the previous checkpoints are as they were");
  };
  auto save = [&]() {
    CHECK(!nonfinite.in_streak(), nonfinite.refused_save_message());  // keep the last good checkpoint
    // Several ranks: each writes the bytes of the model files it owns (rank_checkpoint.h); the
    // layout of every file is computed by every rank alike, so nothing is gathered.
    std::optional<RankModelShare> share;
    if (distributed) {
      world->set_activity(str_cat("save at step ", state.global_step));
      share.emplace(plan_rank_model_share(*world, base, engine->state(), engine->parallel_layout(), model_save_options));
      uint64_t my_bytes = share->range_bytes();
      if (!options.save_only_model) my_bytes += optimizer_state_file_bytes(engine->state());
      if (leader) my_bytes += (1 << 20) + share->layout.metadata_bytes() + side_files_bytes(options.model_dir);
      check_save_space_on_ranks(*world, options.output_dir, state.global_step, my_bytes, !options.save_only_model);
      if (!leader) {
        write_rank_files_and_vote(*share, checkpoint_temp_dir(options.output_dir, state.global_step));
        world->barrier();  // rank 0 has committed the checkpoint
        return;
      }
    }
    const TrainStateStore& train_state = engine->state();
    CheckpointPayload payload;
    // LoRA: the checkpoint is a PEFT adapter directory (the adapters' current values), full tuning a
    // whole model directory.
    const bool lora = engine_options.lora != nullptr;
    const ModelCheckpoint weights = lora || distributed ? ModelCheckpoint{} : checkpoint_with_state(base, train_state);
    const LoraAdapters adapters = lora ? lora_adapters_from_state(*engine_options.lora, train_state) : LoraAdapters{};
    payload.model = lora ? nullptr : distributed ? &share->weights : &weights;
    payload.model_layout = distributed ? &share->layout : nullptr;
    payload.adapters = lora ? &adapters : nullptr;
    payload.adapter_base_model = fs::absolute(options.model_dir).string();
    payload.side_files_dir = options.model_dir;
    payload.write_extra_files = [&](const std::string& dir) {
      write_run_args(dir, run_args);
      write_missing_side_files(dir, config, options.chat_format);
    };
    payload.max_shard_bytes = options.max_shard_bytes;
    payload.train_state = options.save_only_model || distributed ? nullptr : &train_state;
    if (distributed) {
      payload.rank_files_commit = [&](const std::string& dir) { write_rank_files_and_vote(*share, dir); };
    }
    payload.progress = progress;
    state.rng_position = rng.position();
    payload.state = state;
    payload.state.model_only = options.save_only_model;
    summary.last_checkpoint = save_training_checkpoint(options.output_dir, payload);
    if (options.save_total_limit > 0) remove_old_checkpoints(options.output_dir, options.save_total_limit);
    std::printf("saved %s\n", summary.last_checkpoint.c_str());
    std::fflush(stdout);
    if (distributed) world->barrier();
  };

  const StopSignalGuard stop_guard;  // SIGTERM / SIGINT / SIGHUP: finish the step, save, return
  // The training pipeline packs measured samples (image grids from headers); the step reader loads
  // the images of this rank's micro-batches only (step_batch_reader.h), on any number of ranks.
  PipelineOptions packing = train_data;
  packing.sample.measure_images_only = true;
  DataPipeline pipeline(packing, tokenizer, state.data_position);
  const double elapsed_before = state.elapsed_s;
  const Clock::time_point loop_start = Clock::now();
  bool saved_at_step = false;
  double run_flops = 0, run_step_s = 0;  // for the summary's MFU
  // The stop signal as every rank sees it: a signal that reached one rank (a preemption notice, a
  // kill of one process) stops all of them at the same step boundary, so that they save one
  // consistent checkpoint together. One all-reduce of one value per check.
  auto agreed_stop_signal = [&]() -> int {
    const int64_t mine = StopSignalGuard::stop_signal();
    if (!distributed) return static_cast<int>(mine);
    int64_t agreed = 0;
    world->all_reduce(&mine, &agreed, 1, DType::i64, ReduceOp::max);
    return static_cast<int>(agreed);
  };
  auto stop_for_signal = [&](int signal) {
    if (!saved_at_step && summary.steps_this_run > 0) save();
    saved_at_step = true;
    log_warn("train: stopped by signal ", signal,
             distributed && StopSignalGuard::stop_signal() == 0 ? " (received by another rank)" : "", " after step ",
             state.global_step, "; continue with --resume auto");
    summary.stopped_by_signal = signal;
  };
  // Reads whole global batches and keeps this rank's micro-batches g * world + rank (all of them on one rank).
  StepBatchReader reader(pipeline, train_data.sample, step_micro_batches, StepShare{rank, world_size},
                         std::max(1, options.num_workers));  // after the pipeline: joins its reads before it goes
  while (state.global_step < total_steps) {
    const Clock::time_point step_start = Clock::now();
    StepBatches step_batches = reader.take(/*read_ahead=*/state.global_step + 1 < total_steps);
    const double data_wait_s = seconds_since(step_start);
    const int64_t read = step_batches.num_read;
    const DataPosition position_after = step_batches.position_after;
    std::vector<MicroBatch> batches = std::move(step_batches.batches);
    if (distributed) world->set_activity(str_cat("step ", state.global_step + 1, " start"));
    const int stop_signal = agreed_stop_signal();
    if (distributed && read % world_size != 0 && stop_signal == 0) {
      log_warn("train: the data ended inside step ", state.global_step + 1, " with ", read, " micro-batches, not a ",
               "multiple of the ", world_size, " ranks; that step is dropped");
      break;
    }
    if (stop_signal != 0) {  // while the step's data was read: that step is dropped
      stop_for_signal(stop_signal);
      break;
    }
    if (batches.empty()) {
      log_warn("train: the data ended at step ", state.global_step, " of ", total_steps);
      break;
    }
    int64_t step_supervised = 0;
    for (const MicroBatch& batch : batches) step_supervised += batch.num_supervised;
    if (step_supervised == 0) {
      log_warn("train: step ", state.global_step + 1, " has no supervised tokens; only the aux loss trains");
    }
    const double lr = schedule.lr_at(progress.schedule_step);
    // Failure messages name the step (and DELTAMOE_FAULT's at:step N aims at it).
    if (distributed) world->set_activity(str_cat("step ", state.global_step + 1));
    const StepResult result = engine->train_step(batches, lr, options.max_grad_norm);
    if (result.skipped) ++progress.skipped_steps;
    ++progress.schedule_step;
    GlobalBatchLoss loss(GlobalBatchCounts{result.num_supervised, result.num_micro_batches}, aux_coef);
    loss.add_partial(result.ce_sum, result.num_supervised, result.aux_loss_sum);
    const int64_t num_tokens = result.num_tokens, num_correct = result.num_correct;
    const double step_flops = result.flops;
    StepReport report;
    report.lr = lr;
    report.grad_norm = result.grad_norm;
    report.skipped = result.skipped;

    ++state.global_step;
    ++summary.steps_this_run;
    saved_at_step = false;
    state.tokens_seen += num_tokens;
    state.data_position = position_after;
    state.elapsed_s = elapsed_before + seconds_since(loop_start);

    StepMetrics step;
    step.step = state.global_step;
    step.total_steps = total_steps;
    step.epoch = step_batches.epoch;
    step.ce_loss = loss.ce_loss();
    step.aux_loss = loss.weighted_aux_loss();
    step.loss = loss.total_loss();
    step.lr = report.lr;
    step.grad_norm = report.grad_norm;
    step.skipped = report.skipped;
    step.num_tokens = num_tokens;
    step.num_supervised = result.num_supervised;
    for (const MicroBatch& batch : batches) {
      step.num_images += static_cast<int64_t>(batch.image_grid_thw.size());
      step.num_image_tokens += batch.num_image_tokens;
    }
    step.data_wait_s = data_wait_s;
    step.token_acc = num_correct < 0 ? -1.0
                                     : static_cast<double>(num_correct) /
                                           static_cast<double>(std::max<int64_t>(1, result.num_supervised));
    step.step_s = seconds_since(step_start);
    step.tokens_per_s = step.step_s > 0 ? static_cast<double>(num_tokens) / step.step_s : 0.0;
    step.elapsed_s = state.elapsed_s;
    if (step_flops > 0 && step.step_s > 0) {
      step.tflops = step_flops / step.step_s / 1e12;
      if (peak_tflops > 0) step.mfu = step.tflops / peak_tflops;
      run_flops += step_flops;
      run_step_s += step.step_s;
      if (peak_tflops > 0) summary.mfu = run_flops / run_step_s / 1e12 / peak_tflops;
    }
    if (result.host_to_device_bytes + result.device_to_host_bytes > 0) {
      step.h2d_bytes = static_cast<int64_t>(result.host_to_device_bytes);
      step.d2h_bytes = static_cast<int64_t>(result.device_to_host_bytes);
    }
    const size_t peak_memory = engine->peak_memory_bytes();
    if (peak_memory > 0) summary.peak_mem_gib = step.peak_mem_gib = gib(peak_memory);
    const double mean_step_s = seconds_since(loop_start) / static_cast<double>(summary.steps_this_run);
    step.eta_s = mean_step_s * static_cast<double>(total_steps - state.global_step);
    if (leader) {
      metrics->write_step(step);
      records->on_step(step);
    }
    if (nonfinite.record(state.global_step, step.loss, report.grad_norm)) RAISE(nonfinite.stop_message());
    if (summary.steps_this_run == 1) summary.first_loss = step.loss;
    summary.last_loss = step.loss;
    if (report.skipped) log_warn("train: step ", step.step, ": gradient norm is not finite; update skipped");
    const bool last = state.global_step == total_steps;
    if (leader && (state.global_step % options.logging_steps == 0 || last || summary.steps_this_run == 1)) {
      std::printf("%s\n", records->progress_line(step).c_str());
      std::fflush(stdout);
    }
    if (!val_batches.empty() && ((options.eval_steps > 0 && state.global_step % options.eval_steps == 0) || last)) {
      run_eval(state.global_step);
    }
    if ((options.save_steps > 0 && state.global_step % options.save_steps == 0 && !nonfinite.in_streak()) || last) {
      save();
      saved_at_step = true;
    }
    if (options.stop_after_steps > 0 && summary.steps_this_run >= options.stop_after_steps && !last) {
      if (!saved_at_step) save();
      saved_at_step = true;  // (the save after the loop would write the same checkpoint again)
      log_info("train: stopping after ", summary.steps_this_run, " steps (--stop_after_steps); continue with ",
               "--resume auto");
      break;
    }
    if (!last) {
      if (distributed) world->set_activity(str_cat("step ", state.global_step, " end"));
      if (const int signal = agreed_stop_signal(); signal != 0) {
        stop_for_signal(signal);
        break;
      }
    }
  }
  if (!saved_at_step && summary.steps_this_run > 0) save();
  summary.steps_done = state.global_step;
  summary.elapsed_s = seconds_since(run_start);
  reader.finish();
  summary.data_skips = pipeline.skip_stats().summary();
  if (leader) records->finish();  // OUTPUT_DIR/images/training.png
  return summary;
}

}  // namespace deltamoe
