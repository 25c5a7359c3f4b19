// `deltamoe bench`: full training steps of the GPU engine `train` runs (forward, backward, the
// device optimizer step) at the Qwen3.5-35B-A3B widths with reduced depth and random weights, on
// synthetic packed micro-batches; with --images the samples carry images of the given sizes through
// the vision tower. Prints step time, tokens/s, model TFLOP/s, MFU, the memory plan and time by
// component (CUDA events), then the same steps back to back (one synchronisation around them all,
// the host preparing each batch while the GPU runs the previous optimizer step). With
// --simulate_expert_parallel N it runs rank 0 of an N-GPU job (MirrorComm: the exchange as device
// copies) and prints the N-GPU step the exchange model predicts. Needs a CUDA build.
// Its parts: the batches (bench_batches.h), the engine and its communicators (gpu/bench_session.h),
// the timed and back-to-back steps (gpu/bench_steps.h); here the flags and the report.
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cli/args.h"
#include "cli/bench_batches.h"
#include "cli/commands.h"
#include "cli/expert_recv_flag.h"
#include "cli/grad_dtype_flag.h"
#include "cli/recompute_flags.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/units.h"
#include "data/packer.h"
#include "model/config.h"
#include "train/memory_plan.h"
#include "train/step_floors.h"
#include "train/train_engine.h"

#if DELTAMOE_WITH_CUDA
#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include "cli/gpu/bench_session.h"
#include "cli/gpu/bench_steps.h"
#include "core/cuda_check.h"
#include "kernels/common/kernel_path_cuda.h"
#include "model/param_table.h"
#include "parallel/control_plane.h"
#include "parallel/exchange_model.h"
#include "train/gpu/gpu_engine.h"
#include "train/parallel_layout.h"
#endif

