// `deltamoe bench`: full training steps (forward, backward, AdamW) of the text model on one GPU at
// the Qwen3.5-35B-A3B widths with reduced depth and random weights; prints step time, tokens/s,
// model TFLOP/s, MFU, memory by kind and time by component (CUDA events). Needs a CUDA build.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "model/config.h"

#if DELTAMOE_WITH_CUDA
#include <nlohmann/json.hpp>

#include "core/cuda_check.h"
#include "core/rng.h"
#include "train/model_flops.h"
#include "model/text/gpu/gpu_text_model.h"
#endif

namespace deltamoe {

namespace {

constexpr double kPeakDenseBf16Tflops = 989.0;     // H200 spec sheet, dense bf16
constexpr double kMeasuredDenseBf16Tflops = 790.0;  // measured cuBLAS GEMM on the H200 (baselines.md)

// Preset widths with `layers` layers typed [lin, lin, lin, full] repeated.
TextConfig bench_config(const std::string& preset, int64_t layers) {
  TextConfig c = resolve_model_config(preset).text;
  c.num_hidden_layers = layers;
  c.layer_types.clear();
  for (int64_t i = 0; i < layers; ++i)
    c.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::full_attention : LayerType::linear_attention);
  c.tie_word_embeddings = false;
  return c;
}

#if DELTAMOE_WITH_CUDA

double gib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

int run_bench(const ArgParser& args) {
  const int64_t layers = args.get_int("layers"), tokens = args.get_int("tokens"), seqs = args.get_int("seqs");
  const int64_t steps = args.get_int("steps"), warmup = args.get_int("warmup");
  CHECK(layers >= 1, "--layers must be at least 1, got ", layers);
  CHECK(seqs >= 1, "--seqs must be at least 1, got ", seqs);
  CHECK(tokens >= seqs && tokens % seqs == 0, "--tokens (", tokens, ") must be a positive multiple of --seqs (", seqs,
        ")");
  CHECK(steps >= 1, "--steps must be at least 1, got ", steps);
  CHECK(warmup >= 0, "--warmup must be non-negative, got ", warmup);
  const std::string moments = args.get("optimizer_state_dtype");
  CHECK(moments == "f32" || moments == "bf16", "--optimizer_state_dtype must be f32 or bf16, got '", moments, "'");
  const TextConfig config = bench_config(args.get("config"), layers);

  size_t free_start = 0, total_memory = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_start, &total_memory));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

  GpuModelOptions options;
  options.max_tokens = tokens;
  options.max_seqs = seqs;
  options.loss_chunk_rows = args.get_int("loss_chunk");
  options.adamw.moment_dtype = moments == "bf16" ? DType::bf16 : DType::f32;
  options.aux_loss_weight = static_cast<float>(args.get_double("aux_loss_weight"));
  options.time_components = true;
  options.recompute_mixers = args.flag("recompute");
  GpuTextModel model(config, "model", options);
  model.randomize_params(static_cast<uint64_t>(args.get_int("seed")), 0.02f);

  // Random tokens in seqs equal sequences; labels are the next token (-100 at each sequence end).
  const int64_t seq_len = tokens / seqs;
  Rng rng(static_cast<uint64_t>(args.get_int("seed")), 1);
  std::vector<int64_t> ids(static_cast<size_t>(tokens)), labels(static_cast<size_t>(tokens));
  for (int64_t& id : ids) id = static_cast<int64_t>(rng.below(static_cast<uint64_t>(config.vocab_size)));
  std::vector<int32_t> cu_seqlens;
  for (int64_t s = 0; s <= seqs; ++s) cu_seqlens.push_back(static_cast<int32_t>(s * seq_len));
  for (int64_t t = 0; t < tokens; ++t) labels[t] = (t + 1) % seq_len == 0 ? -100 : ids[t + 1];
  model.set_batch(ids, labels, cu_seqlens);

  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> step_ms;
  float first_loss = 0.0f, last_loss = 0.0f;
  for (int64_t step = 0; step < warmup + steps; ++step) {
    const bool measured = step >= warmup;
    if (step == warmup) model.timer().reset_totals();
    CUDA_CHECK(cudaEventRecord(start, model.stream()));
    model.forward_backward();
    model.optimizer_step(1e-5, step + 1);
    CUDA_CHECK(cudaEventRecord(stop, model.stream()));
    model.timer().finish(model.stream());
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const float loss = model.read_loss();
    if (step == 0) first_loss = loss;
    last_loss = loss;
    CHECK(std::isfinite(loss), "bench: the loss is not finite at step ", step + 1, " (", loss, ")");
    std::printf("step %3lld %s %8.2f ms  loss %.4f\n", static_cast<long long>(step + 1), measured ? "    " : "warm",
                ms, loss);
    std::fflush(stdout);
    if (measured) step_ms.push_back(ms);
  }
  size_t free_end = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_end, &total_memory));

  const double step_median_ms = median(step_ms);
  const double tokens_per_s = static_cast<double>(tokens) / (step_median_ms / 1e3);
  const double flops = training_step_flops(config, cu_seqlens);
  const double tflops = flops / (step_median_ms / 1e3) / 1e12;
  const GpuMemoryBreakdown mem = model.memory();
  const size_t planned = mem.weights + mem.gradients + mem.optimizer + mem.activations + mem.workspace;
  const size_t device_used = free_start - free_end;

  std::printf("\n== deltamoe bench: %s, %lld layers (%lld GDN + %lld attention), %lld tokens as %lld x %lld ==\n",
              prop.name, static_cast<long long>(layers),
              static_cast<long long>(config.num_layers_of(LayerType::linear_attention)),
              static_cast<long long>(config.num_layers_of(LayerType::full_attention)),
              static_cast<long long>(tokens), static_cast<long long>(seqs), static_cast<long long>(seq_len));
  std::printf("parameters: %.3f B total, %.3f B in matmuls per token; AdamW moments %s; mixer recompute %s\n",
              static_cast<double>(model.layout().num_parameters()) / 1e9,
              static_cast<double>(matmul_params_per_token(config)) / 1e9, moments.c_str(),
              options.recompute_mixers ? "on" : "off");
  std::printf("step time: median %.2f ms over %lld steps (min %.2f, max %.2f)\n", step_median_ms,
              static_cast<long long>(steps), *std::min_element(step_ms.begin(), step_ms.end()),
              *std::max_element(step_ms.begin(), step_ms.end()));
  std::printf("tokens/s: %.0f\n", tokens_per_s);
  std::printf("model TFLOP/s: %.1f (%.2f GFLOP per token)\n", tflops, flops / static_cast<double>(tokens) / 1e9);
  std::printf("MFU: %.1f%% of %.0f TFLOP/s peak, %.1f%% of %.0f measured GEMM\n",
              100.0 * tflops / kPeakDenseBf16Tflops, kPeakDenseBf16Tflops, 100.0 * tflops / kMeasuredDenseBf16Tflops,
              kMeasuredDenseBf16Tflops);
  std::printf("loss: first %.4f, last %.4f\n", first_loss, last_loss);
  std::printf("memory: planned %.2f GiB, device used %.2f GiB (incl. CUDA context and cuBLAS)\n", gib(planned),
              gib(device_used));
  std::printf("  weights (bf16 + fp32 master) %.2f GiB\n", gib(mem.weights));
  std::printf("  gradients (fp32)             %.2f GiB\n", gib(mem.gradients));
  std::printf("  optimizer state              %.2f GiB\n", gib(mem.optimizer));
  std::printf("  activations                  %.2f GiB\n", gib(mem.activations));
  std::printf("  workspace + inputs           %.2f GiB\n", gib(mem.workspace));
  std::printf("time per step by component (CUDA events, mean over measured steps):\n");
  const auto& totals = model.timer().totals_ms();
  double sum = 0.0;
  for (double t : totals) sum += t;
  nlohmann::json components = nlohmann::json::object();
  for (int i = 0; i < kNumStepComponents; ++i) {
    const double ms = totals[i] / static_cast<double>(steps);
    const char* name = component_name(static_cast<StepComponent>(i));
    std::printf("  %-16s %9.2f ms  %5.1f%%\n", name, ms, sum > 0 ? 100.0 * totals[i] / sum : 0.0);
    components[name] = ms;
  }
  nlohmann::json result = {{"engine", "deltamoe"},
                           {"gpu", prop.name},
                           {"layers", layers},
                           {"tokens", tokens},
                           {"seqs", seqs},
                           {"recompute", options.recompute_mixers},
                           {"step_ms", step_median_ms},
                           {"tokens_per_s", tokens_per_s},
                           {"tflops", tflops},
                           {"mfu_peak", tflops / kPeakDenseBf16Tflops},
                           {"mfu_measured", tflops / kMeasuredDenseBf16Tflops},
                           {"peak_mem_gib", gib(device_used)},
                           {"planned_mem_gib", gib(planned)},
                           {"loss_first", first_loss},
                           {"loss_last", last_loss},
                           {"components_ms", components}};
  std::printf("BENCH_JSON %s\n", result.dump().c_str());
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return 0;
}

