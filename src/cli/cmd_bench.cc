// `deltamoe bench`: full training steps of the GPU engine `train` runs (forward, backward, the
// device optimizer step) at the Qwen3.5-35B-A3B widths with reduced depth and random weights, on
// synthetic packed micro-batches; with --images the samples carry images of the given sizes through
// the vision tower. Prints step time, tokens/s, model TFLOP/s, MFU, the memory plan and time by
// component (CUDA events), then the same steps back to back (one synchronisation around them all,
// the host preparing each batch while the GPU runs the previous optimizer step). With
// --simulate_expert_parallel N it runs rank 0 of an N-GPU job (MirrorComm: the exchange as device
// copies) and prints the N-GPU step the exchange model predicts. Needs a CUDA build.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli/args.h"
#include "cli/expert_recv_flag.h"
#include "cli/grad_dtype_flag.h"
#include "cli/recompute_flags.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/units.h"
#include "data/packer.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "train/memory_plan.h"
#include "train/step_floors.h"
#include "train/train_engine.h"

#if DELTAMOE_WITH_CUDA
#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/common/kernel_path_cuda.h"
#include "model/param_table.h"
#include "parallel/comm_options.h"
#include "parallel/control_plane.h"
#include "parallel/exchange_model.h"
#include "parallel/gpu/mirror_comm.h"
#include "parallel/gpu/nccl_comm.h"
#include "parallel/launch_env.h"
#include "parallel/thread_comm.h"
#include "parallel/world.h"
#include "train/gpu/gpu_engine.h"
#include "train/parallel_layout.h"
#endif

namespace deltamoe {

namespace {

constexpr double kPeakDenseBf16Tflops = kH200PeakMatmulFlopsPerSecond / 1e12;  // H200 spec sheet, dense bf16
constexpr double kMeasuredDenseBf16Tflops = 790.0;  // measured cuBLAS bf16 GEMM on the H200 (docs/performance.md)

// "16x16,20x24" -> merged-token grids (h, w) of the images each sample carries in turn.
std::vector<std::pair<int64_t, int64_t>> parse_image_grids(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> grids;
  if (text.empty()) return grids;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    const size_t x = item.find('x');
    CHECK(x != std::string::npos, "--images: '", item, "' is not HxW (merged tokens, e.g. 16x16)");
    const int64_t h = std::stoll(item.substr(0, x)), w = std::stoll(item.substr(x + 1));
    CHECK(h >= 1 && w >= 1 && h * w <= 16384, "--images: '", item, "' must be positive and at most 16384 tokens");
    grids.emplace_back(h, w);
  }
  return grids;
}

// One synthetic micro-batch: one sample per entry of `lengths` (tokens). Each sample is text, then
// (with images) as many images as fit in image_fraction of it, each between <|vision_start|> and
// <|vision_end|>, then text; the text after the first image is supervised (as an answer would be).
MicroBatch synthetic_batch(const ModelConfig& config, const std::vector<int64_t>& lengths,
                           const std::vector<std::pair<int64_t, int64_t>>& grids, double image_fraction, Rng& rng,
                           size_t* next_grid) {
  const int64_t seqs = static_cast<int64_t>(lengths.size());
  const int64_t text_vocab = std::min<int64_t>(config.text.vocab_size, config.image_token_id > 0 ? 240000 : 1 << 30);
  const int64_t merge = config.vision.spatial_merge_size;
  MicroBatch batch;
  std::vector<GridThw> image_grids;
  batch.cu_seqlens = {0};
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t seq_len = lengths[static_cast<size_t>(s)];
    const int64_t start = static_cast<int64_t>(batch.input_ids.size());
    auto text = [&](int64_t count, bool supervised) {
      for (int64_t i = 0; i < count; ++i) {
        const int32_t id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(text_vocab)));
        batch.input_ids.push_back(id);
        batch.labels.push_back(supervised ? id : -100);
      }
    };
    text(8, false);
    int64_t image_budget = static_cast<int64_t>(image_fraction * static_cast<double>(seq_len));
    while (!grids.empty()) {
      const auto [h, w] = grids[*next_grid % grids.size()];
      if (h * w + 2 > image_budget || static_cast<int64_t>(batch.input_ids.size()) - start + h * w + 2 + 8 > seq_len)
        break;
      ++*next_grid;
      image_budget -= h * w + 2;
      batch.input_ids.push_back(static_cast<int32_t>(config.vision_start_token_id));
      batch.labels.push_back(-100);
      for (int64_t i = 0; i < h * w; ++i) {
        batch.input_ids.push_back(static_cast<int32_t>(config.image_token_id));
        batch.labels.push_back(-100);
      }
      batch.input_ids.push_back(static_cast<int32_t>(config.vision_end_token_id));
      batch.labels.push_back(-100);
      image_grids.push_back({1, h * merge, w * merge});
      batch.image_grid_thw.push_back({1, h * merge, w * merge});
    }
    text(start + seq_len - static_cast<int64_t>(batch.input_ids.size()), true);
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.sample_indices.push_back(s);
  }
  for (int32_t label : batch.labels) batch.num_supervised += label != -100;
  const int64_t T = batch.num_tokens();
  const std::vector<int64_t> ids(batch.input_ids.begin(), batch.input_ids.end());
  batch.positions = compute_mrope_positions(ids.data(), T, batch.cu_seqlens, image_grids, {}, merge,
                                            config.image_token_id, config.video_token_id);
  const int64_t patches = batch.num_patches();
  batch.pixel_values.resize(static_cast<size_t>(patches * config.vision.patch_dim()));
  for (float& value : batch.pixel_values) value = static_cast<float>(rng.normal());
  batch.num_image_tokens = patches / (merge * merge);
  return batch;
}