namespace deltamoe {

namespace {

#if DELTAMOE_WITH_CUDA

constexpr double kPeakDenseBf16Tflops = kH200PeakMatmulFlopsPerSecond / 1e12;  // H200 spec sheet, dense bf16
constexpr double kMeasuredDenseBf16Tflops = 790.0;  // measured cuBLAS bf16 GEMM on the H200 (docs/performance.md)

// The flags a run is made of, checked.
struct BenchSettings {
  int64_t layers = 0, steps = 0, warmup = 0;
  std::string moments;  // f32 | bf16
  std::string tuner;    // full | lora
  BenchBatchSpec batches;  // --tokens, --seqs, --micro_batches, --vary_lengths, --images
  uint64_t seed = 0;
};

BenchSettings read_settings(const ArgParser& args) {
  BenchSettings s;
  BenchBatchSpec& b = s.batches;
  s.layers = args.get_int("layers");
  b.tokens = args.get_int("tokens");
  b.seqs = args.get_int("seqs");
  s.steps = args.get_int("steps");
  s.warmup = args.get_int("warmup");
  b.micro_batches = args.get_int("micro_batches");
  CHECK(s.layers >= 1, "--layers must be at least 1, got ", s.layers);
  CHECK(b.seqs >= 1, "--seqs must be at least 1, got ", b.seqs);
  CHECK(b.tokens >= b.seqs && b.tokens % b.seqs == 0, "--tokens (", b.tokens,
        ") must be a positive multiple of --seqs (", b.seqs, ")");
  CHECK(s.steps >= 1, "--steps must be at least 1, got ", s.steps);
  CHECK(s.warmup >= 0, "--warmup must be non-negative, got ", s.warmup);
  CHECK(b.micro_batches >= 1, "--micro_batches must be at least 1, got ", b.micro_batches);
  s.moments = args.get("optimizer_state_dtype");
  CHECK(s.moments == "f32" || s.moments == "bf16", "--optimizer_state_dtype must be f32 or bf16, got '", s.moments,
        "'");
  s.tuner = args.get("tuner_type");
  CHECK(s.tuner == "full" || s.tuner == "lora", "--tuner_type must be full or lora, got '", s.tuner, "'");
  CHECK(args.get("vary_lengths") == "true" || args.get("vary_lengths") == "false",
        "--vary_lengths must be true or false, got '", args.get("vary_lengths"), "'");
  s.seed = static_cast<uint64_t>(args.get_int("seed"));
  b.varied = args.get("vary_lengths") == "true";
  // Two different steps' worth of batches, alternated, so no step reuses the previous one's inputs;
  // with --vary_lengths a packing of its own for every step (the back-to-back steps included).
  b.distinct_steps = b.varied ? s.warmup + 2 * s.steps : 2;
  b.grids = parse_image_grids(args.get("images"));
  b.image_fraction = args.get_double("image_fraction");
  CHECK(b.image_fraction >= 0 && b.image_fraction < 1, "--image_fraction must be in [0, 1), got ", b.image_fraction);
  return s;
}

EngineOptions engine_options(const ArgParser& args, const BenchSettings& s, const ModelConfig& config) {
  EngineOptions options;
  options.freeze = FreezeOptions{args.get("freeze_vit") == "true", args.get("freeze_aligner") == "true",
                                 args.get("freeze_llm") == "true"};
  options.adamw.moment_dtype = s.moments == "bf16" ? DType::bf16 : DType::f32;
  options.expert_grad_dtype = parse_expert_grad_dtype_flag(args);
  options.aux_coef = args.get_double("aux_loss_coef");
  options.max_tokens = s.batches.tokens;
  options.max_samples = s.batches.seqs;
  options.loss_chunk_rows = args.get_int("loss_chunk");
  options.recompute = parse_recompute_flags(args);
  int64_t largest_image = 0;
  for (const auto& [h, w] : s.batches.grids) largest_image = std::max(largest_image, h * w);
  const int64_t token_side = config.vision.patch_size * config.vision.spatial_merge_size;
  options.max_image_pixels = largest_image * token_side * token_side;
  if (s.tuner == "lora") {
    // PEFT's init (B zero) would give every step the same loss curve as the frozen model at first;
    // the bench times the products, which do not depend on the values.
    LoraOptions lora;
    lora.rank = args.get_int("lora_rank");
    lora.alpha = args.get_double("lora_alpha");
    lora.dropout = args.get_double("lora_dropout");
    lora.target_modules = args.get_list("target_modules");
    lora.target_parameters = args.get_list("target_parameters");
    options.lora = std::make_shared<const LoraAdapters>(init_lora_adapters(config, lora, s.seed));
  }
  return options;
}

// The measured steps' floors by component (train/step_floors.h), summed over their micro-batches,
// AdamW's once a step.
struct MeasuredFloors {
  StepFloors text;
  ComponentFloor optimizer;
};
MeasuredFloors measured_floors(const ModelConfig& config, const EngineOptions& options, GpuEngine& engine,
                               const BenchSchedule& schedule) {
  MeasuredFloors floors;
  const bool text_trained = !options.freeze.freeze_llm;
  const int64_t trained_params = engine.state().layout().num_parameters();
  // The parameters whose masters the one-GPU engine keeps split (AdamW's floor is 2 bytes lower
  // there; the models never read routed experts in fp32).
  int64_t split_params = 0;
  for (const ParamEntry& entry : engine.state().layout().entries())
    if (master_kept_split(entry.name, options.lora != nullptr, false)) split_params += entry.numel;
  for (int64_t step = schedule.warmup; step < schedule.warmup + schedule.steps; ++step) {
    for (const MicroBatch& batch : schedule.step(step)) {
      // The loss head's rows: those whose shifted label is supervised, as the engine lists them.
      const std::vector<int64_t> shifted = shift_packed_labels(batch);
      const int64_t head_rows =
          std::count_if(shifted.begin(), shifted.end(), [](int64_t label) { return label != kIgnoreLabel; });
      floors.text += micro_batch_floors(config.text, batch.cu_seqlens, text_trained, head_rows);
    }
    floors.optimizer += adamw_floor(trained_params, options.adamw.moment_dtype, split_params);
  }
  return floors;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The run's numbers as the report prints them.
struct BenchSummary {
  int64_t step_tokens = 0, images = 0, image_tokens = 0;
  double step_median_ms = 0, tokens_per_s = 0, tflops = 0;
  // What the steps after the first took (ResourceSnapshot): allocations, their bytes, pinned
  // allocations, cuDNN plans, cuBLASLt queries, GPU memory in use (all steps; the back-to-back ones).
  int64_t new_allocations = 0, new_allocation_bytes = 0, new_pinned = 0, new_plans = 0, new_queries = 0;
  int64_t memory_change = 0, memory_change_back_to_back = 0;
  bool steady = false;
};

BenchSummary summarise(const BenchSettings& s, const BenchSchedule& schedule, const TimedSteps& timed,
                       const BackToBackSteps& block) {
  BenchSummary sum;
  sum.step_tokens = s.batches.tokens * s.batches.micro_batches;
  for (const MicroBatch& batch : schedule.step(0)) {
    sum.image_tokens += batch.num_image_tokens;
    sum.images += static_cast<int64_t>(batch.image_grid_thw.size());
  }
  sum.step_median_ms = median(timed.step_ms);
  // Equal steps: the median step; steps of varied sizes: all the measured tokens over their time.
  const bool varied = s.batches.varied;
  sum.tokens_per_s = varied ? timed.measured_tokens / (timed.measured_ms / 1e3)
                            : static_cast<double>(sum.step_tokens) / (sum.step_median_ms / 1e3);
  sum.tflops = varied ? timed.measured_flops / (timed.measured_ms / 1e3) / 1e12
                      : timed.last.flops / (sum.step_median_ms / 1e3) / 1e12;
  const ResourceSnapshot now = ResourceSnapshot::take();
  const ResourceSnapshot& first = timed.after_first;
  sum.new_allocations = now.allocations.device - first.allocations.device;
  sum.new_allocation_bytes = now.allocations.device_bytes - first.allocations.device_bytes;
  sum.new_pinned = now.allocations.pinned - first.allocations.pinned;
  sum.new_plans = now.cudnn_plans - first.cudnn_plans;
  sum.new_queries = now.cublaslt_queries - first.cublaslt_queries;
  sum.memory_change = static_cast<int64_t>(first.free_bytes) - static_cast<int64_t>(now.free_bytes);
  sum.memory_change_back_to_back = static_cast<int64_t>(block.before.free_bytes) - static_cast<int64_t>(now.free_bytes);
  sum.steady = sum.new_allocations == 0 && sum.new_pinned == 0 && sum.new_plans == 0 && sum.memory_change == 0;
  return sum;
}

// Prints the report and returns its JSON. `floors`: null where none are printed (a parallel rank
// holds a share of the experts).
nlohmann::json print_report(const BenchSettings& s, const ModelConfig& config, const EngineOptions& options,
                            BenchSession& session, const TimedSteps& timed, const BackToBackSteps& block,
                            const BenchSummary& sum, const MeasuredFloors* floors) {
  GpuEngine& engine = *session.engine;
  const TextConfig& text = config.text;
  const BenchBatchSpec& b = s.batches;
  const MemoryPlan& plan = engine.memory_plan();
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
  std::printf("\n== deltamoe bench: %s, %lld layers (%lld GDN + %lld attention), %lld x %lld tokens as %lld x %lld ==\n",
              prop.name, static_cast<long long>(s.layers),
              static_cast<long long>(text.num_layers_of(LayerType::linear_attention)),
              static_cast<long long>(text.num_layers_of(LayerType::full_attention)),
              static_cast<long long>(b.micro_batches), static_cast<long long>(b.tokens), static_cast<long long>(b.seqs),
              static_cast<long long>(b.tokens / b.seqs));
  // Which kernels ran (kernels/common/kernel_path_cuda.h): the sm_90a ones, or the sm_80 ones (an
  // A800; a compute_80 build on the H200, with the driver's compilation of the PTX named).
  const KernelPath& path = kernel_path();
  std::printf("kernels: %s (built for %s); attention: %s\n", path.describe().c_str(), cuda_architectures(),
              engine.text_model().attention_backend());
  if (!b.grids.empty()) {
    std::printf("images: %lld per step, %lld image tokens (%.0f%% of the tokens); vision tower %s\n",
                static_cast<long long>(sum.images), static_cast<long long>(sum.image_tokens),
                100.0 * static_cast<double>(sum.image_tokens) / static_cast<double>(sum.step_tokens),
                options.freeze.freeze_vit ? "frozen" : "trained");
  }
  std::printf("trained parameters: %.3f B; AdamW moments %s\n",
              static_cast<double>(engine.state().layout().num_parameters()) / 1e9, s.moments.c_str());
  std::printf("step time: median %.2f ms over %lld steps (min %.2f, max %.2f)\n", sum.step_median_ms,
              static_cast<long long>(s.steps), *std::min_element(timed.step_ms.begin(), timed.step_ms.end()),
              *std::max_element(timed.step_ms.begin(), timed.step_ms.end()));
  std::printf("tokens/s: %.0f\n", sum.tokens_per_s);
  std::printf("back to back: %.2f ms a step, %.0f tokens/s (the same steps again, one synchronisation before and one "
              "after, as a training loop and the transformers anchor run)\n",
              block.ms_per_step, block.tokens_per_s);
  std::printf("model TFLOP/s: %.1f (text FLOPs, %.2f GFLOP per token)\n", sum.tflops,
              timed.last.flops / static_cast<double>(sum.step_tokens) / 1e9);
  std::printf("MFU: %.1f%% of %.0f TFLOP/s peak, %.1f%% of %.0f measured GEMM\n",
              100.0 * sum.tflops / kPeakDenseBf16Tflops, kPeakDenseBf16Tflops,
              100.0 * sum.tflops / kMeasuredDenseBf16Tflops,
              kMeasuredDenseBf16Tflops);
  std::printf("loss: first %.4f, last %.4f\n", timed.first_loss, timed.last_loss);
  if (b.varied) {
    std::printf("lengths: varied, a packing of 1-%lld samples and %lld-%lld tokens per micro-batch for every step; "
                "%.0f tokens per measured step on average\n",
                static_cast<long long>(b.seqs), static_cast<long long>(b.tokens / 2), static_cast<long long>(b.tokens),
                timed.measured_tokens / static_cast<double>(s.steps));
  }
  std::printf("after step 1, steps 2-%lld and the back-to-back steps: %lld device allocations (%lld bytes), "
              "%lld pinned, %lld cuDNN plans built, "
              "GPU memory in use %+lld bytes (cudaMemGetInfo; %+lld of them over the back-to-back steps); %lld "
              "cuBLASLt heuristic queries (one per GEMM shape not seen before: new token counts): %s\n",
              static_cast<long long>(s.warmup + s.steps), static_cast<long long>(sum.new_allocations),
              static_cast<long long>(sum.new_allocation_bytes),
              static_cast<long long>(sum.new_pinned), static_cast<long long>(sum.new_plans),
              static_cast<long long>(sum.memory_change), static_cast<long long>(sum.memory_change_back_to_back),
              static_cast<long long>(sum.new_queries),
              sum.steady ? "STEADY" : "NOT STEADY");
  std::printf("%s", block.memory_changes.c_str());
  std::printf("host<->device per step: %llu bytes in, %llu bytes out\n",
              static_cast<unsigned long long>(timed.last.host_to_device_bytes),
              static_cast<unsigned long long>(timed.last.device_to_host_bytes));
  std::printf("memory: planned %.2f GiB, peak in use %.2f GiB (incl. CUDA context)\n%s", gib(plan.total()),
              gib(engine.peak_memory_bytes()), plan.describe().c_str());
  std::printf("time per step by component (CUDA events in the text model, mean over measured steps):\n");
  const auto& totals = engine.text_model().timer().totals_ms();
  double all_ms = 0.0;
  for (double t : totals) all_ms += t;
  nlohmann::json components = nlohmann::json::object();
  nlohmann::json component_floors = nlohmann::json::object();
  for (int i = 0; i < kNumStepComponents; ++i) {
    const auto component = static_cast<StepComponent>(i);
    const double ms = totals[i] / static_cast<double>(s.steps);
    const char* name = component_name(component);
    const ComponentFloor* floor = nullptr;
    if (floors != nullptr) {
      switch (component) {
        case StepComponent::gdn: floor = &floors->text.gdn; break;
        case StepComponent::attention: floor = &floors->text.attention; break;
        case StepComponent::moe: floor = &floors->text.moe; break;
        case StepComponent::lm_head_loss: floor = &floors->text.lm_head_loss; break;
        case StepComponent::optimizer: floor = &floors->optimizer; break;
        default: break;
      }
    }
    std::string beside;
    if (floor != nullptr) {
      const double floor_ms =
          floor->ms(kH200PeakMatmulFlopsPerSecond, floor_bytes_per_s) / static_cast<double>(s.steps);
      char cell[64];
      std::snprintf(cell, sizeof(cell), "   floor %8.2f ms (%.1fx)", floor_ms, floor_ms > 0 ? ms / floor_ms : 0.0);
      beside = cell;
      component_floors[name] = floor_ms;
    }
    std::printf("  %-16s %9.2f ms  %5.1f%%%s\n", name, ms, all_ms > 0 ? 100.0 * totals[i] / all_ms : 0.0,
                beside.c_str());
    components[name] = ms;
  }
  if (floors != nullptr)
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
                           {"layers", s.layers},
                           {"tokens", sum.step_tokens},
                           {"micro_batches", b.micro_batches},
                           {"seqs", b.seqs},
                           {"images", sum.images},
                           {"image_tokens", sum.image_tokens},
                           {"freeze_vit", options.freeze.freeze_vit},
                           {"step_ms", sum.step_median_ms},
                           {"tokens_per_s", sum.tokens_per_s},
                           {"back_to_back_step_ms", block.ms_per_step},
                           {"back_to_back_tokens_per_s", block.tokens_per_s},
                           {"tflops", sum.tflops},
                           {"mfu_peak", sum.tflops / kPeakDenseBf16Tflops},
                           {"mfu_measured", sum.tflops / kMeasuredDenseBf16Tflops},
                           {"peak_mem_gib", gib(engine.peak_memory_bytes())},
                           {"planned_mem_gib", gib(plan.total())},
                           {"h2d_bytes", timed.last.host_to_device_bytes},
                           {"loss_first", timed.first_loss},
                           {"loss_last", timed.last_loss},
                           {"components_ms", components},
                           {"component_floors_ms", component_floors},
                           {"floor_memory_bytes_per_s", floor_bytes_per_s},
                           {"varied_lengths", b.varied},
                           {"after_first_step",
                            {{"device_allocations", sum.new_allocations},
                             {"pinned_allocations", sum.new_pinned},
                             {"cudnn_plans", sum.new_plans},
                             {"gpu_memory_change_bytes", sum.memory_change},
                             {"gpu_memory_change_back_to_back_bytes", sum.memory_change_back_to_back},
                             {"cublaslt_heuristic_queries", sum.new_queries},
                             {"steady", sum.steady}}}};
  return result;
}

// The N-GPU step rank 0's measured step predicts (--simulate_expert_parallel): the exchange and the
// ZeRO-2 traffic at the link's effective rate, nothing overlapped (the engine's schedule), the
// busiest rank's share; printed and added to the JSON.
void add_expert_parallel_prediction(const ArgParser& args, const BenchSettings& s, const ModelConfig& config,
                                    const EngineOptions& options, const BenchSession& session,
                                    const BenchSummary& sum, nlohmann::json& result) {
  const TextConfig& text = config.text;
  const int ranks = session.simulated_ranks;
  ExchangeModelInput model_input;
  model_input.ranks = ranks;
  model_input.tokens_per_rank = s.batches.tokens;
  model_input.top_k = text.num_experts_per_tok;
  model_input.hidden = text.hidden_size;
  model_input.layers = text.num_hidden_layers;
  model_input.micro_batches = s.batches.micro_batches;
  model_input.link_bytes_per_s = args.get_double("link_gbps") * 1e9;
  model_input.imbalance = args.get_double("imbalance");
  double dense = 0;
  for (const ParamSpec& spec : build_param_table(config))
    if (!is_routed_expert_tensor(spec.name) && !is_frozen(spec.name, options.freeze))
      dense += static_cast<double>(spec.shape.numel());
  model_input.dense_trained_elements = dense;
  const ExchangeModel model = model_exchange(model_input);
  const double predicted_s = model.predicted_step_seconds(sum.step_median_ms / 1e3, s.batches.micro_batches);
  const double predicted_tokens_per_s = static_cast<double>(sum.step_tokens) / predicted_s;
  std::printf("simulated: rank 0 of %d (EP %d, ZeRO-2): %lld local experts per layer, exchanges as device copies\n",
              ranks, ranks, static_cast<long long>(text.num_experts / ranks));
  std::printf("predicted %d-GPU step: %.2f ms = %.2f ms x %.2f imbalance + %s at %.0f GB/s -> %.0f tokens/s per GPU, "
              "%.0f per node\n",
              ranks, predicted_s * 1e3, sum.step_median_ms, model_input.imbalance, model.describe().c_str(),
              args.get_double("link_gbps"), predicted_tokens_per_s, predicted_tokens_per_s * ranks);
  result["simulated_ranks"] = ranks;
  result["predicted_step_ms"] = predicted_s * 1e3;
  result["predicted_tokens_per_s"] = predicted_tokens_per_s;
  result["exchange_gb_per_micro_batch"] = model.exchange_bytes / 1e9;
}

int run_bench(const ArgParser& args) {
  const BenchSettings s = read_settings(args);
  const ModelConfig config =
      reduced_depth_config(resolve_model_config(args.get("config")), s.layers, s.batches.grids.empty());
  const EngineOptions options = engine_options(args, s, config);
  BenchSession session = open_bench_session(args, config, options, s.seed);
  GpuEngine& engine = *session.engine;
  engine.text_model().timer().set_enabled(true);

  Rng rng(s.seed, 1 + static_cast<uint64_t>(session.rank));  // each rank its own tokens
  const std::vector<std::vector<MicroBatch>> step_batches = make_bench_batches(config, s.batches, rng);
  const BenchSchedule schedule{&step_batches, s.warmup, s.steps};
  const TimedSteps timed = run_timed_steps(engine, schedule, session.rank);
  // The measured steps once more, back to back; no component timing there.
  const BackToBackSteps block = run_back_to_back(engine, schedule, session.rank);
  const BenchSummary sum = summarise(s, schedule, timed, block);
  if (session.launched()) {
    // Every rank's step time and peak, in rank order on rank 0 (the slowest rank sets the pace).
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    const std::vector<std::string> rows = session.host_world->control().all_gather(
        str_cat("  rank ", session.rank, " (GPU ", device, "): step median ", sum.step_median_ms, " ms, peak ",
                gib(engine.peak_memory_bytes()), " GiB"),
        "bench rank summary");
    if (session.rank != 0) return 0;
    std::printf("\n%d ranks, EP %lld, ZeRO-2 over NCCL; per rank:\n", session.launch.world_size,
                static_cast<long long>(engine.parallel_layout()->expert_parallel_size()));
    for (const std::string& row : rows) std::printf("%s\n", row.c_str());
  }
  // Floors for one-GPU runs only: a parallel rank holds a share of the experts.
  const bool with_floors = !session.launched() && session.simulated_ranks == 0;
  const MeasuredFloors floors = with_floors ? measured_floors(config, options, engine, schedule) : MeasuredFloors{};
  nlohmann::json result =
      print_report(s, config, options, session, timed, block, sum, with_floors ? &floors : nullptr);
  if (session.simulated_ranks > 0) add_expert_parallel_prediction(args, s, config, options, session, sum, result);
  std::printf("BENCH_JSON %s\n", result.dump().c_str());
  if (!sum.steady) {
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
  RAISE("deltamoe bench needs a CUDA build (this binary was built with DELTAMOE_CUDA=OFF)");
#endif
}

}  // namespace deltamoe