#endif

}  // namespace

int cmd_bench(int argc, char** argv) {
  ArgParser args("bench", "time training steps of the text model on one GPU (random weights, full widths)");
  args.add_option("config", "a preset or config.json whose widths to use", "qwen3.5-35b-a3b");
  args.add_option("layers", "decoder layers, typed [lin, lin, lin, full] repeated", "4");
  args.add_option("tokens", "tokens per step (packed)", "8192");
  args.add_option("seqs", "equal-length sequences the tokens are packed from", "2");
  args.add_option("steps", "measured steps", "10");
  args.add_option("warmup", "steps run before measuring", "3");
  args.add_option("optimizer_state_dtype", "f32 or bf16 Adam moments (bf16 as the transformers baseline)", "bf16");
  args.add_option("aux_loss_weight", "router load-balancing loss weight (0 as transformers without router logits)",
                  "0");
  args.add_option("loss_chunk", "tokens per lm_head + cross-entropy chunk", "1024");
  args.add_option("seed", "random seed of weights and tokens", "0");
  args.add_flag("recompute", "rerun each GDN/attention mixer's forward before its backward (less activation memory)");
  if (!args.parse(argc, argv)) return 0;
#if DELTAMOE_WITH_CUDA
  return run_bench(args);
#else
  (void)bench_config;
  RAISE("deltamoe bench needs a CUDA build (this binary was built with DELTAMOE_CUDA=OFF)");
#endif
}

}  // namespace deltamoe