// Sample lengths of a micro-batch: `seqs` equal ones filling `tokens`; or, varied, between 1 and
// `seqs` samples of random lengths (at least 16 tokens each) filling between half of `tokens` and
// all of it, a multiple of 8 (a new packing and token count every step).
std::vector<int64_t> sample_lengths(int64_t tokens, int64_t seqs, bool varied, Rng& rng) {
  if (!varied) return std::vector<int64_t>(static_cast<size_t>(seqs), tokens / seqs);
  const int64_t total = (tokens / 2 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(tokens / 2 + 1)))) / 8 * 8;
  const int64_t n = std::min<int64_t>(1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(seqs))), total / 16);
  std::vector<int64_t> lengths(static_cast<size_t>(n), 16);
  for (int64_t left = total - 16 * n; left > 0;) {  // the rest in random pieces to random samples
    const int64_t piece = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(total))));
    lengths[static_cast<size_t>(rng.below(static_cast<uint64_t>(n)))] += piece;
    left -= piece;
  }
  return lengths;
}

#if DELTAMOE_WITH_CUDA

// A step's packing as the step lines print it: its samples and its longest sample, over its
// micro-batches (what a library that sizes work by sequence could key on).
struct PackingShape {
  int64_t samples = 0;
  int64_t longest = 0;
};
PackingShape packing_shape(const std::vector<MicroBatch>& batches) {
  PackingShape shape;
  for (const MicroBatch& batch : batches) {
    shape.samples += batch.num_samples();
    for (size_t i = 0; i + 1 < batch.cu_seqlens.size(); ++i)
      shape.longest = std::max<int64_t>(shape.longest, batch.cu_seqlens[i + 1] - batch.cu_seqlens[i]);
  }
  return shape;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

int run_bench(const ArgParser& args) {
  const int64_t layers = args.get_int("layers"), tokens = args.get_int("tokens"), seqs = args.get_int("seqs");
  const int64_t steps = args.get_int("steps"), warmup = args.get_int("warmup");
  const int64_t micro_batches = args.get_int("micro_batches");
  CHECK(layers >= 1, "--layers must be at least 1, got ", layers);
  CHECK(seqs >= 1, "--seqs must be at least 1, got ", seqs);
  CHECK(tokens >= seqs && tokens % seqs == 0, "--tokens (", tokens, ") must be a positive multiple of --seqs (", seqs,
        ")");
  CHECK(steps >= 1, "--steps must be at least 1, got ", steps);
  CHECK(warmup >= 0, "--warmup must be non-negative, got ", warmup);
  CHECK(micro_batches >= 1, "--micro_batches must be at least 1, got ", micro_batches);
  const std::string moments = args.get("optimizer_state_dtype");
  CHECK(moments == "f32" || moments == "bf16", "--optimizer_state_dtype must be f32 or bf16, got '", moments, "'");
  const std::vector<std::pair<int64_t, int64_t>> grids = parse_image_grids(args.get("images"));
  const double image_fraction = args.get_double("image_fraction");
  CHECK(image_fraction >= 0 && image_fraction < 1, "--image_fraction must be in [0, 1), got ", image_fraction);
  const ModelConfig config = reduced_depth_config(resolve_model_config(args.get("config")), layers, grids.empty());

  EngineOptions options;
  options.freeze = FreezeOptions{args.get("freeze_vit") == "true", args.get("freeze_aligner") == "true",
                                 args.get("freeze_llm") == "true"};
  options.adamw.moment_dtype = moments == "bf16" ? DType::bf16 : DType::f32;
  options.expert_grad_dtype = parse_expert_grad_dtype_flag(args);
  options.aux_coef = args.get_double("aux_loss_coef");
  options.max_tokens = tokens;
  options.max_samples = seqs;
  options.loss_chunk_rows = args.get_int("loss_chunk");
  options.recompute = parse_recompute_flags(args);
  int64_t largest_image = 0;
  for (const auto& [h, w] : grids) largest_image = std::max(largest_image, h * w);
  const int64_t token_side = config.vision.patch_size * config.vision.spatial_merge_size;
  options.max_image_pixels = largest_image * token_side * token_side;
  const std::string tuner = args.get("tuner_type");
  CHECK(tuner == "full" || tuner == "lora", "--tuner_type must be full or lora, got '", tuner, "'");
  if (tuner == "lora") {
    // PEFT's init (B zero) would give every step the same loss curve as the frozen model at first;
    // the bench times the products, which do not depend on the values.
    LoraOptions lora;
    lora.rank = args.get_int("lora_rank");
    lora.alpha = args.get_double("lora_alpha");
    lora.dropout = args.get_double("lora_dropout");
    lora.target_modules = args.get_list("target_modules");
    lora.target_parameters = args.get_list("target_parameters");
    options.lora = std::make_shared<const LoraAdapters>(
        init_lora_adapters(config, lora, static_cast<uint64_t>(args.get_int("seed"))));
  }
  // --simulate_expert_parallel N: this process is rank 0 of N identical ranks (MirrorComm): its own
  // experts (1/N of each layer's) receive the rows of all N ranks, the dense state is its ZeRO-2
  // piece, and every exchange is a same-size copy on the device (design §4.4).
  const int simulated_ranks = static_cast<int>(args.get_int("simulate_expert_parallel"));
  CHECK(simulated_ranks >= 0, "--simulate_expert_parallel must be 0 (off) or the GPUs to simulate, got ",
        simulated_ranks);
  std::unique_ptr<Communicator> solo, mirror, host_world, device_world;
  std::unique_ptr<GpuEngine> engine_holder;
  // Launched as N ranks (deltamoe launch, torchrun, srun, mpirun): one GPU per rank by its local
  // rank, NcclComm over the job, EP = --expert_model_parallel_size (default: every rank), ZeRO-2;
  // each rank times its own step on its own synthetic batches (design §4.5 item 4).
  const LaunchEnv launch = read_launch_env();
  int rank = 0;
  const uint64_t seed = static_cast<uint64_t>(args.get_int("seed"));
  const double recv_headroom = parse_expert_recv_headroom(args.get("expert_recv_headroom"));
  if (simulated_ranks > 0) {
    CHECK(tuner == "full", "--simulate_expert_parallel: LoRA trains on one rank; use --tuner_type full");
    CHECK(config.text.num_experts % simulated_ranks == 0, "--simulate_expert_parallel ", simulated_ranks,
          " does not divide the ", config.text.num_experts, " routed experts");
    solo = make_solo_comm();
    mirror = make_mirror_comm(*solo, 0, simulated_ranks);
    ParallelOptions parallel;
    parallel.expert_parallel_size = simulated_ranks;
    parallel.distributed_optimizer = true;
    // A copy of this rank sends it what it routes to itself: about tokens x K rows in all, the
    // headroom above that covers the random router's imbalance.
    parallel.expert_recv_headroom = recv_headroom;
    engine_holder = std::make_unique<GpuEngine>(config, options, seed, *mirror, parallel);
  } else if (launch.world_size > 1) {
    CHECK(tuner == "full", "bench on ", launch.world_size, " ranks: LoRA trains on one rank; use --tuner_type full");
    int devices = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    CHECK(launch.local_rank < devices, "bench: rank ", launch.rank, " has local rank ", launch.local_rank,
          " but this node shows ", devices, " GPU(s); each rank needs its own GPU");
    CUDA_CHECK(cudaSetDevice(launch.local_rank));
    host_world = connect_world(launch, CommOptions::from_env());
    device_world = make_nccl_comm(*host_world, launch.local_rank, CommOptions::from_env());
    rank = host_world->rank();
    ParallelOptions parallel;
    const int64_t ep = args.get_int("expert_model_parallel_size");
    parallel.expert_parallel_size = ep > 0 ? static_cast<int>(ep) : launch.world_size;
    parallel.distributed_optimizer = true;
    parallel.expert_recv_headroom = recv_headroom;
    engine_holder = std::make_unique<GpuEngine>(config, options, seed, *device_world, parallel);
  } else {
    engine_holder = std::make_unique<GpuEngine>(config, options, seed);
  }
  GpuEngine& engine = *engine_holder;
  engine.text_model().timer().set_enabled(true);
  cudaDeviceProp prop{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  // The floors' memory rate: this GPU's (memory clock x bus width), else the H200's.
  int memory_clock_khz = 0, bus_width_bits = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&memory_clock_khz, cudaDevAttrMemoryClockRate, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&bus_width_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  const double device_bytes_per_s = memory_bytes_per_second(memory_clock_khz, bus_width_bits);
  const double floor_bytes_per_s = device_bytes_per_s > 0 ? device_bytes_per_s : kH200BytesPerSecond;

  Rng rng(static_cast<uint64_t>(args.get_int("seed")), 1 + static_cast<uint64_t>(rank));  // each rank its own tokens
  size_t next_grid = 0;
  std::vector<std::vector<MicroBatch>> step_batches;
  // Two different steps' worth of batches, alternated, so no step reuses the previous one's inputs;
  // with --vary_lengths a packing of its own for every step (the back-to-back steps included).
  CHECK(args.get("vary_lengths") == "true" || args.get("vary_lengths") == "false",
        "--vary_lengths must be true or false, got '", args.get("vary_lengths"), "'");
  const bool varied = args.get("vary_lengths") == "true";
  for (int64_t k = 0; k < (varied ? warmup + 2 * steps : 2); ++k) {
    std::vector<MicroBatch> batches;
    for (int64_t m = 0; m < micro_batches; ++m)
      batches.push_back(synthetic_batch(config, sample_lengths(tokens, seqs, varied, rng), grids,
                                        grids.empty() ? 0.0 : image_fraction, rng, &next_grid));
    step_batches.push_back(std::move(batches));
  }
  int64_t image_tokens = 0, images = 0;
  for (const MicroBatch& batch : step_batches[0]) {
    image_tokens += batch.num_image_tokens;
    images += static_cast<int64_t>(batch.image_grid_thw.size());
  }
  // A sample takes images, in --images' order, while the next one fits its share of the tokens; one
  // that does not ends the sample's images. Asked for images and given none, the run would time a
  // text step under a VLM label: refuse it.
  int64_t images_in_any_step = 0;
  for (const std::vector<MicroBatch>& batches : step_batches)
    for (const MicroBatch& batch : batches) images_in_any_step += static_cast<int64_t>(batch.image_grid_thw.size());
  CHECK(grids.empty() || images_in_any_step > 0, "bench: --images ", args.get("images"),
        " but no image fits a sample: the next image, ", grids[next_grid % grids.size()].first, "x",
        grids[next_grid % grids.size()].second, " merged tokens + 2, is more than --image_fraction ", image_fraction,
        " of a sample's tokens (", tokens, " over ", seqs, " samples); use fewer --seqs, a larger --image_fraction ",
        "or smaller --images");

  std::vector<double> step_ms;
  double first_loss = 0, last_loss = 0, flops = 0;
  double measured_ms = 0, measured_tokens = 0, measured_flops = 0;  // sums over the measured steps
  StepResult last;
  // The measured steps' floors by component (train/step_floors.h), summed over their micro-batches
  // (AdamW's once a step). Single-GPU runs only: a parallel rank holds a share of the experts.
  const bool with_floors = host_world == nullptr && simulated_ranks == 0;
  const bool text_trained = !options.freeze.freeze_llm;
  const int64_t trained_params = engine.state().layout().num_parameters();
  // The parameters whose masters the one-GPU engine keeps split (AdamW's floor is 2 bytes lower
  // there; the models never read routed experts in fp32).
  int64_t split_params = 0;
  for (const ParamEntry& entry : engine.state().layout().entries())
    if (master_kept_split(entry.name, options.lora != nullptr, false)) split_params += entry.numel;
  StepFloors floors;
  ComponentFloor optimizer_floor;
  auto add_step_floors = [&](const std::vector<MicroBatch>& batches) {
    if (!with_floors) return;
    for (const MicroBatch& batch : batches) {
      // The loss head's rows: those whose shifted label is supervised, as the engine lists them.
      const std::vector<int64_t> shifted = shift_packed_labels(batch);
      const int64_t head_rows =
          std::count_if(shifted.begin(), shifted.end(), [](int64_t label) { return label != kIgnoreLabel; });
      floors += micro_batch_floors(config.text, batch.cu_seqlens, text_trained, head_rows);
    }
    optimizer_floor += adamw_floor(trained_params, options.adamw.moment_dtype, split_params);
  };
  // What the steps after the first take that the first did not: allocations (device, pinned), GPU
  // memory (anything a library takes, module loads), cuDNN plans, cuBLASLt heuristic queries.
  AllocationCounts allocations_after_first;
  int64_t plans_after_first = 0, queries_after_first = 0;
  size_t free_after_first = 0;
  int64_t queries_before = 0;
  size_t free_before = 0;
  for (int64_t step = 0; step < warmup + steps; ++step) {
    const bool measured = step >= warmup;
    if (step == warmup) engine.text_model().timer().reset_totals();
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto start = std::chrono::steady_clock::now();
    const std::vector<MicroBatch>& batches = step_batches[static_cast<size_t>(step) % step_batches.size()];
    const PackingShape shape = packing_shape(batches);
    last = engine.train_step(batches, 1e-5, 1.0);
    engine.text_model().timer().finish(engine.text_model().stream());
    CUDA_CHECK(cudaDeviceSynchronize());
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const double loss = last.num_supervised > 0 ? last.ce_sum / static_cast<double>(last.num_supervised) : 0.0;
    if (step == 0) first_loss = loss;
    last_loss = loss;
    CHECK(std::isfinite(loss) && !last.skipped, "bench: the loss or the gradient norm is not finite at step ",
          step + 1, " (loss ", loss, ", norm ", last.grad_norm, ")");
    if (rank == 0) {
      // What this step took that the steps before it had not (after the first): where a library
      // loads or allocates on a new size.
      std::string taken;
      size_t free_bytes = 0, total_bytes = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      const int64_t queries = GemmContext::heuristic_queries();
      if (step > 0 && (queries != queries_before || free_bytes != free_before)) {
        taken = str_cat("  (+", queries - queries_before, " cuBLASLt heuristic queries, GPU memory in use ",
                        static_cast<int64_t>(free_before) - static_cast<int64_t>(free_bytes), " bytes)");
      }
      queries_before = queries;
      free_before = free_bytes;
      std::printf("step %3lld %s %8.2f ms  loss %.4f  grad_norm %.3f  tokens %lld in %lld samples (longest %lld)%s\n",
                  static_cast<long long>(step + 1), measured ? "    " : "warm", ms, loss, last.grad_norm,
                  static_cast<long long>(last.num_tokens), static_cast<long long>(shape.samples),
                  static_cast<long long>(shape.longest), taken.c_str());
      std::fflush(stdout);
    }
    if (measured) {
      step_ms.push_back(ms);
      measured_ms += ms;
      measured_flops += last.flops;
      for (const MicroBatch& batch : batches) measured_tokens += static_cast<double>(batch.num_tokens());
      add_step_floors(batches);
    }
    flops = last.flops;
    if (step == 0) {
      allocations_after_first = allocation_counts();
      plans_after_first = CudnnSdpa::plans_built();
      queries_after_first = GemmContext::heuristic_queries();
      size_t total_bytes = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_after_first, &total_bytes));
    }
  }
  // The measured steps once more, back to back, with one synchronisation before and one after: the
  // host prepares each batch (token checks, rope tables, the embedding's gradient plan: ~3 ms at
  // 8,192 tokens) while the GPU still runs the previous step's optimizer, as a training loop runs
  // and as the transformers anchor is timed (shared/tools/hf_anchor.py's sync_time). The steps above
  // synchronise around each step to time it and its components, which leaves the GPU idle while
  // the host prepares the batch. No component timing here (its events would synchronise).
  engine.text_model().timer().set_enabled(false);
  CUDA_CHECK(cudaDeviceSynchronize());
  // What the GPU's memory in use did over the timed steps, apart from the back-to-back ones below
  // (the per-step lines above show the timed steps' own changes).
  size_t free_before_block = 0, total_before_block = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_before_block, &total_before_block));
  const auto block_start = std::chrono::steady_clock::now();
  double block_tokens = 0;
  // Which back-to-back step changed the memory in use, and its packing (cudaMemGetInfo does not
  // wait for the device: the change shows at the step that caused it or shortly after).
  std::string block_memory_changes;
  size_t free_in_block = free_before_block;
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<MicroBatch>& batches =
        step_batches[static_cast<size_t>(warmup + steps + step) % step_batches.size()];
    const StepResult result = engine.train_step(batches, 1e-5, 1.0);
    CHECK(!result.skipped && result.num_supervised > 0 && std::isfinite(result.ce_sum),
          "bench: the loss or the gradient norm is not finite at back-to-back step ", step + 1);
    for (const MicroBatch& batch : batches) block_tokens += static_cast<double>(batch.num_tokens());
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (free_bytes != free_in_block && rank == 0) {
      const PackingShape shape = packing_shape(batches);
      block_memory_changes += str_cat("back-to-back step ", step + 1, " (", static_cast<int64_t>(result.num_tokens),
                                      " tokens in ", shape.samples, " samples, longest ", shape.longest,
                                      "): GPU memory in use ",
                                      static_cast<int64_t>(free_in_block) - static_cast<int64_t>(free_bytes),
                                      " bytes\n");
    }
    free_in_block = free_bytes;
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  const double block_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - block_start).count();
  const double back_to_back_ms = block_ms / static_cast<double>(steps);
  const double back_to_back_tokens_per_s = block_tokens / (block_ms / 1e3);
  const AllocationCounts allocations_now = allocation_counts();
  size_t free_now = 0, total_now = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_now, &total_now));
  const int64_t new_allocations = allocations_now.device - allocations_after_first.device;
  const int64_t new_pinned = allocations_now.pinned - allocations_after_first.pinned;
  const int64_t new_plans = CudnnSdpa::plans_built() - plans_after_first;
  const int64_t new_queries = GemmContext::heuristic_queries() - queries_after_first;
  const int64_t memory_change = static_cast<int64_t>(free_after_first) - static_cast<int64_t>(free_now);
  const int64_t memory_change_back_to_back = static_cast<int64_t>(free_before_block) - static_cast<int64_t>(free_now);
  const bool steady = new_allocations == 0 && new_pinned == 0 && new_plans == 0 && memory_change == 0;
  const int64_t step_tokens = tokens * micro_batches;
  const double step_median_ms = median(step_ms);
  // Equal steps: the median step; steps of varied sizes: all the measured tokens over their time.
  const double tokens_per_s = varied ? measured_tokens / (measured_ms / 1e3)
                                     : static_cast<double>(step_tokens) / (step_median_ms / 1e3);
  const double tflops = varied ? measured_flops / (measured_ms / 1e3) / 1e12 : flops / (step_median_ms / 1e3) / 1e12;
  const MemoryPlan& plan = engine.memory_plan();
  const TextConfig& text = config.text;
  if (host_world != nullptr) {
    // Every rank's step time and peak, in rank order on rank 0 (the slowest rank sets the pace).
    const std::vector<std::string> rows = host_world->control().all_gather(
        str_cat("  rank ", rank, " (GPU ", device, "): step median ", step_median_ms, " ms, peak ",
                gib(engine.peak_memory_bytes()), " GiB"),
        "bench rank summary");
    if (rank != 0) return 0;
    std::printf("\n%d ranks, EP %lld, ZeRO-2 over NCCL; per rank:\n", launch.world_size,
                static_cast<long long>(engine.parallel_layout()->expert_parallel_size()));
    for (const std::string& row : rows) std::printf("%s\n", row.c_str());
  }

  std::printf("\n== deltamoe bench: %s, %lld layers (%lld GDN + %lld attention), %lld x %lld tokens as %lld x %lld ==\n",
              prop.name, static_cast<long long>(layers),
              static_cast<long long>(text.num_layers_of(LayerType::linear_attention)),
              static_cast<long long>(text.num_layers_of(LayerType::full_attention)),
              static_cast<long long>(micro_batches), static_cast<long long>(tokens), static_cast<long long>(seqs),
              static_cast<long long>(tokens / seqs));
  // Which kernels ran (kernels/common/kernel_path_cuda.h): the sm_90a ones, or the sm_80 ones (an
  // A800; a compute_80 build on the H200, with the driver's compilation of the PTX named).
  const KernelPath& path = kernel_path();
  std::printf("kernels: %s (built for %s); attention: %s\n", path.describe().c_str(), cuda_architectures(),
              engine.text_model().attention_backend());
  if (!grids.empty()) {
    std::printf("images: %lld per step, %lld image tokens (%.0f%% of the tokens); vision tower %s\n",
                static_cast<long long>(images), static_cast<long long>(image_tokens),
                100.0 * static_cast<double>(image_tokens) / static_cast<double>(step_tokens),
                options.freeze.freeze_vit ? "frozen" : "trained");
  }
  std::printf("trained parameters: %.3f B; AdamW moments %s\n",
              static_cast<double>(engine.state().layout().num_parameters()) / 1e9, moments.c_str());
  std::printf("step time: median %.2f ms over %lld steps (min %.2f, max %.2f)\n", step_median_ms,
              static_cast<long long>(steps), *std::min_element(step_ms.begin(), step_ms.end()),
              *std::max_element(step_ms.begin(), step_ms.end()));
  std::printf("tokens/s: %.0f\n", tokens_per_s);
  std::printf("back to back: %.2f ms a step, %.0f tokens/s (the same steps again, one synchronisation before and one "
              "after, as a training loop and the transformers anchor run)\n",
              back_to_back_ms, back_to_back_tokens_per_s);
  std::printf("model TFLOP/s: %.1f (text FLOPs, %.2f GFLOP per token)\n", tflops,
              flops / static_cast<double>(step_tokens) / 1e9);
  std::printf("MFU: %.1f%% of %.0f TFLOP/s peak, %.1f%% of %.0f measured GEMM\n",
              100.0 * tflops / kPeakDenseBf16Tflops, kPeakDenseBf16Tflops, 100.0 * tflops / kMeasuredDenseBf16Tflops,
              kMeasuredDenseBf16Tflops);
  std::printf("loss: first %.4f, last %.4f\n", first_loss, last_loss);
  if (varied) {
    std::printf("lengths: varied, a packing of 1-%lld samples and %lld-%lld tokens per micro-batch for every step; "
                "%.0f tokens per measured step on average\n",
                static_cast<long long>(seqs), static_cast<long long>(tokens / 2), static_cast<long long>(tokens),
                measured_tokens / static_cast<double>(steps));
  }
  std::printf("after step 1, steps 2-%lld and the back-to-back steps: %lld device allocations (%lld bytes), "
              "%lld pinned, %lld cuDNN plans built, "
              "GPU memory in use %+lld bytes (cudaMemGetInfo; %+lld of them over the back-to-back steps); %lld "
              "cuBLASLt heuristic queries (one per GEMM shape not seen before: new token counts): %s\n",
              static_cast<long long>(warmup + steps), static_cast<long long>(new_allocations),
              static_cast<long long>(allocations_now.device_bytes - allocations_after_first.device_bytes),
              static_cast<long long>(new_pinned), static_cast<long long>(new_plans),
              static_cast<long long>(memory_change), static_cast<long long>(memory_change_back_to_back),
              static_cast<long long>(new_queries),
              steady ? "STEADY" : "NOT STEADY");
  std::printf("%s", block_memory_changes.c_str());
  std::printf("host<->device per step: %llu bytes in, %llu bytes out\n",
              static_cast<unsigned long long>(last.host_to_device_bytes),
              static_cast<unsigned long long>(last.device_to_host_bytes));
  std::printf("memory: planned %.2f GiB, peak in use %.2f GiB (incl. CUDA context)\n%s", gib(plan.total()),
              gib(engine.peak_memory_bytes()), plan.describe().c_str());
  std::printf("time per step by component (CUDA events in the text model, mean over measured steps):\n");
  const auto& totals = engine.text_model().timer().totals_ms();
  double sum = 0.0;
  for (double t : totals) sum += t;
  nlohmann::json components = nlohmann::json::object();
  nlohmann::json component_floors = nlohmann::json::object();
  for (int i = 0; i < kNumStepComponents; ++i) {
    const auto component = static_cast<StepComponent>(i);
    const double ms = totals[i] / static_cast<double>(steps);
    const char* name = component_name(component);
    const ComponentFloor* floor = nullptr;
    if (with_floors) {
      switch (component) {
        case StepComponent::gdn: floor = &floors.gdn; break;
        case StepComponent::attention: floor = &floors.attention; break;
        case StepComponent::moe: floor = &floors.moe; break;
        case StepComponent::lm_head_loss: floor = &floors.lm_head_loss; break;
        case StepComponent::optimizer: floor = &optimizer_floor; break;
        default: break;
      }
    }
    std::string beside;
    if (floor != nullptr) {
      const double floor_ms =
          floor->ms(kH200PeakMatmulFlopsPerSecond, floor_bytes_per_s) / static_cast<double>(steps);
      char text[64];
      std::snprintf(text, sizeof(text), "   floor %8.2f ms (%.1fx)", floor_ms, floor_ms > 0 ? ms / floor_ms : 0.0);
      beside = text;
      component_floors[name] = floor_ms;
    }
    std::printf("  %-16s %9.2f ms  %5.1f%%%s\n", name, ms, sum > 0 ? 100.0 * totals[i] / sum : 0.0, beside.c_str());
    components[name] = ms;
  }
  if (with_floors)
    std::printf("  (floors: model FLOPs at 989 TFLOP/s or the weights', gradients' and optimizer state's bytes at "
                "%.2f TB/s (%s), whichever is longer; train/step_floors.h)\n",
                floor_bytes_per_s / 1e12,
                device_bytes_per_s > 0 ? "this GPU's memory clock x bus width" : "the H200's: this GPU's unknown");
  nlohmann::json result = {{"engine", "deltamoe"},
                           {"gpu", prop.name},
                           {"kernels", path.name()},
                           {"kernels_detail", path.describe()},
                           {"cuda_architectures", cuda_architectures()},
                           {"attention", engine.text_model().attention_backend()},
                           {"layers", layers},
                           {"tokens", step_tokens},
                           {"micro_batches", micro_batches},
                           {"seqs", seqs},
                           {"images", images},
                           {"image_tokens", image_tokens},
                           {"freeze_vit", options.freeze.freeze_vit},
                           {"step_ms", step_median_ms},
                           {"tokens_per_s", tokens_per_s},
                           {"back_to_back_step_ms", back_to_back_ms},
                           {"back_to_back_tokens_per_s", back_to_back_tokens_per_s},
                           {"tflops", tflops},
                           {"mfu_peak", tflops / kPeakDenseBf16Tflops},
                           {"mfu_measured", tflops / kMeasuredDenseBf16Tflops},
                           {"peak_mem_gib", gib(engine.peak_memory_bytes())},
                           {"planned_mem_gib", gib(plan.total())},
                           {"h2d_bytes", last.host_to_device_bytes},
                           {"loss_first", first_loss},
                           {"loss_last", last_loss},
                           {"components_ms", components},
                           {"component_floors_ms", component_floors},
                           {"floor_memory_bytes_per_s", floor_bytes_per_s},
                           {"varied_lengths", varied},
                           {"after_first_step",
                            {{"device_allocations", new_allocations},
                             {"pinned_allocations", new_pinned},
                             {"cudnn_plans", new_plans},
                             {"gpu_memory_change_bytes", memory_change},
                             {"gpu_memory_change_back_to_back_bytes", memory_change_back_to_back},
                             {"cublaslt_heuristic_queries", new_queries},
                             {"steady", steady}}}};
  if (simulated_ranks > 0) {
    // The N-GPU step this rank's measured step predicts: the exchange and the ZeRO-2 traffic at the
    // link's effective rate, nothing overlapped (the engine's schedule), the busiest rank's share.
    ExchangeModelInput model_input;
    model_input.ranks = simulated_ranks;
    model_input.tokens_per_rank = tokens;
    model_input.top_k = text.num_experts_per_tok;
    model_input.hidden = text.hidden_size;
    model_input.layers = text.num_hidden_layers;
    model_input.micro_batches = micro_batches;
    model_input.link_bytes_per_s = args.get_double("link_gbps") * 1e9;
    model_input.imbalance = args.get_double("imbalance");
    double dense = 0;
    for (const ParamSpec& spec : build_param_table(config))
      if (!is_routed_expert_tensor(spec.name) && !is_frozen(spec.name, options.freeze))
        dense += static_cast<double>(spec.shape.numel());
    model_input.dense_trained_elements = dense;
    const ExchangeModel model = model_exchange(model_input);
    const double predicted_s = model.predicted_step_seconds(step_median_ms / 1e3, micro_batches);
    const double predicted_tokens_per_s = static_cast<double>(step_tokens) / predicted_s;
    std::printf("simulated: rank 0 of %d (EP %d, ZeRO-2): %lld local experts per layer, exchanges as device copies\n",
                simulated_ranks, simulated_ranks, static_cast<long long>(text.num_experts / simulated_ranks));
    std::printf("predicted %d-GPU step: %.2f ms = %.2f ms x %.2f imbalance + %s at %.0f GB/s -> %.0f tokens/s per GPU, "
                "%.0f per node\n",
                simulated_ranks, predicted_s * 1e3, step_median_ms, model_input.imbalance, model.describe().c_str(),
                args.get_double("link_gbps"), predicted_tokens_per_s, predicted_tokens_per_s * simulated_ranks);
    result["simulated_ranks"] = simulated_ranks;
    result["predicted_step_ms"] = predicted_s * 1e3;
    result["predicted_tokens_per_s"] = predicted_tokens_per_s;
    result["exchange_gb_per_micro_batch"] = model.exchange_bytes / 1e9;
  }
  std::printf("BENCH_JSON %s\n", result.dump().c_str());
  if (!steady) {
    std::fprintf(stderr, "bench: steps after the first allocated or built something (see the 'after step 1' line)\n");
    return 4;
  }
  return 0;
}

#endif

}  // namespace

int cmd_bench(int argc, char** argv) {
  ArgParser args("bench", "time training steps of the GPU engine (random weights, full widths, synthetic batches)");
  args.add_option("config", "a preset or config.json whose widths to use", "qwen3.5-35b-a3b");
  args.add_option("layers", "decoder layers, typed [lin, lin, lin, full] repeated", "4");
  args.add_option("tokens", "tokens per micro-batch (packed)", "8192");
  args.add_option("seqs", "equal-length samples a micro-batch is packed from (with --vary_lengths: the most)", "2");
  args.add_option("vary_lengths", "true: every step packs its own 1..--seqs samples of random lengths into "
                  "half to all of --tokens (shows that steps of new lengths allocate and build nothing)", "false");
  args.add_option("micro_batches", "micro-batches per optimizer step (gradient accumulation)", "1");
  args.add_option("steps", "measured steps", "10");
  args.add_option("warmup", "steps run before measuring", "3");
  args.add_option("images", "image sizes in merged tokens, cycled (e.g. 16x16,20x24,12x30); empty: text only",
                  "");
  args.add_option("image_fraction", "share of each sample's tokens given to images (with --images)", "0.5");
  args.add_option("freeze_vit", "true/false (with --images)", "false");
  args.add_option("freeze_aligner", "true/false (with --images)", "false");
  args.add_option("freeze_llm", "true/false", "false");
  args.add_option("optimizer_state_dtype", "f32 or bf16 Adam moments (bf16 as the transformers baseline)", "bf16");
  declare_expert_grad_dtype_flag(args);
  args.add_option("aux_loss_coef", "router load-balancing loss coefficient (0 as transformers without router logits)",
                  "0");
  args.add_option("loss_chunk", "tokens per lm_head + cross-entropy chunk", "2048");
  args.add_option("seed", "random seed of weights and tokens", "0");
  args.add_option("tuner_type", "full, or lora: the base frozen, LoRA adapters trained (docs/lora.md)", "full");
  args.add_option("lora_rank", "LoRA rank (with --tuner_type lora)", "8");
  args.add_option("lora_alpha", "LoRA alpha (with --tuner_type lora)", "32");
  args.add_option("lora_dropout", "LoRA dropout on the adapters' input (with --tuner_type lora; not with "
                  "--target_parameters, as PEFT)", "0");
  args.add_list("target_modules", "LoRA target modules (with --tuner_type lora; the GPU engine applies the attention "
                "and GDN projections so far)");
  args.add_list("target_parameters", "LoRA on the routed experts' fused weights (with --tuner_type lora), e.g. "
                "mlp.experts.gate_up_proj mlp.experts.down_proj");
  declare_recompute_flags(args, "none");
  args.add_option("expert_model_parallel_size", "launched as several ranks: GPUs the experts are split over (0: all)",
                  "0");
  args.add_option("simulate_expert_parallel", "run rank 0 of this many GPUs (EP = world, ZeRO-2) with the exchange "
                  "as device copies, and predict that many GPUs' step (0: one GPU, every expert)", "0");
  declare_expert_recv_headroom_flag(args, "2");
  args.add_option("link_gbps", "with --simulate_expert_parallel: effective per-GPU link rate of the prediction "
                  "(350: H100/H200 NVLink, 150: A800)", "350");
  args.add_option("imbalance", "with --simulate_expert_parallel: max / mean work over ranks in the prediction",
                  "1.0");
  if (!args.parse(argc, argv)) return 0;
#if DELTAMOE_WITH_CUDA
  return run_bench(args);
#else
  (void)synthetic_batch;
  (void)sample_lengths;
  (void)parse_image_grids;
  RAISE("deltamoe bench needs a CUDA build (this binary was built with DELTAMOE_CUDA=OFF)");
#endif
}

}  // namespace deltamoe
